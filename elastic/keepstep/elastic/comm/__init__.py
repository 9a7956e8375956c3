"""keepstep.elastic.comm: a group per membership epoch, rebuilt in the same processes.

Where it sits: between the job (job.py), which enters each epoch the agents agree on, and
the reducers, which run their collectives through it. The agents use the abort key from
here to end an epoch on every rank at once.

    abort.py        the abort key of an epoch, and ``abort_epoch`` that writes it
    watch.py        one rank's threads that hear the key (pushed) and read it (polled)
    group.py        the epoch's agreed parameters, and building its group on a thread
    transport.py    the seam per backend: connect, start, poll, interrupt, retire
    gloo.py         the gloo transport (CPU tensors)
    nccl.py         the NCCL transport (CUDA tensors): abort, one live communicator
    nccl_policy.py  its decisions, pure; nccl_group.py  building its torch group (GPU)
    communicator.py ``Communicator``: collectives of one epoch, the owner of all of it
    reap.py         dropping given-up groups off the caller's thread
    exit_guard.py   the one process-wide part: settling threads before the interpreter exits

One owner per epoch: a ``Communicator`` owns its abort watch (threads and store
connections) and its group, and ``close`` releases them. What must outlive every epoch (the
reaper, the stop at interpreter exit) belongs to the one ``ExitGuard`` of the process.
"""

from keepstep.elastic.comm.abort import abort_epoch, abort_key, wake_key
from keepstep.elastic.comm.communicator import Communicator
from keepstep.elastic.comm.transport import Backend, select_backend
from keepstep.elastic.comm.watch import WATCH_TIMEOUT

__all__ = [
    "WATCH_TIMEOUT",
    "Backend",
    "Communicator",
    "abort_epoch",
    "abort_key",
    "select_backend",
    "wake_key",
]
