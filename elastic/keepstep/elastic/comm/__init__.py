"""keepstep.elastic.comm: a gloo group per membership epoch, rebuilt in the same processes.

Where it sits: between the job (job.py), which enters each epoch the agents agree on, and
the reducers, which run their collectives through it. The agents use the abort key from
here to end an epoch on every rank at once.

    abort.py        the abort key of an epoch, and ``abort_epoch`` that writes it
    watch.py        one rank's threads that hear the key (pushed) and read it (polled)
    group.py        the epoch's agreed parameters, and building its gloo group
    communicator.py ``Communicator``: collectives of one epoch, the owner of all of it
    reap.py         dropping given-up groups off the caller's thread
    exit_guard.py   the one process-wide part: settling threads before the interpreter exits

One owner per epoch: a ``Communicator`` owns its abort watch (threads and store
connections) and its group, and ``close`` releases them. What must outlive every epoch (the
reaper, the stop at interpreter exit) belongs to the one ``ExitGuard`` of the process.
"""

from keepstep.elastic.comm.abort import abort_epoch, abort_key, wake_key
from keepstep.elastic.comm.communicator import Communicator
from keepstep.elastic.comm.watch import WATCH_TIMEOUT

__all__ = ["WATCH_TIMEOUT", "Communicator", "abort_epoch", "abort_key", "wake_key"]
