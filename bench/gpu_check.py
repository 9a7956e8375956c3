"""One GPU check: the exact reducer's bits on the device against the CPU's, deterministic
forward and backward with keyed CUDA RNG, and the numerics fingerprint, as one JSON object.

    python3 bench/gpu_check.py                  # on the current CUDA device (H200: ~2 min)
    python3 bench/gpu_check.py --device cpu     # every section a CPU can run (CI runs this)

Needs only torch and keepstep's own code (run from a checkout: it finds elastic/ itself);
numba and numpy are used when present. Exits 1 if any check is false, 2 on bad arguments.

Checks, each true or false in "checks":
  reducer_normal, reducer_overflow_retry, reducer_non_finite
      ExactReducer on the device (its default path: fused torch ops, compiled on CUDA; on
      the CPU the same ops eager) against the CPU paths (numba loops when installed, tensor
      ops) on the same gradients: every micro-batch's buffer, the outcomes, the retry,
      the averaged gradients and the next exponents, bit for bit. float32, bfloat16,
      float16 and float64 tensors, one of a million elements, ties, signed zeros and
      subnormals (a tensor of only a subnormal in the overflowing step: a flushed peak
      would change the retry's exponent); on CUDA the eager device ops are checked too,
      and reducer_compiled says the default really was compiled.
  fwd_bwd_repeat, fwd_bwd_history, fwd_bwd_fresh_process, dropout_is_keyed,
  device_generator_restored
      A small transformer (embedding, SDPA with dropout, bf16 autocast on CUDA) run under
      rng_scope: the same micro-batch gives the same loss and gradient bits twice in a row,
      after unrelated allocations and random draws, and in a new process; another
      micro-batch id (same tokens) gives other bits, so dropout really is keyed.
  The next sections are in gpu_check_more.py, gpu_check_gloo.py, gpu_check_job.py and
  gpu_check_buffers.py:
  snapshot_copy_exact (CUDA only)
      1 GiB of float32 copied device to host, into pinned and into pageable memory: bits
      equal to the source.
  store_copy_exact, store_slots_pinned (CUDA only; gpu_check_store.py)
      A 1B-parameter AdamW state (12 GB) committed to keepstep's SnapshotStore: copied on
      a side stream into page-locked slots, bit for bit; the slots really page-locked.
      Figures: copy and checksum GB/s into page-locked and pageable slots, and the cost to
      a step that overlaps a commit (store_pinned_snapshot_cost_per_step).
  nccl_one_rank_allreduce, nccl_reinit (CUDA only)
      keepstep's NCCL transport on one rank (the flavour, NCCL2 or legacy, in details): an
      epoch's group built, an allreduce and an allgather right, its abort at close; then
      the next epoch's group, once the first let go, and the same again.
  gloo_allreduce_equal, gloo_kill_detected, gloo_rebuild_equal
      3 child processes over keepstep's gloo Communicator (gradients computed on the
      device): one is SIGKILLed while two wait in a collective; both raise PeerLost,
      rebuild epoch 1 as two and agree, bit for bit, on the parent's own sum.
  job_trains, job_fresh_process_equal
      A one-member keepstep job on the device as a user's script runs it (keepstep.device,
      keepstep.init, AdamW, clipping, autocast), trained 6 steps in each of two fresh
      processes: both finish and end with the same params_sha256.
  buffers_members_agree, buffers_device_mean_is_cpu (gpu_check_buffers.py)
      One step of a model with BatchNorm on the device, played by 1, 2 and 3 members in
      one process (keepstep.elastic.buffers): every member ends with the same running
      statistics at every world size, and the device's mean of the summed rows is the
      CPU's, bit for bit.
  zero_threads_equal_unsharded, zero_state_on_device, zero_job_equals_unsharded
  (gpu_check_zero.py)
      ZeRO on the device: ZeroOptimizer over 1, 2 and 3 ranks on threads sharing the
      device (AdamW, fused AdamW, Muon beside AdamW; float32, and bfloat16 on CUDA) ends
      with the unsharded optimizer's parameters and state, bit for bit, its state on the
      device; the one-member job with shard="zero1" and "zero2" ends with the unsharded
      job's params_sha256.
Figures (not checked): the fused reduction's ms per 1e9 parameters beside fp32 gradient
accumulation into .grad (the issue's target: <= 2x; gpu_check_figures.py); snapshot_pinned_gb_s,
snapshot_pageable_gb_s, pinned_vs_pageable, compute_slowdown_under_copy (a matmul loop
with a pinned copy beside it on another stream, over alone); nccl_init_s,
nccl_first_allreduce_s, nccl_abort_s (close until the group's abort() returned),
nccl_close_s (close until the aborted group let go), and the same for the re-init;
gloo_detect_s (kill to PeerLost), gloo_rebuild_s (PeerLost to the next epoch's allreduce
done); job_step_s. Sections the device cannot run are in "not_covered_here" with the
reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "elastic") not in sys.path:
    sys.path.append(str(REPO / "elastic"))  # after PYTHONPATH's entries: those win

import gpu_check_figures  # noqa: E402  (beside this file; needs keepstep on the path)
from keepstep.elastic import reduce_kernels  # noqa: E402
from keepstep.elastic.numerics import current  # noqa: E402
from keepstep.elastic.reduce import ExactReducer, ReduceDone, ReduceOverflow  # noqa: E402
from keepstep.elastic.rng import current_device_generators, fix_determinism, rng_scope  # noqa: E402

Grads = list[torch.Tensor | None]
N_MICRO = 4
SPECIAL = [0.0, -0.0, 1e-40, -1e-40, 6e-8, 5e-324]  # signed zeros and subnormals


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bits, every nan written as one nan (payloads are hardware's)."""
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        t = torch.where(t.isnan(), torch.full_like(t, math.nan), t)
    raw = t.reshape(-1).view(torch.uint8)
    try:
        data = raw.numpy().tobytes()
    except RuntimeError:  # no numpy: slower, same bytes
        data = bytes(raw.tolist())
    return hashlib.sha256(data).hexdigest()


# -- the reducer ------------------------------------------------------------------------


def specs(big: int) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    """(shape, dtype, transposed): every dtype, a big tensor, an empty and a 1-element one."""
    return [
        ((257, 129), torch.float32, False),
        ((big,), torch.float32, False),
        ((64, 33), torch.bfloat16, True),
        ((4097,), torch.float16, False),
        ((513,), torch.float64, False),
        ((1,), torch.float32, False),
        ((0,), torch.float32, False),
    ]


def make_params(
    spec: Sequence[tuple[tuple[int, ...], torch.dtype, bool]], device: str
) -> list[torch.Tensor]:
    return [
        (torch.zeros(s[::-1], dtype=d).t() if t else torch.zeros(s, dtype=d)).to(device)
        for s, d, t in spec
    ]


def scenario(name: str, big: int) -> list[list[Grads]]:
    """Two steps of N_MICRO micro-batches of CPU gradients for one scenario."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    k0 = 53 - (N_MICRO - 1).bit_length() - 16  # the first step's exponent
    steps = []
    for step in range(2):
        batches: list[Grads] = []
        for mb in range(N_MICRO):
            grads: Grads = []
            for i, (shape, dtype, transposed) in enumerate(specs(big)):
                if i == 5 and mb == 1:
                    grads.append(None)  # absent: counts as zeros
                    continue
                spread = 10.0 ** (-6 * torch.rand(shape, generator=gen, dtype=torch.float64))
                x = torch.randn(shape, generator=gen, dtype=torch.float64) * spread
                flat = x.view(-1)
                if flat.numel() > len(SPECIAL) + 1:
                    flat[0] = (mb - 2.5) * 2.0**-k0  # a rounding tie at the first exponent
                    flat[1 : 1 + len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
                if name == "overflow_retry" and step == 0 and mb == 2 and i == 1:
                    x *= 2.0**60  # finite, far over the fixed-point range: retried
                if name == "overflow_retry" and step == 0 and i == 5:
                    x.fill_(-1e-40)  # only a subnormal: its peak sets the retry's exponent
                if name == "non_finite" and mb == 3 and i in (0, 3):
                    flat[-1] = math.nan if i == 0 else -math.inf
                g = x.to(dtype)
                grads.append(g.t().contiguous().t() if transposed else g)
            batches.append(grads)
        steps.append(batches)
    return steps


def run_reducer(steps: list[list[Grads]], big: int, device: str, **path: Any) -> list[str]:
    """Everything the reducer produced, as digests in order: buffers, outcomes, grads."""
    params = make_params(specs(big), device)
    reducer = ExactReducer(params, N_MICRO, **path)
    seen: list[str] = [reducer.path]
    for batches in steps:
        for attempt in range(2):
            reducer.begin_step()
            for grads in batches:
                reducer.add_micro_batch([None if g is None else g.to(device) for g in grads])
                seen += [digest(reducer.buffer()), digest(reducer.retry_max_buffer())]
            outcome = reducer.finish(reducer.buffer().clone(), N_MICRO, params)
            seen += [repr(outcome), repr(reducer.exponents)]
            seen += [digest(p.grad) + repr(p.grad.stride()) for p in params if p.grad is not None]
            if not isinstance(outcome, ReduceOverflow) or attempt:
                break
            reducer.set_retry_exponents(reducer.retry_max_buffer())
        if not isinstance(outcome, ReduceDone):
            break
    return seen


def first_difference(a: Sequence[str], b: Sequence[str]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def check_reducer(name: str, device: str, big: int) -> dict[str, Any]:
    steps = scenario(name, big)
    cpu_paths: dict[str, dict[str, Any]] = {"cpu_tensor_ops": {"kernels": False}}
    if reduce_kernels.available():
        cpu_paths["cpu_numba"] = {"kernels": True}
    dev_paths: dict[str, dict[str, Any]] = {"device_default": {"device_ops": True}}
    if device == "cuda":
        dev_paths["device_eager"] = {"device_ops": True, "compile": False}
    runs = {k: run_reducer(steps, big, "cpu", **p) for k, p in cpu_paths.items()}
    runs |= {k: run_reducer(steps, big, device, **p) for k, p in dev_paths.items()}
    paths = {k: r.pop(0) for k, r in runs.items()}  # which code each one ran
    ref = runs["cpu_tensor_ops"]
    differ = {k: first_difference(r, ref) for k, r in runs.items() if r != ref}
    outcomes = [s for s in ref if s.startswith("Reduce")]
    return {
        "ok": not differ,
        "paths": paths,
        "first_difference_at": differ,
        "outcomes": outcomes,
    }


# -- forward and backward ---------------------------------------------------------------

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 512, 128, 4, 2, 64, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, D)), 0.1)
        return x + F.dropout(self.down(F.gelu(self.up(self.n2(x)))), 0.1)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, D), nn.Parameter(torch.zeros(SEQ, D))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.emb(tokens) + self.pos[: tokens.shape[1]], 0.1)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def make_model(device: str) -> tuple[nn.Module, torch.Tensor]:
    with rng_scope(0, 0, 0, device_generators=[]):  # weights from the CPU generator only
        model = Tiny()
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return model.to(device).train(), tokens.to(device)


def fwd_bwd(model: nn.Module, tokens: torch.Tensor, step: int, mb: int) -> str:
    """Loss and gradient bits of micro-batch (step, mb): same tokens, keyed dropout."""
    model.zero_grad(set_to_none=True)
    cuda = tokens.device.type == "cuda"
    with rng_scope(7, step, mb), torch.autocast("cuda", torch.bfloat16, enabled=cuda):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    h = hashlib.sha256(digest(loss).encode())
    for p in model.parameters():
        assert p.grad is not None
        h.update(digest(p.grad).encode())
    return h.hexdigest()


def check_fwd_bwd(device: str) -> dict[str, Any]:
    model, tokens = make_model(device)
    first = fwd_bwd(model, tokens, 3, 1)
    repeat = fwd_bwd(model, tokens, 3, 1)
    gens = current_device_generators()
    before = [g.get_state() for g in gens]
    other = fwd_bwd(model, tokens, 3, 2)
    restored = all(torch.equal(g.get_state(), s) for g, s in zip(gens, before, strict=True))
    junk = [torch.empty(n, device=device) for n in (1_234_567, 77, 99_999)]  # allocator history
    torch.rand(1000, device=device), torch.rand(10)  # and RNG history outside the scope
    history = fwd_bwd(model, tokens, 3, 1)
    del junk
    child = subprocess.run(
        [sys.executable, __file__, "--device", device, "--child"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    fresh = child.stdout.strip().splitlines()[-1] if child.returncode == 0 else child.stderr[-2000:]
    return {
        "fwd_bwd_repeat": first == repeat,
        "fwd_bwd_history": first == history,
        "fwd_bwd_fresh_process": first == fresh,
        "dropout_is_keyed": first != other,
        "device_generator_restored": restored and (device == "cpu" or len(gens) == 1),
        "hash": first,
    }


# -- main -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cpu", action="store_true", help="the same as --device cpu")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device (use --device cpu)")
    fix_determinism(1 if device == "cpu" else max(1, min(8, os.cpu_count() or 1)))
    if args.child:  # the fresh process of the fwd/bwd check: print one hash
        model, tokens = make_model(device)
        print(fwd_bwd(model, tokens, 3, 1))
        return 0
    started = time.perf_counter()
    big, numel = (1_000_003, 2**26) if device == "cuda" else (100_003, 2**21)
    report: dict[str, Any] = {"device": device, "checks": {}, "details": {}, "errors": {}}
    fingerprint = current(torch.device(device))
    report["fingerprint"] = {**fingerprint.as_dict(), "digest": fingerprint.digest}
    for name in ("normal", "overflow_retry", "non_finite"):
        try:
            detail = check_reducer(name, device, big)
            report["checks"][f"reducer_{name}"] = detail.pop("ok")
            report["details"][f"reducer_{name}"] = detail
        except Exception:
            report["checks"][f"reducer_{name}"] = False
            report["errors"][f"reducer_{name}"] = traceback.format_exc()[-3000:]
        progress(started, f"reducer_{name}", report)
    if device == "cuda":  # compiled, as the issue asks, not a silent eager fallback
        paths = report["details"].get("reducer_normal", {}).get("paths", {})
        report["checks"]["reducer_compiled"] = paths.get("device_default") == "device-compiled"
    try:
        detail = check_fwd_bwd(device)
        report["details"]["fwd_bwd_hash"] = detail.pop("hash")
        report["checks"].update(detail)
    except Exception:
        report["checks"]["fwd_bwd"] = False
        report["errors"]["fwd_bwd"] = traceback.format_exc()[-3000:]
    progress(started, "fwd_bwd", report)
    try:
        report["figures"] = gpu_check_figures.figures(device, numel, N_MICRO)
    except Exception:
        report["errors"]["figures"] = traceback.format_exc()[-3000:]
    progress(started, "figures", report)
    try:  # imported here: a torch without the NCCL names keepstep's comm imports fails
        # these sections only (in "errors"), not the ones above
        import gpu_check_more

        gpu_check_more.run(device, report, partial(progress, started))  # copy, NCCL, gloo, job
    except Exception:
        report["errors"]["gpu_check_more"] = traceback.format_exc()[-3000:]
        report["not_covered_here"] = ["snapshot_copy, nccl_one_rank, gloo_kill_rebuild: see errors"]
    report["seconds"] = round(time.perf_counter() - started, 1)
    code = exit_code(report["checks"], report["errors"])
    report["ok"] = code == 0
    print(json.dumps(report, indent=2, sort_keys=True))
    return code


def progress(started: float, section: str, report: dict[str, Any]) -> None:
    """One line on stderr as each section ends (its seconds, the checks so far, any error):
    what a run stopped by a time limit still tells."""
    failed = sorted(k for k, v in report["checks"].items() if v is not True)
    print(
        f"[gpu_check {time.perf_counter() - started:6.1f} s] {section} done; "
        f"{len(report['checks'])} checks, false: {failed}, errors: {sorted(report['errors'])}",
        file=sys.stderr,
        flush=True,
    )


def exit_code(checks: dict[str, bool], errors: dict[str, str]) -> int:
    """0 when there are checks, every one is true and no section raised; else 1."""
    return 0 if checks and all(v is True for v in checks.values()) and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
