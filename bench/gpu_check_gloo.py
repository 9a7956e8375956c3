"""gpu_check's gloo section: three processes over keepstep's gloo Communicator, one of them
SIGKILLed inside a collective, the survivors rebuilding the next epoch as two.

Where it sits: gpu_check_more.run calls `gloo_kill_rebuild` (on the CPU too; on a GPU the
gradients are computed there). This file run as a script is one of its children:

    python3 bench/gpu_check_gloo.py --child-gloo p0 --port PORT --device cpu

A child reports to the parent as one JSON line on stdout and through plain strings in the
parent's TCPStore: nothing received from another process is unpickled. Every wait is
bounded, and the parent reaps every child, also when the section fails half-way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import Store, TCPStore

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "elastic") not in sys.path:
    sys.path.append(str(REPO / "elastic"))  # after PYTHONPATH's entries: those win

from keepstep.elastic.comm import Communicator  # noqa: E402
from keepstep.elastic.errors import PeerLost  # noqa: E402

if TYPE_CHECKING:
    from gpu_check_more import Section

STORE_TIMEOUT = timedelta(seconds=30)  # every store call of the parent's and the children's
MEMBERS = ("p0", "p1", "p2")
SURVIVORS = ("p0", "p1")
VICTIM = "p2"
NUMEL = 1 << 15
BUILD_TIMEOUT = timedelta(seconds=60)  # a loaded 2-core CI machine starts 3 torches
KILLED_TIMEOUT = timedelta(seconds=10)  # the collective p2 is killed in: a bound only
SECTION_S = 240.0  # from the children's start to the last one's exit
VICTIM_SLEEP_S = 120.0  # p2 waits here to be killed; if it is not, it leaves


def sha256_of(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    try:
        data = raw.numpy().tobytes()
    except RuntimeError:  # no numpy: slower, same bytes
        data = bytes(raw.tolist())
    return hashlib.sha256(data).hexdigest()


def gradient(name: str, device: str) -> torch.Tensor:
    """Member ``name``'s gradient-like tensor, computed on ``device``, returned on the CPU
    (keepstep's gloo transport takes CPU tensors only). Integer-valued float64: a sum of
    them is exact in any order, so every rank's result has the same bits."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")
    ints = torch.randint(-(2**20), 2**20, (NUMEL,), generator=torch.Generator().manual_seed(seed))
    x = ints.to(device, torch.float64)
    return (3 * x - x.roll(1)).cpu()


def gloo_child(me: str, port: int, device: str) -> int:
    """One member: epoch 0 of three, the allreduce the victim never joins, epoch 1 of two."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
    grad = gradient(me, device)
    comm = Communicator.create(store, 0, MEMBERS, me, BUILD_TIMEOUT, backend="gloo")
    first = grad.clone()
    comm.allreduce(first, timeout=BUILD_TIMEOUT)
    store.set(f"gloo/epoch0/{me}", sha256_of(first))
    store.set(f"gloo/entering/{me}", "1")
    if me == VICTIM:
        time.sleep(VICTIM_SLEEP_S)  # the parent kills this process here
        comm.close()
        return 3
    try:
        comm.allreduce(grad.clone(), timeout=KILLED_TIMEOUT)
        lost, reason = False, f"the allreduce completed without {VICTIM}"
    except PeerLost as err:
        lost, reason = True, err.reason
    lost_at, began = time.time(), time.perf_counter()
    comm.close()
    comm = Communicator.create(store, 1, SURVIVORS, me, BUILD_TIMEOUT, backend="gloo")
    second = grad.clone()
    comm.allreduce(second, timeout=BUILD_TIMEOUT)
    rebuild_s = time.perf_counter() - began
    comm.close()
    out = {"me": me, "lost": lost, "reason": reason, "lost_at": lost_at}
    out |= {"rebuild_s": rebuild_s, "epoch1": sha256_of(second)}
    print(json.dumps(out), flush=True)
    return 0


def gloo_kill_rebuild(section: Section, device: str) -> None:
    """3 processes over gloo, one SIGKILLed, the rest rebuild; deliverable 1

    p2 is killed while p0 and p1 wait in a collective of epoch 0: they must raise PeerLost,
    rebuild epoch 1 as two, and agree on its sum."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    child = [sys.executable, __file__, "--port", str(store.port), "--device", device]
    deadline = time.monotonic() + SECTION_S
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name in MEMBERS:
            procs[name] = subprocess.Popen(
                [*child, "--child-gloo", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        await_keys(store, [f"gloo/entering/{m}" for m in MEMBERS], procs, deadline)
        time.sleep(0.3)  # p0 and p1 are inside their allreduce by now; p2 sleeps
        killed_at = time.time()
        procs[VICTIM].send_signal(signal.SIGKILL)
        outputs = {name: finish(proc, deadline) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            reap(proc)
    sums = {name: gradient(name, device) for name in MEMBERS}
    everyone = sha256_of(sum(sums.values(), torch.zeros(NUMEL, dtype=torch.float64)))
    survivors = sha256_of(sums["p0"] + sums["p1"])
    keys = [f"gloo/epoch0/{m}" for m in MEMBERS]
    section.checks["gloo_allreduce_equal"] = store.check(keys) and all(
        store.get(key).decode() == everyone for key in keys
    )
    reports = {name: last_json(outputs[name][1]) for name in SURVIVORS}
    section.details |= {
        "exit_codes": {name: code for name, (code, _, _) in outputs.items()},
        "reasons": {name: r.get("reason") for name, r in reports.items()},
        "stderr_tails": {n: err[-1500:] for n, (code, _, err) in outputs.items() if code != 0},
    }
    victim_killed = outputs[VICTIM][0] == -signal.SIGKILL
    section.checks["gloo_kill_detected"] = victim_killed and all(
        outputs[name][0] == 0 and reports[name].get("lost") is True for name in SURVIVORS
    )
    hashes = {reports[name].get("epoch1") for name in SURVIVORS}
    section.checks["gloo_rebuild_equal"] = hashes == {survivors}
    if section.checks["gloo_kill_detected"]:
        section.figures["gloo_detect_s"] = max(
            number(r, "lost_at") - killed_at for r in reports.values()
        )
        section.figures["gloo_rebuild_s"] = max(number(r, "rebuild_s") for r in reports.values())


def await_keys(
    store: Store, keys: list[str], procs: dict[str, subprocess.Popen[str]], deadline: float
) -> None:
    """Wait until every key is set; RuntimeError if a child exits first or time runs out."""
    while not store.check(keys):
        gone = {name: p for name, p in procs.items() if p.poll() is not None}
        if gone:
            said = {
                name: (p.returncode, p.communicate(timeout=30)[1][-1500:])
                for name, p in gone.items()
            }
            raise RuntimeError(f"children exited before the kill (status, stderr): {said}")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"not every child reached the collective within {SECTION_S} s")
        time.sleep(0.05)


def finish(proc: subprocess.Popen[str], deadline: float) -> tuple[int, str, str]:
    """The child's exit status, stdout and stderr, once it exits by ``deadline``; a child
    still running then is killed (status -9)."""
    try:
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        err += f"\n(killed: still running after the section's {SECTION_S} s)"
    return proc.returncode, out, err


def reap(proc: subprocess.Popen[str]) -> None:
    """No child outlives the section, even when it failed half-way."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)  # SIGKILLed: it goes whatever its pipes hold


def last_json(stdout: str) -> dict[str, Any]:
    """The child's report, its last line: a JSON object, or {} if it printed none."""
    lines = stdout.strip().splitlines()
    try:
        parsed = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def number(report: dict[str, Any], key: str) -> float:
    """``report[key]`` if it is a number (a child's report is checked, not trusted)."""
    value = report.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a child of gpu_check's gloo section")
    parser.add_argument("--child-gloo", choices=MEMBERS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    args = parser.parse_args(argv)
    return gloo_child(args.child_gloo, args.port, args.device)


if __name__ == "__main__":
    sys.exit(main())
