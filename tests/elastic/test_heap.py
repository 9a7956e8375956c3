"""The training loop keeps the script's long-lived objects out of the collector's passes."""

from __future__ import annotations

import gc

import torch.nn.functional as F
from test_api import make

import keepstep
from keepstep.elastic.heap import frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_loop_freezes_what_exists_when_it_starts_and_unfreezes_at_its_end() -> None:
    assert gc.get_freeze_count() == 0
    model, opt, data = make()
    job = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, env={})
    frozen_during = []
    for step in job.steps(3):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        assert step.commit()
        frozen_during.append(gc.get_freeze_count())
    # The model, torch's modules, the data: all out of the collector's way in every step.
    assert min(frozen_during) > 10_000
    assert gc.get_freeze_count() == 0  # and back in it once the loop has ended


def test_garbage_from_before_is_collected_first_and_new_garbage_during() -> None:
    collected = []
    _Cycle()  # a cycle that is garbage already: collected before the freeze
    with frozen_heap():
        collected.append(gc.collect())  # nothing left to collect of what came before
        _Cycle()
        collected.append(gc.collect())  # a cycle made inside: collected as usual
    assert collected[0] == 0 and collected[1] >= 1
    assert gc.get_freeze_count() == 0
