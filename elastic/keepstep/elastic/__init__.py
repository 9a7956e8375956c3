"""keepstep.elastic: the library inside each training process."""
