"""`keepstep run` end to end on this machine: real etcd, real agents, real faults.

Each fault kind must leave the job with the parameters of the fault-free run, every
sample seen exactly once, the global batch unchanged and no process behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent.protocol.events import read_events
from keepstep.launch.faults import parse_fault
from keepstep.launch.local import LocalRun, agreed_sha, run_local
from keepstep.launch.run import FAST_READ_S, SLOW_READ_S, Launcher, RunConfig

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "examples" / "mlp.py")
STEPS, GB, MB = 24, 48, 4

pytestmark = pytest.mark.slow


def keepstep_run(
    tmp: Path, *args: str, nodes: int = 4, timeout: float = 110, sleep: float = 0.0
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    run_dir = tmp / "run"
    cmd = [
        sys.executable,
        "-m",
        "keepstep",
        "run",
        "--nodes",
        str(nodes),
        "--global-batch",
        str(GB),
        "--micro-batch",
        str(MB),
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--run-dir",
        str(run_dir),
        "--timeout",
        str(timeout - 10),
        # Every node starts at once: the first epoch waits for all of them, however loaded
        # the machine (with --min-nodes it would start without the slow ones after 30 s).
        "--admission-grace",
        str(timeout - 20),
        *args,
        MLP,
        "--sleep",
        str(sleep),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def left_behind(run_dir: Path) -> list[int]:
    """Processes that still carry this run's job in their environment or command line."""
    job = json.loads((run_dir / "agent-n0.json").read_text())["job"]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            blob = (entry / "environ").read_bytes() + (entry / "cmdline").read_bytes()
        except OSError:
            continue
        # Workers carry the job's link address (@keepstep/<job>/<node>).
        if f"@keepstep/{job}/".encode() in blob or str(run_dir).encode() in blob:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    result = run_local(
        LocalRun(
            script=MLP, steps=STEPS, global_batch=GB, micro_batch=MB, schedule=[["m0"]], seed=3
        ),
        tmp_path_factory.mktemp("reference"),
    )
    return agreed_sha(result)


def check(
    proc: subprocess.CompletedProcess[str],
    summary: dict[str, Any] | None,
    reference: str,
    tmp: Path,
) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary is not None
    assert summary["params_sha256"] == reference
    assert summary["steps"] == STEPS
    samples = summary["samples"]
    assert samples["lost"] == 0 and samples["duplicated"] == 0
    assert samples["seen_once"] == samples["expected"] == STEPS * GB
    assert summary["global_batch"] == GB
    assert left_behind(tmp / "run") == []
    return summary


def test_fault_free_run_matches_one_process(reference: str, tmp_path: Path) -> None:
    proc, summary = keepstep_run(tmp_path)
    s = check(proc, summary, reference, tmp_path)
    assert s["world_size_by_step"] == [4] * STEPS
    assert s["recoveries"] == []
    # The workers' last epoch ends in order before their store connections are shut: no
    # store call of theirs fails, which c10d would log with a C++ stack in their logs.
    logs = sorted((tmp_path / "run").glob("worker-*.log"))
    assert len(logs) == 4
    for log in logs:
        assert "[c10d]" not in log.read_text(), log.name


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        ("kill-worker:1@step=8", "kill-worker"),
        ("kill-node:2@step=8", "kill-node"),
        ("hang-node:1@step=8", "hang-node"),
    ],
)
def test_failures_keep_the_numbers(fault: str, cause: str, reference: str, tmp_path: Path) -> None:
    proc, summary = keepstep_run(tmp_path, "--fault", fault, "--min-nodes", "2")
    s = check(proc, summary, reference, tmp_path)
    first = s["recoveries"][0]
    assert first["cause"] == cause
    assert first["mttr_s"] is not None and first["mttr_s"] < 30
    assert 3 in s["world_size_by_step"]


@pytest.mark.parametrize("fault", ["kill-node:0@step=8", "hang-node:0@step=8"])
def test_losing_the_node_that_hosts_the_store(fault: str, reference: str, tmp_path: Path) -> None:
    # Node n0 is the first node of epoch 0, so its agent hosts the store the job's
    # process groups rendezvous on; the next epoch must name a survivor's store.
    proc, summary = keepstep_run(tmp_path, "--fault", fault, "--min-nodes", "2")
    check(proc, summary, reference, tmp_path)
    agreed = [e for e in read_events(tmp_path / "run") if e["kind"] == "epoch-agreed"]
    stores = {e["epoch"]: e["store"] for e in agreed}
    hosts = {
        e["node"]: e["store"] for e in read_events(tmp_path / "run") if e["kind"] == "agent-started"
    }
    assert stores[0] == hosts["n0"]
    assert stores[max(stores)] != hosts["n0"] and stores[max(stores)] in hosts.values()


def test_a_warm_spare_replaces_a_crashed_worker(reference: str, tmp_path: Path) -> None:
    # Slow steps leave the spare (started at the first commit) time to import torch.
    proc, summary = keepstep_run(
        tmp_path, "--fault", "kill-worker:2@step=12", "--warm-spare", "--min-nodes", "2", sleep=0.3
    )
    s = check(proc, summary, reference, tmp_path)
    started = [e for e in read_events(tmp_path / "run") if e["kind"] == "worker-started"]
    replacement = [e for e in started if e["member"] == "n2/0"][-1]
    assert replacement["warm"] is True
    assert s["world_size_by_step"][-1] == 4  # the replacement was admitted again


def test_drain_leaves_at_a_boundary_without_rollback(reference: str, tmp_path: Path) -> None:
    proc, summary = keepstep_run(tmp_path, "--fault", "drain-node:2@step=8", "--min-nodes", "2")
    s = check(proc, summary, reference, tmp_path)
    assert s["recoveries"][0]["rolled_back_steps"] == 0
    assert s["world_size_by_step"][-1] == 3


def test_join_is_admitted_and_gets_state_by_network(reference: str, tmp_path: Path) -> None:
    # Slow steps (0.3 s per micro-batch: ~25 s from step 3 to the end) leave the new node
    # time to start and be admitted; at 0.2 s a machine loaded beyond CI's own two sessions
    # once ended the job before the joiner's worker had imported torch.
    proc, summary = keepstep_run(tmp_path, "--fault", "join-node@step=3", nodes=3, sleep=0.3)
    s = check(proc, summary, reference, tmp_path)
    assert s["world_size_by_step"][0] == 3 and s["world_size_by_step"][-1] == 4


def test_a_second_fault_during_recovery(reference: str, tmp_path: Path) -> None:
    proc, summary = keepstep_run(
        tmp_path,
        "--fault",
        "kill-node:1@step=8",
        "--fault",
        "kill-worker:3@step=8",
        "--min-nodes",
        "2",
    )
    s = check(proc, summary, reference, tmp_path)
    assert min(w for w in s["world_size_by_step"] if w) <= 3


def test_sharded_state_missing_after_a_double_fault_waits_for_the_restarted_worker(
    reference: str, tmp_path: Path
) -> None:
    # ZeRO-1 on 4 nodes: n2 is lost and n0's worker killed at once, so the survivors n1/0
    # and n3/0 enter an epoch in which some chunks' owner and replica were n0 and n2. n0's
    # agent keeps its snapshot: the survivors wait, warm, for n0/0's restart, and the
    # epoch that admits it has the whole state (they used to exit and restart cold).
    proc, summary = keepstep_run(
        tmp_path,
        "--shard",
        "zero1",
        "--fault",
        "kill-node:2@step=8",
        "--fault",
        "kill-worker:0@step=8",
        "--min-nodes",
        "2",
    )
    s = check(proc, summary, reference, tmp_path)  # the numbers of full replicas
    events = read_events(tmp_path / "run")
    missing = [e for e in events if e["kind"] == "fault-detected" and e["cause"] == "missing-state"]
    assert missing and all("no live copy" in e["reason"] for e in missing), (
        s["recoveries"],
        proc.stdout[-3000:],
    )
    reasons = [e["reason"] for e in events if e["kind"] == "epoch-agreed"]
    assert any("admit n0/0 for the missing sharded state" in r for r in reasons), reasons
    started = [e["member"] for e in events if e["kind"] == "worker-started"]
    assert started.count("n1/0") == started.count("n3/0") == 1, started
    assert s["world_size_by_step"][-1] == 3


@pytest.mark.parametrize("shard", ["zero1", "zero2"])
def test_a_double_fault_that_loses_sharded_state_falls_back_to_the_checkpoint(
    shard: str, reference: str, tmp_path: Path
) -> None:
    # Sharded on 4 nodes: n0 and n2 are killed at once, and with them every copy of some
    # chunks (an owner and its replica). No restart can bring those back: the survivors
    # resume, in the same processes, from the newest durable checkpoint, and train the
    # steps after it again, to the numbers of full replicas that never failed.
    ckpt = tmp_path / "ckpt"
    proc, summary = keepstep_run(
        tmp_path,
        "--shard",
        shard,
        "--checkpoint",
        ckpt.as_uri(),
        "--checkpoint-every",
        "4",
        "--fault",
        "kill-node:0@step=10",
        "--fault",
        "kill-node:2@step=10",
        "--min-nodes",
        "2",
    )
    s = check(proc, summary, reference, tmp_path)
    events = read_events(tmp_path / "run")
    missing = [e for e in events if e["kind"] == "fault-detected" and e["cause"] == "missing-state"]
    assert missing and all("no live copy" in e["reason"] for e in missing), (
        s["recoveries"],
        proc.stdout[-3000:],
    )
    [fallback] = s["fallbacks"]
    assert fallback["checkpoint_step"] in (4, 8), fallback
    assert fallback["rerun_steps"] == 10 - fallback["checkpoint_step"], fallback
    assert "every worker that could hold it is gone" in fallback["reason"], fallback
    assert f"durable checkpoint of step {fallback['checkpoint_step']}" in proc.stdout
    started = [e["member"] for e in events if e["kind"] == "worker-started"]
    assert started.count("n1/0") == started.count("n3/0") == 1, started  # no restart
    assert s["world_size_by_step"][-1] == 2


def test_several_workers_per_node(reference: str, tmp_path: Path) -> None:
    proc, summary = keepstep_run(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--fault",
        "kill-node:1@step=8",
        "--min-nodes",
        "1",
        nodes=2,
    )
    s = check(proc, summary, reference, tmp_path)
    assert s["world_size_by_step"][0] == 4 and s["world_size_by_step"][-1] == 2


def test_an_oversubscribed_machine_still_makes_progress(tmp_path: Path) -> None:
    # More workers than cores, three etcd members, a transformer whose first steps compile
    # and allocate, and agents whose view of each new epoch runs late
    # (starved_agent/sitecustomize.py): store reads and collectives miss their default
    # bounds although nothing is lost. Retried with the same bounds, such a job churned
    # through epochs without committing step 0; it must reach the end.
    starved = REPO / "tests" / "agent" / "node" / "starved_agent"
    env = {
        **os.environ,
        "PYTHONPATH": f"{os.environ.get('PYTHONPATH', '')}:{starved}",
        "KEEPSTEP_TEST_EPOCH_DELAY_S": "0.3",
    }
    run_dir = tmp_path / "run"
    steps = 12
    cmd = [
        sys.executable, "-m", "keepstep", "run", "--nodes", "4", "--nproc-per-node", "2",
        "--etcd-members", "3", "--global-batch", "64", "--micro-batch", "4",
        "--steps", str(steps), "--seed", "0", "--run-dir", str(run_dir), "--timeout", "280",
        str(REPO / "examples" / "transformer.py"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == steps and s["params_sha256"] is not None
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    assert s["world_size_by_step"] == [8] * steps
    # Every false alarm it met doubled the next epoch's timeouts (and nothing else did).
    scale = 1.0
    for r in s["recoveries"]:
        if r["reason"].startswith("lost nothing"):
            scale = min(2 * scale, 16.0)
        assert r["timeout_scale"] == scale, s["recoveries"]
    assert left_behind(run_dir) == []


def test_bad_fault_spec_is_refused(tmp_path: Path) -> None:
    proc, _ = keepstep_run(tmp_path, "--fault", "kill-nod:1@step=3", timeout=60)
    assert proc.returncode != 0
    assert "unknown kind 'kill-nod'" in proc.stderr


def test_more_nodes_than_micro_batches_is_refused(tmp_path: Path) -> None:
    proc, _ = keepstep_run(tmp_path, nodes=13, timeout=60)
    assert proc.returncode != 0
    assert "13 workers" in proc.stderr and "only 12 micro-batches" in proc.stderr


def test_the_launcher_reads_etcd_often_only_while_a_fault_is_near(tmp_path: Path) -> None:
    def launcher(*faults: str) -> Launcher:
        cfg = RunConfig(
            script=MLP,
            script_args=(),
            nodes=2,
            global_batch=GB,
            micro_batch=MB,
            steps=400,
            run_dir=tmp_path,
            etcd_binary="etcd",
            faults=tuple(parse_fault(f) for f in faults),
        )
        return Launcher(cfg, sys.stdout)

    assert launcher()._read_interval(10, 5.0) == SLOW_READ_S
    at_200 = launcher("kill-node:1@step=200", "kill-worker:0@step=300")
    # At 5 steps a second a slow read may let the job run 5 steps past the fault's step.
    assert at_200._read_interval(100, 5.0) == SLOW_READ_S
    assert at_200._read_interval(191, 5.0) == FAST_READ_S
    assert at_200._read_interval(199, 0.1) == FAST_READ_S  # at least 2 steps ahead
    assert at_200._read_interval(196, 0.1) == SLOW_READ_S
    assert at_200._read_interval(0, 0.0) == FAST_READ_S  # before the job's rate is known
