"""The agent's configuration: its bounds, and the one place a worker's environment is built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keepstep.agent.node.config import (
    AgentConfig,
    answer_bounds,
    dump_config,
    load_config,
    worker_env,
    worker_spec,
)
from keepstep.agent.protocol.link import AnswerBounds
from keepstep.errors import ConfigError


def config(**kw: object) -> AgentConfig:
    return AgentConfig(job="j", node="n0", etcd="127.0.0.1:2379", script="train.py", **kw)  # type: ignore[arg-type]


def test_the_job_settings_of_a_worker_come_from_one_function() -> None:
    env = worker_env(global_batch=64, micro_batch=4, steps=9, seed=5, mode="exact", host="10.0.0.7")
    assert env == {
        "KEEPSTEP_GLOBAL_BATCH": "64",
        "KEEPSTEP_MICRO_BATCH": "4",
        "KEEPSTEP_STEPS": "9",
        "KEEPSTEP_SEED": "5",
        "KEEPSTEP_MODE": "exact",
        "KEEPSTEP_HOST": "10.0.0.7",
    }
    extra = {"KEEPSTEP_HOST": "10.0.0.8", "X": "1"}
    later = worker_env(
        global_batch=64, micro_batch=4, steps=9, seed=5, mode="fast", host="h", extra=extra
    )
    assert later["KEEPSTEP_HOST"] == "10.0.0.8" and later["X"] == "1"  # extra comes last
    assert config(worker_env=env).global_batch == 64 and config().global_batch == 0


def test_a_worker_waits_longer_than_its_agent_for_each_answer(tmp_path: Path) -> None:
    cfg = config(nproc=2, admission_timeout=600.0, epoch_timeout=20.0, run_dir=tmp_path)
    bounds = answer_bounds(cfg)
    # The agent's answer, a typed error included, comes before the worker gives up on it.
    assert bounds.admission > cfg.admission_timeout + 3 * cfg.op_timeout
    assert bounds.decision > cfg.epoch_timeout + 3 * (cfg.probe_timeout + 2 * cfg.op_timeout)
    assert bounds.reply > 2 * cfg.op_timeout
    spec = worker_spec(cfg, "n0/1", "@keepstep/j/n0", tmp_path / "snap")
    assert AnswerBounds.from_env(spec.env) == bounds


def test_workers_start_with_deterministic_cublas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keepstep.elastic.rng import CUBLAS_WORKSPACE_CONFIG

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    spec = worker_spec(config(run_dir=tmp_path), "n0/0", "@keepstep/j/n0", tmp_path / "s")
    assert spec.env["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own choice wins
    spec = worker_spec(config(run_dir=tmp_path), "n0/0", "@keepstep/j/n0", tmp_path / "s")
    assert spec.env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_worker_is_told_the_checkpoint_it_resumes_from_and_only_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEPSTEP_RESUME", "/inherited/from/the/agent")
    cfg = config(run_dir=tmp_path)
    assert "KEEPSTEP_RESUME" not in worker_spec(cfg, "n0/0", "@j", tmp_path / "s").env
    spec = worker_spec(cfg, "n0/0", "@j", tmp_path / "s", tmp_path / "resume.ckpt")
    assert spec.env["KEEPSTEP_RESUME"] == str(tmp_path / "resume.ckpt")


def test_a_worker_is_told_the_checkpoint_cadence_when_there_are_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It holds each due step in its snapshot until the agent has read it.
    monkeypatch.setenv("KEEPSTEP_CHECKPOINT_EVERY", "3")  # inherited: not this job's
    url = (tmp_path / "ckpt").as_uri()

    def every(**kw: object) -> str | None:
        cfg = config(run_dir=tmp_path, steps=40, **kw)
        return worker_spec(cfg, "n0/0", "@j", tmp_path / "s").env.get("KEEPSTEP_CHECKPOINT_EVERY")

    assert every() is None
    assert every(checkpoint_url=url, checkpoint_every=8) == "8"
    assert every(checkpoint_url=url) == "40"  # the last step only


def test_each_worker_is_told_its_local_slot_like_torchrun(tmp_path: Path) -> None:
    cfg = config(nproc=4, run_dir=tmp_path)
    for slot in range(4):
        spec = worker_spec(cfg, f"n2/{slot}", "@keepstep/j/n2", tmp_path / f"s{slot}")
        assert spec.env["LOCAL_RANK"] == str(slot)
        assert spec.env["LOCAL_WORLD_SIZE"] == "4"
        assert "RANK" not in spec.env or spec.env["RANK"] == os.environ.get("RANK")


def test_every_bound_is_checked_and_travels_in_the_config_file(tmp_path: Path) -> None:
    for name in ("admission_timeout", "epoch_timeout", "probe_timeout", "op_timeout"):
        with pytest.raises(ConfigError, match=f"{name}=0 must be a number of seconds > 0"):
            config(**{name: 0})
    with pytest.raises(ConfigError, match="admission_grace=-1"):
        config(admission_grace=-1)
    cfg = config(admission_timeout=90.0, epoch_timeout=7.5, run_dir=tmp_path)
    dump_config(cfg, tmp_path / "agent.json")
    assert load_config(tmp_path / "agent.json") == cfg
