"""The `keepstep` command line shaped like torchrun's, and what the flags become.

`--nnodes N|MIN:MAX` (with `--nodes`/`--min-nodes` kept), `--nproc-per-node N|auto|gpu`,
`--max-restarts`, `-m module`, `--version`, `keepstep files`, and help for every flag.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from keepstep import resources
from keepstep.cli import build_parser, main, version
from keepstep.errors import ConfigError
from keepstep.launch import run as launch_run
from keepstep.launch.cli import run_config
from keepstep.launch.devices import resolve_nproc
from keepstep.launch.run import Launcher

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "examples" / "mlp.py")
JOB = ["--global-batch", "48", "--micro-batch", "4", "--steps", "4"]


def config(etcd: str, *argv: str) -> Any:
    args = build_parser().parse_args(["run", *argv])
    return run_config(args, {"KEEPSTEP_ETCD_BIN": etcd, "CUDA_VISIBLE_DEVICES": ""})


def test_nnodes_is_a_count_or_a_range(etcd_binary: str) -> None:
    four = config(etcd_binary, "--nnodes", "4", *JOB, MLP)
    assert (four.nodes, four.min_nodes) == (4, 4)
    ranged = config(etcd_binary, "--nnodes", "2:4", *JOB, MLP)
    assert (ranged.nodes, ranged.min_nodes) == (4, 2)  # start 4, go on with 2 after 30 s
    # The old spelling still works (the chaos harness and scripts use it).
    old = config(etcd_binary, "--nodes", "3", "--min-nodes", "2", *JOB, MLP)
    assert (old.nodes, old.min_nodes) == (3, 2)
    with pytest.raises(ConfigError, match="both give the minimum"):
        config(etcd_binary, "--nnodes", "2:4", "--min-nodes", "3", *JOB, MLP)


def test_the_admission_grace_reaches_every_agent(etcd_binary: str) -> None:
    """How long the first epoch waits for all nodes before it starts with the minimum."""
    assert config(etcd_binary, "--nnodes", "2:4", *JOB, MLP).admission_grace == 30.0
    cfg = config(etcd_binary, "--nnodes", "2:4", "--admission-grace", "90", *JOB, MLP)
    assert cfg.admission_grace == 90.0
    agent = launch_run.agent_config(
        cfg, job="j", node="n1", etcd="127.0.0.1:2379", etcd_tls=None, host="127.0.0.1",
        expected_nodes=4, resume_blob=None, resume_step=0,
    )  # fmt: skip
    assert (agent.admission_grace, agent.min_nodes, agent.expected_nodes) == (90.0, 2, 4)
    with pytest.raises(ConfigError, match="--admission-grace -1 must be"):
        launch_run.RunConfig(**{**vars(cfg), "admission_grace": -1})


def test_nproc_per_node_words_count_cuda_devices() -> None:
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert resolve_nproc(3, lambda: 8, env) == 3
    assert resolve_nproc("auto", lambda: 0, env) == 1  # a machine without GPUs
    assert resolve_nproc("auto", lambda: 2, env) == 2
    assert resolve_nproc("gpu", lambda: 8, env) == 8
    with pytest.raises(ConfigError, match=r"--nproc-per-node gpu: .*CUDA_VISIBLE_DEVICES=''"):
        resolve_nproc("gpu", lambda: 0, env)


def test_module_and_max_restarts_reach_the_agents(
    etcd_binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--nnodes", "2", *JOB, "--max-restarts", "0", "--run-dir", str(tmp_path)]
    cfg = config(etcd_binary, *argv, "-m", "pkg.train", "--lr", "0.1")
    assert cfg.module and cfg.script == "pkg.train" and cfg.script_args == ("--lr", "0.1")
    started: list[list[str]] = []

    def popen(argv: list[str], **kwargs: object) -> object:
        started.append(argv)
        return object()

    monkeypatch.setattr(launch_run.subprocess, "Popen", popen)
    launcher = Launcher(cfg, io.StringIO())
    launcher.etcd_endpoint = "127.0.0.1:1"  # what run() sets before it starts the nodes
    launcher.resume_blob = None
    launcher.resume_step = 0
    launcher._start_node("n0")
    assert started and started[0][-2:] == ["--config", str(tmp_path / "agent-n0.json")]
    agent = json.loads((tmp_path / "agent-n0.json").read_text())
    assert agent["command"] == [sys.executable, "-m", "pkg.train", "--lr", "0.1"]
    assert agent["max_restarts"] == 0
    plain = config(etcd_binary, *argv, MLP)
    assert not plain.module and plain.max_restarts == 0
    assert "KEEPSTEP_TENSORBOARD" not in agent["worker_env"]
    # --tensorboard reaches every worker (keepstep.init opens the writer on the leader).
    board = config(etcd_binary, *argv, "--tensorboard", str(tmp_path / "tb"), MLP)
    launcher = Launcher(board, io.StringIO())
    launcher.etcd_endpoint, launcher.resume_blob, launcher.resume_step = "127.0.0.1:1", None, 0
    launcher._start_node("n1")
    agent = json.loads((tmp_path / "agent-n1.json").read_text())
    assert agent["worker_env"]["KEEPSTEP_TENSORBOARD"] == str(tmp_path / "tb")


def test_the_collective_bound_reaches_every_worker(
    etcd_binary: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--collective-timeout becomes the workers' KEEPSTEP_COLLECTIVE_TIMEOUT, which
    keepstep.init reads (tests/elastic/test_api.py); unset, the workers keep their default."""
    plain = config(etcd_binary, "--nnodes", "2", *JOB, MLP)
    assert "KEEPSTEP_COLLECTIVE_TIMEOUT" not in plain.extra_env
    cfg = config(etcd_binary, "--nnodes", "2", "--collective-timeout", "120", *JOB, MLP)
    assert cfg.extra_env["KEEPSTEP_COLLECTIVE_TIMEOUT"] == "120.0"
    for bad in ("0", "-5", "nan", "soon"):
        with pytest.raises(SystemExit) as exit_:
            config(etcd_binary, "--nnodes", "2", "--collective-timeout", bad, *JOB, MLP)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--collective-timeout: '{bad}': must be a number of seconds > 0" in err, err


@pytest.mark.slow
def test_a_module_trains_like_a_script(tmp_path: Path) -> None:
    # `-m`: each worker runs `python -m mymlp`, found from the launcher's directory.
    (tmp_path / "mymlp.py").write_text(Path(MLP).read_text())
    run_dir = tmp_path / "run"
    argv = ["--nnodes", "1", "--global-batch", "8", "--micro-batch", "4", "--steps", "3"]
    argv += ["--run-dir", str(run_dir), "--timeout", "80", "-m", "mymlp"]
    proc = subprocess.run(
        [sys.executable, "-m", "keepstep", "run", *argv],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["params_sha256"]


def test_version_names_the_checkout_when_not_installed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert version().startswith("0.1.0 (not installed: the checkout at ")
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith("keepstep 0.1.0")


def test_files_lists_and_finds_what_is_shipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["files"]) == 0
    listed = capsys.readouterr().out
    for name in ("examples/mlp.py", "e2e/scenarios/kill-node.yaml", "manifests/crd/trainjob.yaml"):
        assert name in listed
    assert main(["files", "trainjob"]) == 0
    assert capsys.readouterr().out.strip() == str(REPO / "manifests" / "crd" / "trainjob.yaml")
    assert resources.find("examples/mlp.py") == resources.find("mlp.py") == Path(MLP)


def test_a_missing_script_points_at_a_shipped_example(etcd_binary: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"shipped example of that name is {MLP}"):
        config(etcd_binary, "--nnodes", "1", *JOB, str(tmp_path / "examples" / "mlp.py"))


def test_every_flag_of_every_subcommand_has_help() -> None:
    missing = set()

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                missing.add((path, action.option_strings[0] if action.option_strings else ""))

    walk(build_parser(), "keepstep")
    assert missing == set()
