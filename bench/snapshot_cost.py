"""What a per-step snapshot costs: ~10M parameters + Adam state (~120 MB).

Prints, from one run on this machine: the commit call (what the training loop waits for),
the background copy + checksum, its GB/s next to a plain Tensor.copy_ into a reused
mapping of the same size, load (copy out + verify), XXH3 (the checksum) against CRC-32
and hashlib's digests, and a forward/backward with and without a snapshot copy running
beside it.

    scripts/env python bench/snapshot_cost.py [--params 10e6] [--repeats 5] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import zlib
from collections.abc import Callable

import torch
import xxhash

from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore
from keepstep.elastic.train_state import capture


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _hashlib(name: str) -> Callable[[memoryview], object]:
    return lambda data: hashlib.new(name, data).digest()


def _bound(fn: Callable[[memoryview], object], data: memoryview) -> Callable[[], object]:
    return lambda: fn(data)


def _model(params: float) -> torch.nn.Module:
    width = 1024
    layers = max(1, round(params / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=10e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = _model(args.params)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 1024)

    def fwd_bwd() -> None:
        model(x).square().mean().backward()

    fwd_bwd()
    opt.step()  # Adam state now exists: 3 floats per parameter
    state = capture(1, model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in state.tensors.values())
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f} M parameters, snapshot {nbytes / 1e6:.1f} MB "
        f"in {len(state.tensors)} tensors, torch threads {args.threads}, cpus {os.cpu_count()}"
    )

    buffer = FileBuffer.create(f"keepstep-bench-{os.getpid()}", 0, directory=args.dir)
    try:
        store = SnapshotStore(buffer)
        for step in range(2):  # warm both slots: the first touch of tmpfs pages is a fault
            store.commit(step, state.tensors, state.meta)
            store.wait()
        commit_s, copy_s = [], []
        for step in range(2, 2 + args.repeats):
            t0 = time.perf_counter()
            store.commit(step, state.tensors, state.meta)
            t1 = time.perf_counter()
            store.wait()
            t2 = time.perf_counter()
            commit_s.append(t1 - t0)
            copy_s.append(t2 - t0)
        commit, total = statistics.median(commit_s), statistics.median(copy_s)
        print(f"commit call (foreground)        {commit * 1e3:8.2f} ms")
        print(
            f"copy + checksum (background)    {total * 1e3:8.2f} ms  "
            f"{nbytes / total / 1e9:6.2f} GB/s"
        )

        raw_buffer = FileBuffer.create(
            f"keepstep-bench-raw-{os.getpid()}", nbytes, directory=args.dir
        )
        flat = torch.frombuffer(raw_buffer.view(), dtype=torch.uint8, count=nbytes)
        pairs = []
        at = 0
        for t in state.tensors.values():
            size = t.numel() * t.element_size()
            pairs.append((flat[at : at + size].view(t.dtype).view(t.shape), t))
            at += size

        def raw_copy() -> None:
            for dst, src in pairs:
                dst.copy_(src)

        raw_copy()  # the mapping is reused, as the store's is: pages already faulted in
        raw = _median_s(raw_copy, args.repeats)
        print(
            f"raw copy_ into a reused mapping {raw * 1e3:8.2f} ms  {nbytes / raw / 1e9:6.2f} GB/s"
        )
        pairs.clear()
        del flat
        raw_buffer.close()
        raw_buffer.unlink()

        load = _median_s(store.load, args.repeats)
        print(
            f"load (copy out + verify)        {load * 1e3:8.2f} ms  {nbytes / load / 1e9:6.2f} GB/s"
        )
        infos = _median_s(store.infos, args.repeats)
        print(f"infos (verify both slots)       {infos * 1e3:8.2f} ms")

        data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
        digests: list[tuple[str, Callable[[memoryview], object]]] = [
            ("xxhash.xxh3_64 (used)", xxhash.xxh3_64_intdigest),
            ("zlib.crc32", zlib.crc32),
            ("zlib.adler32", zlib.adler32),
        ]
        digests += [(f"hashlib.{n}", _hashlib(n)) for n in ("md5", "sha1", "sha256", "blake2b")]
        for name, digest in digests:
            s = _median_s(_bound(digest, data), max(1, args.repeats // 2))
            print(f"{name:<31} {s * 1e3:8.2f} ms  {len(data) / s / 1e9:6.2f} GB/s")

        fwd_bwd()
        alone = _median_s(fwd_bwd, args.repeats)

        def overlapped() -> None:
            store.commit(99, state.tensors, state.meta)
            fwd_bwd()

        with_copy = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            overlapped()
            with_copy.append(time.perf_counter() - t0)
            store.wait()
        print(f"forward+backward alone          {alone * 1e3:8.2f} ms")
        print(
            f"forward+backward beside a copy  {statistics.median(with_copy) * 1e3:8.2f} ms  "
            "(commit call included)"
        )
        store.close()
    finally:
        buffer.close()
        buffer.unlink()


if __name__ == "__main__":
    main()
