"""The training loop's heap, kept out of the cyclic garbage collector's full passes.

Where it sits: around the job's loop (job.py ``Job.steps``). A training process holds
hundreds of thousands of long-lived objects before its first step (torch's modules, the
model, the dataset). Python's collector walks all of them at every full collection, which
comes when enough new containers have survived: a recovery allocates many (the sharded
state's pieces, the epoch's tables), so every member reached a full pass at the same moment
of the same recovery, each ~0.2 s of CPU, and 8 members on 2 cores made it ~0.8 s of the
recovery (bench/mttr_matrix.py at 8 nodes). Steps pay the same pauses, at different times
on different members, and the slowest member sets every step's pace.

So the loop freezes what exists when it starts (``gc.freeze``: the collector ignores those
objects, reference counting still frees them) after one collection of what is garbage
already, and unfreezes it when the loop ends. Cyclic garbage made of objects that existed
before the loop is freed at that end, not during the loop.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, then keep what exists now out of every collection until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
