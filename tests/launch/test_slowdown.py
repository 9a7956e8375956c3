"""The launcher's slow-node fault on `sleep` processes standing in for nodes.

- A slowdown by signal stops the node's process group part of the time and is lifted at
  its duration (`tick`) or at the end of the run (`lift_all`), leaving the node running.
- Where a cgroup can be made (root, a cpu controller), the node's processes sit in a group
  with the quota the factor says, and go back to their own group when it is lifted.
- A kill or hang that lands on a slowed node lifts the slowdown first: the duty cycle's
  SIGCONT would otherwise undo the hang.
- `--balance` reaches the workers as KEEPSTEP_BALANCE, and only when it is on.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.cli import build_parser
from keepstep.elastic.config import Balance
from keepstep.errors import ConfigError
from keepstep.launch import cgroups
from keepstep.launch.cli import run_config
from keepstep.launch.faults import parse_fault
from keepstep.launch.injector import FaultInjector
from keepstep.launch.run_config import RunConfig
from keepstep.launch.slowdown import group_pids, slow_down

T = 5.0
MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")


@pytest.fixture
def node() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(T)


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def ever_stopped(pid: int, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if state(pid) == "T":
            return True
        time.sleep(0.005)
    return False


def injector(faults: list[str], node: subprocess.Popen[bytes]) -> FaultInjector:
    notes: list[str] = []
    return FaultInjector(
        [parse_fault(f) for f in faults], 1, {"n0": node}, lambda _: None, set(), notes.append
    )


def test_a_signal_slowdown_lasts_its_duration(node: subprocess.Popen[bytes]) -> None:
    inj = injector(["slow-node:0@step=2:factor=4,duration=30,method=signal"], node)
    inj.on_progress(2)  # no gates armed: the fault lands when its step is seen
    (record,) = inj.log
    assert record["kind"] == "slow-node" and record["node"] == "n0" and record["step"] == 2
    assert record["method"] == "signal" and record["cpu_share"] == 0.25
    assert record["factor"] == 4.0 and record["duration"] == 30.0
    assert "lifted_t" not in record
    assert ever_stopped(node.pid)
    inj.tick(time.monotonic() + 1.0)  # not over yet
    assert len(inj.slowed) == 1
    inj.tick(time.monotonic() + 31.0)
    assert inj.slowed == [] and record["lifted_t"] >= record["t"]
    assert not ever_stopped(node.pid, within=0.5)
    assert node.poll() is None


def test_the_end_of_the_run_lifts_a_slowdown_without_a_duration(
    node: subprocess.Popen[bytes],
) -> None:
    inj = injector(["slow-node:0@step=1:factor=2,method=signal"], node)
    inj.on_progress(1)
    inj.tick(time.monotonic() + 1e6)  # no duration: only the end lifts it
    assert len(inj.slowed) == 1
    inj.lift_all()
    assert inj.slowed == [] and "lifted_t" in inj.log[0]
    assert not ever_stopped(node.pid, within=0.5)


def test_a_hang_on_a_slowed_node_stays_a_hang(node: subprocess.Popen[bytes]) -> None:
    inj = injector(["slow-node:0@step=1:factor=4,method=signal", "hang-node:0@step=2"], node)
    inj.on_progress(1)
    inj.on_progress(2)
    assert inj.slowed == [] and "lifted_t" in inj.log[0]
    time.sleep(0.5)  # a duty cycle still running would have sent SIGCONT by now
    assert state(node.pid) == "T" and inj.stopped == {"n0"}


@pytest.mark.skipif(cgroups.available("cpu") is not None, reason="no cpu cgroup here")
def test_a_cgroup_slowdown_holds_the_node_in_a_quota(node: subprocess.Popen[bytes]) -> None:
    slowed = slow_down(node.pid, 0.25, "cgroup", f"{cgroups.PREFIX}test-{node.pid}")
    group = slowed.action.group  # type: ignore[attr-defined]
    try:
        assert slowed.detail == {"cpu_share": 0.25, "method": "cgroup"}
        assert group.pids() == group_pids(node.pid) == [node.pid]
        quota = (
            (group.path / "cpu.cfs_quota_us").read_text().strip()
            if group.version == 1
            else (group.path / "cpu.max").read_text().split()[0]
        )
        assert int(quota) == 25_000
    finally:
        slowed.action.end()
    assert not group.path.exists()
    assert node.poll() is None


def test_slow_down_refuses_what_it_cannot_do(node: subprocess.Popen[bytes]) -> None:
    with pytest.raises(ValueError, match=r"share 1\.5 must be in"):
        slow_down(node.pid, 1.5, "auto", f"{cgroups.PREFIX}x")
    with pytest.raises(ValueError, match="method 'freezer'"):
        slow_down(node.pid, 0.5, "freezer", f"{cgroups.PREFIX}x")


def test_balance_reaches_the_workers_only_when_on(tmp_path: Path) -> None:
    def cfg(**kw: str) -> RunConfig:
        return RunConfig(
            script=MLP, script_args=(), nodes=2, global_batch=8, micro_batch=4, steps=3,
            run_dir=tmp_path, etcd_binary="etcd", **kw,
        )  # fmt: skip

    assert cfg().balance_env() == {}
    env = cfg(balance="speed").balance_env()
    assert Balance(env["KEEPSTEP_BALANCE"]) is Balance.SPEED  # what keepstep.init reads
    with pytest.raises(ConfigError, match="balance 'fastest'; allowed: off, speed"):
        cfg(balance="fastest")


def test_the_balance_flag(etcd_binary: str, tmp_path: Path) -> None:
    def parsed(*flags: str) -> RunConfig:
        argv = ["run", "--nnodes", "2", "--global-batch", "8", "--micro-batch", "4"]
        argv += ["--steps", "3", "--run-dir", str(tmp_path), *flags, MLP]
        env = {"KEEPSTEP_ETCD_BIN": etcd_binary, "CUDA_VISIBLE_DEVICES": ""}
        return run_config(build_parser().parse_args(argv), env)

    assert parsed().balance == "off"
    on = parsed("--balance", "--fault", "slow-node:1@step=1:factor=3,duration=5")
    assert on.balance == "speed" and str(on.faults[0]) == "slow-node:1@step=1:factor=3,duration=5"


def test_the_launcher_knows_the_librarys_balance_modes() -> None:
    from keepstep.elastic.config import Balance
    from keepstep.launch.run_config import BALANCES

    assert BALANCES == tuple(b.value for b in Balance)
