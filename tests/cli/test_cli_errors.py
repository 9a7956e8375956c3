"""Bad invocations of every `keepstep` subcommand: one line that names the value, exit 2,
before anything starts.

Each case runs the real command in a fresh interpreter, through a probe that reports at
exit whether torch was imported. Beside the exit status and the message, a case checks
that the command used under a second of CPU time (the child's own user + system time,
which a loaded machine does not inflate the way it does wall time; the wall time is in
the failure message), that torch was never imported, that the run directory was never
made (so no etcd was started: it lives there), and that no process naming the case's
folder is left. Then two inputs that are not flags: a malformed line in an event log (the
dashboard skips it with a warning), and the exit status of a runtime failure (1).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.agent.node.config import AgentConfig, dump_config

# `python -m keepstep ARGS`, and at exit one more line: whether torch was imported.
PROBE = """
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write(f"\\nprobe: torch={'torch' in sys.modules}\\n"))
sys.argv = ["keepstep", *sys.argv[1:]]
runpy.run_module("keepstep", run_name="__main__", alter_sys=True)
"""
CPU_S = 1.0

# {run} is the run directory, {tmp} the case's folder, {script} a training script there.
RUN = ["run", "--global-batch", "16", "--micro-batch", "4", "--steps", "4", "--run-dir", "{run}"]
TWO = [*RUN, "--nnodes", "2"]

CASES: list[tuple[str, list[str], str]] = [
    ("no-subcommand", [], "the following arguments are required: COMMAND"),
    ("unknown-subcommand", ["frobnicate"], "invalid choice: 'frobnicate'"),
    ("resume-http", [*TWO, "--resume", "http://host/ckpt", "{script}"], "scheme 'http'"),
    ("resume-s3-no-credentials", [*TWO, "--resume", "s3://b/ckpt", "{script}"], "no S3 cred"),
    ("checkpoint-memory", [*TWO, "--checkpoint", "memory://x", "{script}"], "scheme 'memory'"),
    ("checkpoint-bogus", [*TWO, "--checkpoint", "bogus://x/y", "{script}"], "protocol 'bogus'"),
    ("seed", [*TWO, "--seed", "-1", "{script}"], "--seed: -1: must be an integer >= 0"),
    ("timeout", [*TWO, "--timeout", "-5", "{script}"], "--timeout: '-5': must be a number"),
    ("timeout-nan", [*TWO, "--timeout", "nan", "{script}"], "--timeout: 'nan'"),
    ("steps", [*TWO, "--steps", "0", "{script}"], "--steps: 0: must be an integer >= 1"),
    ("not-a-multiple", [*RUN, "--nnodes", "1", "--global-batch", "15", "{script}"], "15 must "),
    ("more-nodes", [*RUN, "--nnodes", "5", "{script}"], "5 workers ((--nnodes 5"),
    ("nproc-0", [*TWO, "--nproc-per-node", "0", "{script}"], "--nproc-per-node/--nproc_per_n"),
    ("nproc-gpu", [*TWO, "--nproc-per-node", "gpu", "{script}"], "gpu: no CUDA device"),
    ("fault-kind", [*TWO, "--fault", "explode:1@step=2", "{script}"], "unknown kind 'explode'"),
    ("fault-form", [*TWO, "--fault", "kill-node", "{script}"], "'kill-node' is not of the form"),
    ("fault-node", [*TWO, "--fault", "kill-node:7@step=2", "{script}"], "node 7 does not"),
    ("fault-step", [*TWO, "--fault", "kill-node:1@step=9", "{script}"], "not before --steps 4"),
    ("no-script", [*TWO, "{tmp}/nope.py"], "nope.py' does not exist"),
    ("every-no-url", [*TWO, "--checkpoint-every", "2", "{script}"], "--checkpoint-every needs"),
    ("nnodes-order", [*RUN, "--nnodes", "3:2", "{script}"], "'3:2': needs 1 <= MIN <= MAX"),
    ("nnodes-word", [*RUN, "--nnodes", "many", "{script}"], "'many': must be a node count"),
    ("min-twice", [*RUN, "--nnodes", "1:2", "--min-nodes", "1", "{script}"], "give one"),
    ("min-above", [*RUN, "--nnodes", "2", "--min-nodes", "3", "{script}"], "--min-nodes 3"),
    ("grace", [*RUN, "--nnodes", "1:2", "--admission-grace", "soon", "{script}"], "'soon': must"),
    ("max-restarts", [*TWO, "--max-restarts", "-1", "{script}"], "--max-restarts/--max_restarts"),
    ("module-name", [*TWO, "-m", "1bad.mod"], "-m '1bad.mod' is not a module name"),
    ("etcd-members", [*TWO, "--etcd-members", "2", "{script}"], "invalid choice: 2"),
    ("hang-timeout", [*TWO, "--hang-timeout", "0", "{script}"], "--hang-timeout: 0"),
    ("heartbeat-timeout", [*TWO, "--heartbeat-timeout", "-1", "{script}"], "seconds >= 0"),
    ("no-etcd-binary", [*TWO, "{script}"], "KEEPSTEP_ETCD_BIN"),
    ("selfcheck-steps", ["selfcheck", "--steps", "0"], "--steps: 0: must be an integer >= 1"),
    ("selfcheck-ranks", ["selfcheck", "--ranks", "0"], "ranks=0 must be between 1 and 12"),
    ("selfcheck-list", ["selfcheck", "--ranks", "1,x"], "'1,x': expected a comma-separated"),
    ("dashboard-busy", ["dashboard", "--run-dir", "{tmp}", "--port", "{busy}"], "is in use"),
    ("dashboard-dir", ["dashboard", "--run-dir", "{tmp}/nope"], "--run-dir {tmp}/nope"),
    ("dashboard-port", ["dashboard", "--run-dir", "{tmp}", "--port", "70000"], "--port 70000"),
    ("agent-config", ["agent", "--config", "{tmp}/nope.json"], "nope.json: no such file"),
    ("agent-bad-config", ["agent", "--config", "{tmp}/bad.json"], "not an agent config"),
    ("agent-stale-config", ["agent", "--config", "{tmp}/old.json"], "old.json: "),
    ("agent-flags", ["agent", "--etcd", "127.0.0.1:9", "--job", "j"], "needs --config FILE"),
    ("agent-nodes", ["agent", "--nodes", "0"], "--nodes: 0: must be an integer >= 1"),
    ("chaos-scenario", ["chaos", "run", "{tmp}/nope.yaml"], "nope.yaml"),
    ("chaos-report", ["chaos", "check", "{tmp}/nope.json"], "nope.json"),
    ("chaos-bad-report", ["chaos", "check", "{tmp}/bad.json"], "not a report written by"),
    ("files", ["files", "nope"], "no shipped file 'nope'; shipped: "),
    ("checkpoint-no-verb", ["checkpoint"], "the following arguments are required: VERB"),
    ("checkpoint-scheme", ["checkpoint", "ls", "memory://x"], "URL 'memory://x': unsupported"),
    ("checkpoint-s3", ["checkpoint", "ls", "s3://b/ckpt"], "no S3 cred"),
    ("checkpoint-empty", ["checkpoint", "ls", "{tmp}/none"], "{tmp}/none: no checkpoint there"),
    ("checkpoint-exists", ["checkpoint", "export", "{tmp}", "{tmp}/bad.json"], "OUT {tmp}/bad"),
    ("checkpoint-out-dir", ["checkpoint", "export", "{tmp}", "{tmp}/no/o.pt"], "no directory"),
    ("checkpoint-step", ["checkpoint", "export", "--step", "-1", "x", "o"], "--step: -1: must"),
    ("checkpoint-format", ["checkpoint", "export", "--format", "onnx", "x", "o"], "'onnx'"),
]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def leftovers(marker: str) -> list[str]:
    """Command lines of live processes that name `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone, or not a process
        if proc.name.isdigit() and marker in cmdline and int(proc.name) != os.getpid():
            found.append(cmdline)
    return found


@pytest.mark.parametrize(("name", "argv", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_invocation_is_one_line_naming_the_value(
    name: str, argv: list[str], message: str, tmp_path: Path, busy_port: int, etcd_binary: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker was started')\n")
    (tmp_path / "bad.json").write_text("{not json")
    # An agent configuration of another version: a field this one does not know.
    old = AgentConfig(job="j", node="n0", etcd="127.0.0.1:9", script=str(script))
    dump_config(old, tmp_path / "old.json")
    stale = json.loads((tmp_path / "old.json").read_text()) | {"retired_field": 1}
    (tmp_path / "old.json").write_text(json.dumps(stale))
    run_dir = tmp_path / "run"
    values = {"run": run_dir, "tmp": tmp_path, "script": script, "busy": busy_port}
    args = [a.format(**values) for a in argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "KEEPSTEP_ETCD_BIN": str(tmp_path / "no-etcd") if name == "no-etcd-binary" else etcd_binary,
        "HOME": str(tmp_path),  # no ~/.aws of the machine's
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance role either
        "CUDA_VISIBLE_DEVICES": "",  # no GPU, on any machine
    }
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("probe: torch="), proc.stderr
    probe = lines.pop()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr  # one line, no traceback, no usage block
    assert lines[0].startswith("keepstep") and "error: " in lines[0], lines[0]
    assert message.format(**values) in lines[0]
    assert probe == "probe: torch=False"
    assert proc.stdout == ""
    assert not run_dir.exists()  # nothing started: etcd and the nodes live in the run dir
    assert leftovers(str(tmp_path)) == []
    assert cpu < CPU_S, f"{cpu:.2f} s of CPU ({wall:.2f} s wall) before the error"


def test_a_malformed_event_line_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One bad line in one run's event log must not take that run, or the list of runs, off
    # the dashboard: the line is skipped and named in a warning.
    from keepstep.dashboard.server import DashboardApp

    t = 1_800_000_000.0
    agreed = {"t": t, "kind": "epoch-agreed", "epoch": 0, "members": ["n0/0"], "reason": "ready"}
    commit = {
        "t": t + 1, "kind": "commit", "member": "n0/0", "step": 0, "epoch": 0, "world_size": 1,
        "micro_batches": [0], "samples": [0, 1], "step_s": 0.1, "assignment": {"n0/0": [0]},
    }  # fmt: skip
    bad = [
        b"\xff\xfe not text",  # broken bytes
        b"[1, 2]",  # JSON, not an event
        b'{"kind": "commit"}',  # no time
        b'{"t": "soon", "kind": "commit"}',
        json.dumps({**commit, "t": t + 2, "epoch": "zero"}).encode(),  # a field's type
        json.dumps({**agreed, "t": t + 3, "members": 7}).encode(),
        b'{"t": 1, "ki',  # a node killed mid-write
    ]
    for name in ("run-a", "run-b"):
        (tmp_path / name).mkdir()
        good = [json.dumps(agreed).encode(), json.dumps(commit).encode()]
        lines = good[:1] + (bad if name == "run-a" else []) + good[1:]
        (tmp_path / name / "events-n0.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level("WARNING", logger="keepstep.dashboard.reader"):
        listed = {r["run"]: r for r in DashboardApp(tmp_path).runs()}
    assert listed["run-a"] == listed["run-b"] | {"run": "run-a"}
    assert listed["run-a"]["step"] == listed["run-b"]["step"]
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == len(bad)
    assert skipped[0].startswith(f"{tmp_path / 'run-a' / 'events-n0.jsonl'}:2: line skipped")
    assert "epoch='zero' is not a number" in skipped[4]


def test_a_runtime_failure_exits_1_and_a_usage_error_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from keepstep import resources
    from keepstep.cli import main
    from keepstep.errors import ConfigError, KeepstepError

    def broken(name: str) -> Path:
        raise KeepstepError("the shipped files are gone")

    monkeypatch.setattr(resources, "find", broken)
    assert main(["files", "mlp"]) == 1
    assert capsys.readouterr().err == "keepstep: error: the shipped files are gone\n"

    def refused(name: str) -> Path:
        raise ConfigError(f"no shipped file {name!r}")

    monkeypatch.setattr(resources, "find", refused)
    assert main(["files", "nope"]) == 2
    assert capsys.readouterr().err == "keepstep: error: no shipped file 'nope'\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["files"],
        ["files", "mlp"],
        ["run", "--help"],
        ["agent", "--help"],
        ["checkpoint", "--help"],
        ["checkpoint", "export", "--help"],
    ],
)
def test_commands_that_need_no_torch_do_not_import_it(argv: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and proc.stderr.strip() == "probe: torch=False"
