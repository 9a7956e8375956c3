"""Data sources and the micro-batch loader: memory-mapped token files and shards read the
samples they hold; prefetching returns exactly what reading on demand returns, drops
guesses the plan no longer wants, and passes a reader's error on."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from keepstep.elastic.data import MicroBatchLoader, TokenFile, TokenShards
from keepstep.elastic.errors import ConfigError


def token_file(path: Path, n: int, start: int = 0, dtype: str = "uint16") -> Path:
    np.arange(start, start + n, dtype=dtype).tofile(path)
    return path


def test_a_token_file_is_samples_of_seq_tokens_and_their_next_tokens(tmp_path: Path) -> None:
    data = TokenFile(token_file(tmp_path / "t.bin", 50), seq=8)
    assert len(data) == 6  # (50 - 1) // 8: the last sample needs one token past its end
    x, y = data[2]
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    assert x.dtype == torch.int64
    with pytest.raises(IndexError):
        data[6]
    wide = TokenFile(token_file(tmp_path / "w.bin", 20, 70_000, "uint32"), seq=4, dtype="uint32")
    assert wide[0][0].tolist() == [70_000, 70_001, 70_002, 70_003]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: TokenFile(p / "missing.bin", 8), "does not exist"),
        (lambda p: TokenFile(token_file(p / "t.bin", 50), 0), "seq=0 must be an int >= 1"),
        (lambda p: TokenFile(token_file(p / "t.bin", 50), 8, "float32"), "token ids are integers"),
        (lambda p: TokenFile(token_file(p / "t.bin", 5), 8), "fewer than one sample of seq=8"),
        (lambda p: TokenShards([], 8), "at least one shard"),
    ],
)
def test_bad_sources_are_refused_naming_the_value(make: Any, words: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=words):
        make(tmp_path)


def test_a_partial_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 21)
    with pytest.raises(ConfigError, match="21 bytes is not a whole number of uint16 tokens"):
        TokenFile(path, 4)


def test_shards_are_one_index_space_with_a_cursor(tmp_path: Path) -> None:
    paths = [token_file(tmp_path / f"s{k}.bin", n, 1000 * k) for k, n in enumerate([33, 9, 65])]
    shards = TokenShards(paths, seq=8, open_shards=1)
    assert len(shards) == 4 + 1 + 8
    assert [shards.locate(i) for i in (0, 3, 4, 5, 12)] == [(0, 0), (0, 3), (1, 0), (2, 0), (2, 7)]
    single = [TokenFile(p, 8) for p in paths]
    for i in range(len(shards)):  # every sample, with one shard mapped at a time
        k, j = shards.locate(i)
        assert torch.equal(shards[i][0], single[k][j][0])
    # Picklable (a dataset may be handed to another process), and it maps anew there.
    copy = pickle.loads(pickle.dumps(shards))
    assert torch.equal(copy[12][1], shards[12][1])


class Slow:
    """A dataset whose reads take time and are counted, by thread."""

    def __init__(self, n: int, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.n, self.delay, self.fail_at = n, delay, fail_at
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.threads.add(threading.current_thread().name)
        if i == self.fail_at:
            raise ValueError(f"sample {i} is damaged")
        time.sleep(self.delay)
        return torch.full((3,), float(i)), torch.tensor(i)


def test_prefetched_batches_equal_the_ones_read_on_demand() -> None:
    plain = MicroBatchLoader(Slow(100), default_collate)
    ahead = MicroBatchLoader(Slow(100), default_collate, prefetch=4)
    try:
        plan = [((0, mb), [4 * mb + j for j in range(4)]) for mb in range(6)]
        ahead.ahead(plan)
        for key, indices in plan:
            a, b = plain.get(key, indices), ahead.get(key, indices, timeout=10)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            ahead.ahead(plan[plan.index((key, indices)) + 1 :])
        assert ahead.hits == 6 and ahead.misses == 0
    finally:
        ahead.close()


def test_a_guess_the_plan_dropped_is_not_used() -> None:
    loader = MicroBatchLoader(Slow(100), default_collate, prefetch=2)
    try:
        loader.ahead([((5, 0), [0, 1]), ((5, 1), [2, 3])])
        # A membership change: the same key now reads other samples.
        batch = loader.get((5, 0), [10, 11])
        assert batch[1].tolist() == [10, 11] and loader.misses == 1
        loader.ahead([((6, 0), [20, 21])])  # (5, 1) no longer planned: dropped
        assert loader.get((5, 1), [2, 3])[1].tolist() == [2, 3] and loader.misses == 2
        assert loader.get((6, 0), [20, 21])[1].tolist() == [20, 21] and loader.hits == 1
    finally:
        loader.close()


def test_a_readers_error_reaches_the_training_thread() -> None:
    loader = MicroBatchLoader(Slow(10, fail_at=3), default_collate, prefetch=1)
    try:
        loader.ahead([((0, 0), [2, 3])])
        with pytest.raises(ValueError, match="sample 3 is damaged"):
            loader.get((0, 0), [2, 3], timeout=10)
    finally:
        loader.close()


def test_reads_ahead_happen_off_the_training_thread() -> None:
    dataset = Slow(100, delay=0.01)
    loader = MicroBatchLoader(dataset, default_collate, prefetch=2)
    assert dataset.threads == {threading.current_thread().name}  # the start's check of [0]
    dataset.threads.clear()
    try:
        plan = [((0, mb), [2 * mb, 2 * mb + 1]) for mb in range(4)]
        for i, (key, indices) in enumerate(plan):
            loader.ahead(plan[i:])
            loader.get(key, indices, timeout=10)
        assert loader.hits == 4
        assert threading.current_thread().name not in dataset.threads
        assert all(t.startswith("keepstep-loader") for t in dataset.threads), dataset.threads
    finally:
        loader.close()


def test_bad_loader_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="prefetch=-1 must be an int >= 0"):
        MicroBatchLoader(Slow(1), default_collate, prefetch=-1)
    with pytest.raises(ConfigError, match="loader threads=0 must be an int >= 1"):
        MicroBatchLoader(Slow(1), default_collate, prefetch=1, threads=0)
