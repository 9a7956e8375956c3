"""Tests of what a snapshot store keeps between commits (the payload plan, each slot's
destination tensors): whatever it reuses, the slot bytes and checksum must be exactly those of
the format written from scratch, and stale views must never be written through."""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from snapshot_samples import sample_tensors

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.snapshot_store import FileBuffer, MemoryBuffer, SnapshotBuffer, SnapshotStore
from keepstep.elastic.snapshot_write import PayloadPlanner

HEADER = 64
Tensors = dict[str, torch.Tensor]


def _align(n: int) -> int:
    return -(-n // 64) * 64


def _reference(step: int, tensors: Tensors, meta: bytes) -> tuple[bytes, int]:
    """The payload and checksum as the format defines them, built here the slow way: a
    JSON index, each tensor at a 64-aligned offset with zero padding, and one XXH3-64 of the
    packed (step, payload length) followed by the whole payload."""
    index: list[object] = []
    extents, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        index.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes])
        extents.append((offset, nbytes))
        offset = _align(offset + nbytes)
    raw_index = json.dumps(index, separators=(",", ":")).encode()
    head = struct.pack("<QQ", len(raw_index), len(meta)) + raw_index + meta
    head += bytes(_align(len(head)) - len(head))
    data = bytearray(offset)
    for (at, nbytes), t in zip(extents, tensors.values(), strict=True):
        if nbytes:
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            data[at : at + nbytes] = flat.numpy().tobytes()
    payload = head + bytes(data)
    signed = struct.pack("<qQ", step, len(payload))
    return payload, xxhash.xxh3_64_intdigest(signed + payload)


def _check(store: SnapshotStore, step: int, tensors: Tensors, meta: bytes) -> None:
    """The slot of ``step`` holds exactly the reference bytes and checksum, and loads back."""
    blob = store.export(step)
    want_payload, want_crc = _reference(step, tensors, meta)
    crc = struct.unpack_from("<Q", blob, 32)[0]
    assert blob[HEADER:] == want_payload, f"step {step}: payload bytes differ"
    assert crc == want_crc, f"step {step}: checksum {crc:#x}, reference {want_crc:#x}"
    snap = store.load(step)
    assert snap.meta == meta and list(snap.tensors) == list(tensors)
    for name, t in tensors.items():
        got = snap.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name


def _other_layout(seed: int) -> Tensors:
    """Same names mostly, other shapes and dtypes: every offset after the first moves."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(99, 7, generator=g),  # ends 28 bytes earlier: stale bytes would show
        "half": torch.randn(3, generator=g),  # now float32
        "new": torch.randint(0, 9, (4, 4), generator=g),
        "count": torch.tensor(seed, dtype=torch.int64),
    }


def _reopen(buffer: SnapshotBuffer) -> SnapshotStore:
    """A second store that sees only what is in the buffer now (its own mapping, for a
    file): what a restarted worker would load."""
    if isinstance(buffer, FileBuffer):
        return SnapshotStore(FileBuffer.open(buffer.path), background=False)
    return SnapshotStore(buffer, background=False)


@pytest.mark.parametrize("background", [True, False])
def test_slot_bytes_and_checksum_are_those_of_the_format(
    buffer: SnapshotBuffer, background: bool
) -> None:
    # Meta lengths cross multiples of 64, which moves every tensor of an unchanged layout.
    store = SnapshotStore(buffer, background=background)
    metas = [bytes(range(n)) for n in (0, 5, 40, 41, 130, 3, 3, 200)]
    for step, meta in enumerate(metas):
        store.commit(step, sample_tensors(step), meta)
        store.wait()
        _check(store, step, sample_tensors(step), meta)
        if step:  # the other slot was not disturbed
            _check(store, step - 1, sample_tensors(step - 1), metas[step - 1])
    store.close()
    buffer.close()


def test_a_changed_layout_gets_a_new_plan_and_zeroed_padding(buffer: SnapshotBuffer) -> None:
    store = SnapshotStore(buffer)
    same = sample_tensors
    layouts: list[Callable[[int], Tensors]] = [same, same, _other_layout, same]
    layouts += [_other_layout, _other_layout, lambda s: dict(reversed(sample_tensors(s).items()))]
    for step, make in enumerate(layouts):
        store.commit(step, make(step), b"meta")
        store.wait()
        _check(store, step, make(step), b"meta")
    # A store that reuses nothing reads the same bytes.
    _check(_reopen(buffer), len(layouts) - 1, layouts[-1](len(layouts) - 1), b"meta")
    store.close()
    buffer.close()


def test_growth_does_not_write_through_stale_views(buffer: SnapshotBuffer) -> None:
    store = SnapshotStore(buffer, background=False)
    small = [sample_tensors(s, n=10) for s in range(6)]
    store.commit(0, small[0], b"")
    store.commit(1, small[1], b"")  # both slots now have views over the first mapping
    big = sample_tensors(9, n=30_000)
    store.commit(2, big, b"big")  # grows the buffer: slot 1 moves
    for step in (3, 4, 5):
        store.commit(step, small[step], b"")
        _check(_reopen(buffer), step, small[step], b"")
        if step == 3:
            _check(_reopen(buffer), 2, big, b"big")
        else:
            _check(_reopen(buffer), step - 1, small[step - 1], b"")
    store.close()
    buffer.close()


def test_a_buffer_grown_behind_the_store_is_seen(buffer: SnapshotBuffer) -> None:
    # A MemoryBuffer grows by replacing its array: views over the old one would write into
    # memory nobody reads any more.
    store = SnapshotStore(buffer, background=False)
    store.commit(1, sample_tensors(1), b"a")
    store.commit(2, sample_tensors(2), b"b")
    buffer.resize(buffer.size + 8192)
    store.commit(3, sample_tensors(3), b"c")
    store.commit(4, sample_tensors(4), b"d")
    reader = _reopen(buffer)
    _check(reader, 3, sample_tensors(3), b"c")
    _check(reader, 4, sample_tensors(4), b"d")
    store.close()
    buffer.close()


def test_an_imported_slot_is_not_reused_as_if_the_store_wrote_it() -> None:
    source = SnapshotStore(MemoryBuffer(), background=False)
    noise = {"r": torch.randn(960)}  # covers all of the slot that sample_tensors(n=100) uses
    source.commit(10, noise, b"noise")
    store = SnapshotStore(MemoryBuffer(), background=False)
    store.commit(1, sample_tensors(1), b"")  # slot 0
    store.commit(2, sample_tensors(2), b"")  # slot 1
    assert store.import_(source.export(10)).slot == 0
    _check(store, 10, noise, b"noise")
    store.commit(3, sample_tensors(3), b"")  # slot 1
    store.commit(4, sample_tensors(4), b"")  # slot 0 again, over the imported bytes
    _check(store, 4, sample_tensors(4), b"")


def test_many_commits_load_exactly_what_was_committed(tmp_path: Path) -> None:
    # Like training: the same tensors change in place between commits, and the layout
    # changes twice (a tensor appears, then the meta grows).
    buffer = FileBuffer.create("train", 0, directory=tmp_path)
    store = SnapshotStore(buffer)
    live = sample_tensors(0, n=50)
    held: dict[int, tuple[Tensors, bytes]] = {}
    for step in range(1, 31):
        with torch.no_grad():
            live["w"].add_(0.5)
            live["count"].fill_(step)
            live["mask"].logical_not_()
        if step == 10:
            live["extra"] = torch.arange(step, dtype=torch.float64)
        meta = b"m" * (step if step < 20 else 100 + step)
        store.commit(step, live, meta)
        store.wait()
        held[step] = ({k: v.clone() for k, v in live.items()}, meta)
        assert [i.step for i in store.infos()] == [step] + ([step - 1] if step > 1 else [])
        for s in store.infos():
            _check(store, s.step, *held[s.step])
    store.close()
    buffer.close()


def test_tensors_are_still_validated_when_the_layout_repeats() -> None:
    store = SnapshotStore(MemoryBuffer(), background=False)
    good = {"w": torch.ones(2)}
    store.commit(1, good, b"")
    bad: list[object] = [
        torch.ones(2).to_sparse(),  # same name, dtype and shape
        torch.empty(2, device="meta"),
        [1.0, 2.0],
        None,
    ]
    for value in bad:
        with pytest.raises(ConfigError, match=r"tensors\['w'\]"):
            store.commit(2, {"w": value}, b"")  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="non-empty str"):
        store.commit(2, {"": torch.ones(2)}, b"")
    with pytest.raises(ConfigError, match="mapping"):
        store.commit(2, [("w", torch.ones(2))], b"")  # type: ignore[arg-type]
    store.commit(2, {"w": torch.full((2,), 3.0)}, b"")
    _check(store, 2, {"w": torch.full((2,), 3.0)}, b"")


def test_the_planner_reuses_a_layout_and_agrees_with_planning_from_scratch() -> None:
    planner = PayloadPlanner()
    first = planner.plan(sample_tensors(1), b"x" * 10)
    same = planner.plan(sample_tensors(2), b"y" * 12)  # other values and meta, same head length
    assert same.entries is first.entries
    moved = planner.plan(sample_tensors(2), b"y" * 100)  # the head grows past a multiple of 64
    assert moved.entries is not first.entries
    other = planner.plan(_other_layout(1), b"y" * 100)
    for plan, tensors, meta in [
        (first, sample_tensors(1), b"x" * 10),
        (same, sample_tensors(2), b"y" * 12),
        (moved, sample_tensors(2), b"y" * 100),
        (other, _other_layout(1), b"y" * 100),
    ]:
        fresh = PayloadPlanner().plan(tensors, meta)
        entries = list(fresh.entries)
        assert (plan.head_len, list(plan.entries), plan.nbytes) == (
            fresh.head_len,
            entries,
            fresh.nbytes,
        )
        assert plan.index + plan.meta == fresh.index + fresh.meta
        filled = [i for i, e in enumerate(entries) if e.nbytes]
        assert list(plan.filled or range(len(entries))) == filled


def test_closing_the_store_lets_the_buffer_unmap(tmp_path: Path) -> None:
    buffer = FileBuffer.create("unmap", 0, directory=tmp_path)
    store = SnapshotStore(buffer)
    store.commit(1, sample_tensors(1), b"")
    store.commit(2, sample_tensors(2), b"")
    store.wait()
    view = buffer.view()
    mapping = view.obj
    view.release()
    assert isinstance(mapping, mmap.mmap)
    store.close()  # drops the views it kept over the mapping
    buffer.close()
    assert mapping.closed
