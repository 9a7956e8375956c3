"""`keepstep agent` configured the way a TrainJob pod is: flags and KEEPSTEP_* variables."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from keepstep.agent.node.cli import etcd_endpoints, from_flags
from keepstep.agent.protocol.events import read_events
from keepstep.cli import build_parser
from keepstep.elastic.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def test_missing_values_are_named_together() -> None:
    args = build_parser().parse_args(["agent", "--etcd", "127.0.0.1:1", "--job", "j"])
    with pytest.raises(ConfigError) as info:
        from_flags(args)
    text = str(info.value)
    for flag in ("--nodes", "--global-batch", "--micro-batch", "--steps", "-- COMMAND"):
        assert flag in text
    assert "--etcd" not in text


def test_flags_become_the_agent_configuration(tmp_path: Path) -> None:
    argv = ["agent", "--etcd", "127.0.0.1:2379", "--job", "ns.demo", "--node", "demo-node-3"]
    argv += ["--nodes", "3", "--min-nodes", "2", "--nproc", "2", "--global-batch", "32"]
    argv += ["--micro-batch", "4", "--steps", "9", "--seed", "5", "--host", "127.0.2.7"]
    argv += ["--run-dir", str(tmp_path), "--", "python", "train.py", "--lr", "0.1"]
    cfg = from_flags(build_parser().parse_args(argv))
    assert (cfg.job, cfg.node, cfg.host) == ("ns.demo", "demo-node-3", "127.0.2.7")
    assert (cfg.expected_nodes, cfg.min_nodes, cfg.nproc, cfg.steps) == (3, 2, 2, 9)
    assert cfg.command == ("python", "train.py", "--lr", "0.1")
    assert cfg.worker_env["KEEPSTEP_GLOBAL_BATCH"] == "32"
    assert cfg.worker_env["KEEPSTEP_SEED"] == "5"
    assert cfg.worker_env["KEEPSTEP_HOST"] == "127.0.2.7"  # what the workers' gloo binds
    assert cfg.admission_timeout == 3600.0  # generous: pods may take minutes to start
    later = build_parser().parse_args(["agent", "--admission-timeout", "120", *argv[1:]])
    assert from_flags(later).admission_timeout == 120.0


def test_the_endpoints_come_from_keepstep_etcd_endpoints_or_its_old_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert etcd_endpoints({"KEEPSTEP_ETCD_ENDPOINTS": "10.0.0.1:2379"}) == "10.0.0.1:2379"
    both = {"KEEPSTEP_ETCD_ENDPOINTS": "10.0.0.1:2379", "KEEPSTEP_ETCD": "10.0.0.9:2379"}
    assert etcd_endpoints(both) == "10.0.0.1:2379"
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):
        assert etcd_endpoints({"KEEPSTEP_ETCD": "10.0.0.9:2379"}) == "10.0.0.9:2379"
    assert "KEEPSTEP_ETCD is deprecated" in caplog.text
    assert "set KEEPSTEP_ETCD_ENDPOINTS=10.0.0.9:2379 instead" in caplog.text
    assert etcd_endpoints({}) is None


@pytest.mark.slow
def test_two_agents_started_like_pods_train_to_the_end(etcd_server: str, tmp_path: Path) -> None:
    job = f"pods-{uuid.uuid4().hex[:8]}"
    procs = []
    for i, host in enumerate(["127.0.0.1", "127.0.0.2"]):
        env = dict(os.environ)
        # The operator's env: etcd, job, node (the pod name) and host (the pod IP).
        env.update(
            KEEPSTEP_ETCD_ENDPOINTS=etcd_server,
            KEEPSTEP_JOB=job,
            KEEPSTEP_NODE=f"p{i}",
            KEEPSTEP_HOST=host,
        )
        argv = [sys.executable, "-m", "keepstep", "agent", "--nodes", "2"]
        argv += ["--global-batch", "16", "--micro-batch", "4", "--steps", "6"]
        argv += ["--run-dir", str(tmp_path), "--", sys.executable, str(REPO / "examples/mlp.py")]
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = [p.communicate(timeout=100)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    events = read_events(tmp_path)
    finished = [e for e in events if e["kind"] == "finish"]
    assert len(finished) == 2 and len({e["params_sha256"] for e in finished}) == 1
    stores = {e["node"]: e["store"] for e in events if e["kind"] == "agent-started"}
    # Each agent hosts a store on its own address; epoch 0 rendezvoused on the first node's.
    assert stores["p0"].startswith("127.0.0.1:") and stores["p1"].startswith("127.0.0.2:")
    agreed = [e for e in events if e["kind"] == "epoch-agreed"]
    assert agreed[0]["store"] == stores["p0"]
    assert json.dumps(agreed[0]["members"]) == json.dumps(["p0/0", "p1/0"])


def test_resume_from_an_empty_location_starts_from_step_zero(tmp_path: Path) -> None:
    # The operator adds --resume to every pod of a resumed job; no checkpoint there yet is
    # not an error (a refusing pod would only be replaced by another that refuses).
    argv = ["agent", "--etcd", "127.0.0.1:2379", "--job", "ns.demo", "--nodes", "2"]
    argv += ["--global-batch", "16", "--micro-batch", "4", "--steps", "9"]
    argv += ["--resume", f"file://{tmp_path}/none", "--run-dir", str(tmp_path / "run")]
    cfg = from_flags(build_parser().parse_args([*argv, "--", "python", "train.py"]))
    assert (cfg.resume_step, cfg.resume_blob) == (0, None)


@pytest.mark.slow
def test_agents_started_like_pods_resume_from_the_checkpoint(
    etcd_server: str, tmp_path: Path
) -> None:
    # A whole job trains 12 of 20 steps with checkpoints, then stops (a suspended TrainJob);
    # agents started as the operator starts a resumed job's pods finish it with the numbers
    # of the same job run without a stop.
    url = f"file://{tmp_path}/ckpt"
    mlp = str(REPO / "examples" / "mlp.py")
    shape = ["--global-batch", "16", "--micro-batch", "4", "--seed", "3"]
    first = [sys.executable, "-m", "keepstep", "run", "--nodes", "2", *shape]
    first += ["--steps", "12", "--checkpoint", url, "--checkpoint-every", "4"]
    first += ["--run-dir", str(tmp_path / "first"), "--timeout", "90", mlp]
    done = subprocess.run(first, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    whole = [sys.executable, "-m", "keepstep", "run", "--nodes", "2", *shape]
    whole += ["--steps", "20", "--run-dir", str(tmp_path / "whole"), "--timeout", "90", mlp]
    done = subprocess.run(whole, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    reference = json.loads((tmp_path / "whole" / "summary.json").read_text())["params_sha256"]

    job, run_dir, procs = f"resumed-{uuid.uuid4().hex[:8]}", tmp_path / "pods", []
    for i in range(2):
        env = dict(
            os.environ, KEEPSTEP_ETCD_ENDPOINTS=etcd_server, KEEPSTEP_JOB=job, KEEPSTEP_NODE=f"p{i}"
        )
        argv = [sys.executable, "-m", "keepstep", "agent", "--nodes", "2", *shape]
        argv += ["--steps", "20", "--resume", url, "--run-dir", str(run_dir), "--", sys.executable]
        procs.append(
            subprocess.Popen(
                [*argv, mlp], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    outputs = [p.communicate(timeout=100)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("resuming from step 12" in out for out in outputs), outputs
    events = read_events(run_dir)
    finished = {e["params_sha256"] for e in events if e["kind"] == "finish"}
    assert finished == {reference}
    assert min(e["step"] for e in events if e["kind"] == "commit") == 12


def test_a_failed_agent_says_why_in_its_termination_log(etcd_server: str, tmp_path: Path) -> None:
    env = dict(os.environ, KEEPSTEP_ETCD_ENDPOINTS=etcd_server, KEEPSTEP_NODE="p0")
    env["KEEPSTEP_JOB"] = f"fails-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "termination-log"  # a pod's /dev/termination-log
    argv = [sys.executable, "-m", "keepstep", "agent", "--nodes", "1", "--max-restarts", "0"]
    argv += ["--global-batch", "8", "--micro-batch", "4", "--steps", "2"]
    argv += ["--termination-log", str(log), "--run-dir", str(tmp_path / "run")]
    argv += ["--", sys.executable, "-c", "import sys; sys.exit(3)"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stderr
    message = log.read_text()
    assert message.startswith("keepstep agent p0: ") and "code 3" in message, message
    assert message in done.stderr  # the same line the agent printed


def test_the_agent_exits_with_its_code_and_flushed_output_past_a_stuck_daemon_thread() -> None:
    """The agent ends its process without the interpreter's teardown (a daemon thread may
    be blocked in native code): the code is kept and what it printed or logged is out."""
    code = (
        "import logging, sys, threading, time\n"
        "from keepstep.agent.node.cli import exit_now\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "print('summary on stdout', end='')\n"
        "logging.getLogger('x').warning('last words')\n"
        "exit_now(3)\n"
        "print('never')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "summary on stdout"
    assert "last words" in proc.stderr
