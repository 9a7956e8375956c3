"""Computation consistency: randomness and data keyed by (seed, step, micro-batch id).

Step 2 of the happy path (see ARCHITECTURE.md). Whoever computes micro-batch ``i`` of
step ``s`` -- rank 0 of eight or the last survivor of two -- must read the same samples
and draw the same random numbers, so nothing here ever looks at the rank or the world
size. :class:`SampleOrder` says which samples a micro-batch reads, :func:`rng_scope`
seeds the global generators (the current CUDA device's too) for the duration of one
micro-batch, and :func:`fix_determinism` pins the kernels so the same inputs give the same
bits. Which hardware and libraries computed them is the numerics fingerprint's business
(numerics.py): the same bits are promised only between members with equal fingerprints.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from keepstep.elastic.errors import ConfigError

__all__ = [
    "CUBLAS_WORKSPACE_CONFIG",
    "DATA",
    "EVAL",
    "STEP",
    "SampleOrder",
    "derive_seed",
    "fix_determinism",
    "rng_scope",
]

# Domain separation: seeds derived here never collide with another use of blake2b.
_PERSON = b"keepstep-rng-v1"
_DATA_EPOCH_STREAM = "data-epoch"
# One stream name per library, so the three generators are independent of each other.
_TORCH_STREAM = "torch-cpu"
_PYTHON_STREAM = "python-random"
_NUMPY_STREAM = "numpy-legacy"
# The device's generator: one name for every device index, since a micro-batch's numbers
# must not depend on which GPU (or rank) computes it. Dropout in SDPA draws from it too.
_DEVICE_STREAM = "torch-cuda"
# The streams a micro-batch's samples are read under (random augmentation in __getitem__ or
# the collate function): apart from its forward's, so reading draws nothing from those.
DATA = "data/"
# The streams of a step's loop body outside its micro-batches (a random choice per step).
STEP = "step/"
# The streams of an evaluation batch (job.evaluate: evaluate.py).
EVAL = "eval/"
# What cuBLAS needs for deterministic results (torch checks for one of these two values).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def derive_seed(seed: int, step: int, micro_batch_id: int, stream: str = "") -> int:
    """A 63-bit non-negative seed for ``(seed, step, micro_batch_id, stream)``.

    blake2b of a canonical encoding: the same on every process, machine and Python
    run (``hash()`` is salted per process, so it is never used). 63 bits fit every
    consumer: torch takes up to 64, Python any size, numpy gets it as two 32-bit words.
    """
    _check_int("seed", seed, 0)
    _check_int("step", step, 0)
    _check_int("micro_batch_id", micro_batch_id, 0)
    if not isinstance(stream, str):
        raise ConfigError(f"stream={stream!r} must be a str")
    # The ints are decimal and the free-form stream comes last, so the encoding is
    # unambiguous: no two distinct tuples share a byte string.
    key = f"{seed}:{step}:{micro_batch_id}:{stream}".encode()
    digest = hashlib.blake2b(key, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") >> 1


class SampleOrder:
    """Which dataset samples each (step, micro-batch) reads.

    The job reads a single stream of sample positions: micro-batch ``i`` of step ``s``
    covers stream positions ``p = (s * n_micro + i) * micro_batch + j`` for ``j`` in
    ``[0, micro_batch)``. Position ``p`` maps to data epoch ``e = p // dataset_len`` and
    index ``perm_e[p % dataset_len]``, where ``perm_e`` is a permutation of
    ``range(dataset_len)`` seeded by ``derive_seed(seed, e, 0, "data-epoch")``
    (``torch.randperm`` with a CPU ``torch.Generator``). So every sample is seen exactly
    once per data epoch whatever the membership.

    Not thread-safe: the small permutation cache is shared; use one instance per thread.
    """

    def __init__(
        self,
        seed: int,
        dataset_len: int,
        micro_batch: int,
        n_micro: int,
        shuffle: bool = True,
    ) -> None:
        self.seed = _check_int("seed", seed, 0)
        self.dataset_len = _check_int("dataset_len", dataset_len, 1)
        self.micro_batch = _check_int("micro_batch", micro_batch, 1)
        self.n_micro = _check_int("n_micro", n_micro, 1)
        if micro_batch > dataset_len:
            # Then one micro-batch would span three or more data epochs and repeat samples.
            raise ConfigError(
                f"micro_batch={micro_batch} is larger than dataset_len={dataset_len}; "
                "a micro-batch must fit in one pass over the data"
            )
        if not isinstance(shuffle, bool):
            raise ConfigError(f"shuffle={shuffle!r} must be a bool")
        self.shuffle = shuffle
        # A micro-batch straddles at most two data epochs, so two cached permutations
        # make sequential reading cost one randperm per data epoch.
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()

    def _perm(self, epoch: int) -> torch.Tensor:
        cached = self._perms.get(epoch)
        if cached is not None:
            self._perms.move_to_end(epoch)
            return cached
        if self.shuffle:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(derive_seed(self.seed, epoch, 0, _DATA_EPOCH_STREAM))
            perm = torch.randperm(self.dataset_len, generator=gen, device="cpu")
        else:
            perm = torch.arange(self.dataset_len)
        self._perms[epoch] = perm
        while len(self._perms) > 2:
            self._perms.popitem(last=False)
        return perm

    def position(self, step: int, micro_batch_id: int) -> int:
        """The stream position of the first sample of ``(step, micro_batch_id)``."""
        _check_int("step", step, 0)
        _check_int("micro_batch_id", micro_batch_id, 0)
        if micro_batch_id >= self.n_micro:
            raise ConfigError(
                f"micro_batch_id={micro_batch_id} is out of range; ids are 0..{self.n_micro - 1}"
            )
        return (step * self.n_micro + micro_batch_id) * self.micro_batch

    def indices(self, step: int, micro_batch_id: int) -> list[int]:
        """The dataset indices micro-batch ``micro_batch_id`` of ``step`` reads, in order."""
        start = self.position(step, micro_batch_id)
        end = start + self.micro_batch
        out: list[int] = []
        pos = start
        while pos < end:
            epoch, offset = divmod(pos, self.dataset_len)
            take = min(end - pos, self.dataset_len - offset)
            out.extend(self._perm(epoch)[offset : offset + take].tolist())
            pos += take
        assert len(out) == self.micro_batch, (len(out), self.micro_batch)
        return out


def current_device_generators() -> list[torch.Generator]:
    """The current CUDA device's default generator when CUDA is initialised, else none.

    Never initialises CUDA: a process that has not touched the GPU draws nothing from it.
    """
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return []
    return [torch.cuda.default_generators[torch.cuda.current_device()]]


@contextmanager
def rng_scope(
    seed: int,
    step: int,
    micro_batch_id: int,
    device_generators: Sequence[torch.Generator] | None = None,
    purpose: str = "",
) -> Iterator[None]:
    """Seed torch's CPU generator, ``random``, numpy's global RNG and the device's
    generator for one micro-batch (``purpose``: another set of streams for the same
    micro-batch, e.g. ``DATA`` for reading its samples apart from its forward).

    Each gets its own stream of ``derive_seed(seed, step, micro_batch_id, ...)``. The
    device generators are ``device_generators`` if given, else
    :func:`current_device_generators` (the current CUDA device's default generator, which
    dropout and SDPA's dropout draw from); the same seed whatever the device index. On
    exit, normal or not, every generator is put back as it was, so code outside the scope
    draws exactly what it would have drawn without it. Other devices' generators are not
    touched (``torch.manual_seed`` would reseed all of them, so it is not used here).
    """
    torch_seed = derive_seed(seed, step, micro_batch_id, purpose + _TORCH_STREAM)
    python_seed = derive_seed(seed, step, micro_batch_id, purpose + _PYTHON_STREAM)
    numpy_seed = derive_seed(seed, step, micro_batch_id, purpose + _NUMPY_STREAM)
    device_seed = derive_seed(seed, step, micro_batch_id, purpose + _DEVICE_STREAM)
    gens = current_device_generators() if device_generators is None else list(device_generators)

    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    device_states = [g.get_state() for g in gens]  # host-side for CUDA: no device sync
    try:
        torch.default_generator.manual_seed(torch_seed)
        random.seed(python_seed)
        # The legacy seeder takes 32-bit words; two of them carry all 63 bits.
        np.random.seed([numpy_seed & 0xFFFF_FFFF, numpy_seed >> 32])
        for g in gens:
            g.manual_seed(device_seed)
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        for g, state in zip(gens, device_states, strict=True):
            g.set_state(state)


def fix_determinism(threads: int = 1, environ: MutableMapping[str, str] | None = None) -> None:
    """Pin torch to deterministic kernels and a fixed thread count, for the process.

    The same kernels with the same thread count give the same bits whatever the number
    of ranks, which the exact reduction then relies on. Call once at start-up, before
    any parallel work: torch refuses to change the inter-op pool after that, and then
    the pool keeps its size (it schedules whole ops; it does not change what a kernel
    computes).

    On GPUs too: deterministic algorithms (cuDNN's included), cuDNN's autotuner off (it
    picks kernels by timing), TF32 off for matmuls and convolutions (so a library default
    cannot change the bits), and ``CUBLAS_WORKSPACE_CONFIG`` in ``environ`` (the process
    environment by default) set to ``:4096:8`` unless it holds a deterministic value.
    cuBLAS reads it once, so it must be set before CUDA starts: if it is unset and CUDA
    is already initialised this raises ConfigError rather than run nondeterministically
    (the launcher sets it in every worker's environment).
    """
    _check_int("threads", threads, 1)
    env = os.environ if environ is None else environ
    cublas = env.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas is None:
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            raise ConfigError(
                "CUBLAS_WORKSPACE_CONFIG is unset and CUDA is already initialised, so cuBLAS "
                "may run nondeterministically; set CUBLAS_WORKSPACE_CONFIG="
                f"{CUBLAS_WORKSPACE_CONFIG} in the environment, or call fix_determinism "
                "before any CUDA work"
            )
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    elif cublas not in _CUBLAS_DETERMINISTIC:
        raise ConfigError(
            f"CUBLAS_WORKSPACE_CONFIG={cublas!r} is not deterministic; "
            f"allowed: {', '.join(_CUBLAS_DETERMINISTIC)}"
        )
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass  # Parallel work already started; the inter-op pool size is fixed by now.
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        cudnn: Any = torch.backends.cudnn  # its per-op flag modules are untyped
        for flags in (cudnn, cudnn.conv, cudnn.rnn):
            flags.fp32_precision = "ieee"  # all three: the legacy getter wants them equal
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
