"""Reading micro-batches in forked processes (data_workers.py): the same bits as a read in
the training thread's keyed scope, dropped guesses, a reader's error, a lost worker."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from keepstep.elastic import ConfigError, KeepstepError
from keepstep.elastic.data import MicroBatchLoader
from keepstep.elastic.rng import DATA, rng_scope


class Drawing(torch.utils.data.Dataset[torch.Tensor]):
    """Each read draws from torch's, ``random``'s and numpy's global generators."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is unreadable")
        noise = torch.randn(3) + random.random() + float(np.random.uniform())
        return torch.full((3,), float(i)) + noise


SEED = 11


def _in_thread(dataset: Drawing, key: tuple[int, int], indices: list[int]) -> torch.Tensor:
    with rng_scope(SEED, key[0], key[1], purpose=DATA):
        return default_collate([dataset[i] for i in indices])


def _get(loader: MicroBatchLoader, key: tuple[int, int], indices: list[int]) -> torch.Tensor:
    """What Step.micro_batches does: the loader asked inside the micro-batch's data scope
    (a read in the training thread draws keyed numbers there)."""
    with rng_scope(SEED, key[0], key[1], purpose=DATA):
        return loader.get(key, indices, timeout=60)


def _plan(step: int) -> list[tuple[tuple[int, int], list[int]]]:
    return [((step, mb), [4 * mb + step + j for j in range(4)]) for mb in range(4)]


def test_a_worker_reads_the_bits_the_training_thread_reads() -> None:
    data = Drawing()
    loader = MicroBatchLoader(data, default_collate, workers=2, seed=SEED)
    try:
        assert loader.prefetch == 4  # two a worker
        planned = _plan(0) + _plan(1)
        for i, (key, indices) in enumerate(planned):
            loader.ahead(planned[i:])
            got = _get(loader, key, indices)
            assert torch.equal(got, _in_thread(data, key, indices)), key
        assert loader.hits == len(planned) and loader.misses == 0
    finally:
        loader.close()


def test_guesses_the_plan_drops_are_not_handed_out() -> None:
    data = Drawing()
    loader = MicroBatchLoader(data, default_collate, prefetch=8, workers=2, seed=SEED)
    try:
        loader.ahead(_plan(0) + _plan(1))  # then the plan changes: step 1 reads other samples
        moved = [((1, mb), [60 - mb - j for j in range(4)]) for mb in range(4)]
        time.sleep(0.5)  # the old guesses are read meanwhile
        loader.ahead(_plan(0)[1:] + moved)
        for key, indices in _plan(0)[1:] + moved:
            assert torch.equal(_get(loader, key, indices), _in_thread(data, key, indices))
        key, indices = _plan(0)[0]  # dropped by the second plan: read in the thread
        assert torch.equal(_get(loader, key, indices), _in_thread(data, key, indices))
        assert loader.misses == 1
    finally:
        loader.close()


def test_a_readers_error_reaches_the_training_thread_with_its_traceback() -> None:
    loader = MicroBatchLoader(Drawing(fail_at=5), default_collate, workers=1, seed=SEED)
    try:
        loader.ahead([((0, 1), [4, 5, 6, 7])])
        with pytest.raises(KeepstepError, match=r"micro-batch \(0, 1\) in a loader worker") as e:
            loader.get((0, 1), [4, 5, 6, 7], timeout=60)
        assert "ValueError: sample 5 is unreadable" in str(e.value)
    finally:
        loader.close()


def test_a_lost_worker_leaves_the_reads_to_the_training_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = Drawing()
    loader = MicroBatchLoader(data, default_collate, workers=2, seed=SEED)
    readers = loader._readers
    assert readers is not None
    procs = list(readers._procs)
    try:
        os.kill(procs[0].pid, signal.SIGKILL)  # type: ignore[arg-type]
        procs[0].join(10)
        planned = _plan(0)
        with caplog.at_level(logging.WARNING, logger="keepstep.elastic.data"):
            for i, (key, indices) in enumerate(planned):
                loader.ahead(planned[i:])
                assert torch.equal(_get(loader, key, indices), _in_thread(data, key, indices))
        assert loader._readers is None
        assert "loader worker lost (keepstep-reader-0 exited -9)" in caplog.text
    finally:
        loader.close()
    assert not any(p.is_alive() for p in procs)


def test_close_ends_every_worker_and_bad_counts_are_refused() -> None:
    loader = MicroBatchLoader(Drawing(), default_collate, workers=3, seed=SEED)
    assert loader._readers is not None
    procs = list(loader._readers._procs)
    assert all(p.is_alive() for p in procs)
    loader.close()
    assert not any(p.is_alive() for p in procs)
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="loader_workers="):
            MicroBatchLoader(Drawing(), default_collate, workers=bad)  # type: ignore[arg-type]


_ORPHAN = """
import os, signal, sys
from torch.utils.data import default_collate
sys.path.insert(0, sys.argv[1])
from test_data_workers import Drawing
from keepstep.elastic.data import MicroBatchLoader
loader = MicroBatchLoader(Drawing(), default_collate, workers=2, seed=1)
print(" ".join(str(p.pid) for p in loader._readers._procs), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: as an OOM kill ends it
"""


def test_workers_end_when_the_training_process_is_killed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _ORPHAN, here], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as stat:  # reaped by init, or a zombie awaiting it
            return stat.read().split(")")[-1].split()[0] != "Z"

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
