"""`keepstep run --backend ray` on a real local Ray cluster: a head and four raylets on
this machine, each raylet standing for a node (its own `keepstep-node` resource).

One cluster serves the module (starting one takes tens of seconds). Each run must end
with the parameters of the fault-free local run, every sample seen exactly once and the
global batch unchanged; the faults go through Ray: an agent's actor killed, a Ray node
removed (its raylet and every process on it), a raylet added that the job grows onto. The
cluster is stopped at the end and no process of it, or of any run, is left.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from keepstep.launch.local import LocalRun, agreed_sha, run_local
from keepstep.launch.run_config import RunConfig
from keepstep.raylaunch.cli import run
from keepstep.raylaunch.config import RayConfig, RayFault, RayFaultKind

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "examples" / "mlp.py")
STEPS, GB, MB = 24, 48, 4
NODE = "keepstep-node"  # each worker raylet has one: one agent per raylet
RAYLETS = 4  # three for the job, one spare that a replacement can land on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def processes_with(marker: str) -> list[int]:
    """Processes (not this one) whose command line names `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def ray_processes(session: str) -> set[int]:
    """Ray's processes: those naming the session (gcs, raylets, monitors) and those Ray
    renamed (`ray::NodeActor`, `ray::IDLE`, its agents)."""
    renamed = set(processes_with("ray::"))
    return renamed | set(processes_with(session)) if session else renamed


def wait_none(marker: str, timeout: float = 30.0) -> list[int]:
    """Wait (bounded) until no process names `marker`; returns those still there."""
    deadline = time.monotonic() + timeout
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


class LocalRay:
    """The module's Ray cluster and a way to remove one of its raylets by node id."""

    def __init__(self) -> None:
        # A raylet added while the machine is loaded may take seconds to answer Ray's
        # health checks; Ray's defaults (first check 5 s after it registers, 5 misses 3 s
        # apart) then mark it dead with its actor, a loss keepstep did not cause. A raylet
        # killed by `remove` refuses the checks at once, so it is found as soon as before.
        system = {"health_check_initial_delay_ms": 30_000, "health_check_timeout_ms": 30_000}
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": system},
        )
        self.nodes: dict[str, Any] = {}
        for _ in range(RAYLETS):
            self.add()
        ray.init(address=self.cluster.address, include_dashboard=False, log_to_driver=False)
        assert self.cluster.head_node is not None
        self.session: str = Path(self.cluster.head_node.get_session_dir_path()).name

    def add(self) -> None:
        node = self.cluster.add_node(num_cpus=1, resources={NODE: 1})
        self.nodes[node.node_id] = node

    def remove(self, node_id: str) -> None:
        self.cluster.remove_node(self.nodes.pop(node_id))

    def close(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[LocalRay]:
    before = frozenset(ray_processes(""))  # another Ray on this machine is not ours
    cluster = LocalRay()
    try:
        yield cluster
    finally:
        cluster.close()
    deadline = time.monotonic() + 30.0
    while (left := ray_processes(cluster.session) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"Ray processes left after the cluster stopped: {sorted(left)}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    result = run_local(
        LocalRun(
            script=MLP, steps=STEPS, global_batch=GB, micro_batch=MB, schedule=[["m0"]], seed=3
        ),
        tmp_path_factory.mktemp("reference"),
    )
    return agreed_sha(result)


def ray_run(
    tmp: Path,
    etcd_binary: str,
    local_ray: LocalRay,
    *faults: RayFault,
    sleep: float = 0.0,
    nodes: int = 3,
) -> dict[str, Any]:
    cfg = RunConfig(
        script=MLP,
        script_args=("--sleep", str(sleep)),
        nodes=nodes,
        min_nodes=2,
        admission_grace=150,  # every node from the first step, however loaded the machine
        global_batch=GB,
        micro_batch=MB,
        steps=STEPS,
        seed=3,
        run_dir=tmp / "run",
        etcd_binary=etcd_binary,
        timeout=200,
    )
    ray_cfg = RayConfig(bundle={NODE: 1}, faults=faults)
    return run(cfg, ray_cfg, io.StringIO(), remove_node=local_ray.remove, add_node=local_ray.add)


def check(summary: dict[str, Any], reference: str, tmp: Path) -> None:
    assert summary["failures"] == []
    # A node lost without a fault says how (its actor's state and why, the launcher's notes).
    assert summary["ray"]["lost_without_fault"] == [], summary["ray"]
    assert summary["params_sha256"] == reference
    assert summary["steps"] == STEPS
    samples = summary["samples"]
    assert samples["lost"] == 0 and samples["duplicated"] == 0
    assert samples["seen_once"] == samples["expected"] == STEPS * GB
    assert summary["global_batch"] == GB
    # Every agent and worker of the run is gone (their command lines name the run dir).
    assert wait_none(str(tmp / "run")) == []


def test_fault_free_ray_run_matches_one_process(
    local_ray: LocalRay, etcd_binary: str, reference: str, tmp_path: Path
) -> None:
    keepers = set(Path(tempfile.gettempdir()).glob("keepstep-ray-*"))
    summary = ray_run(tmp_path, etcd_binary, local_ray)
    check(summary, reference, tmp_path)
    # Each actor removed its keeper's folder (status and pid files) when it stopped.
    assert set(Path(tempfile.gettempdir()).glob("keepstep-ray-*")) <= keepers
    assert summary["world_size_by_step"] == [3] * STEPS
    assert summary["agent_exit_codes"] == {"n0": 0, "n1": 0, "n2": 0}
    placed = {n["ray_node"] for n in summary["ray"]["nodes"].values()}
    assert len(placed) == 3 and placed <= set(local_ray.nodes)  # three distinct raylets


def test_killed_actor_is_replaced_and_the_numbers_hold(
    local_ray: LocalRay, etcd_binary: str, reference: str, tmp_path: Path
) -> None:
    kill = RayFault(RayFaultKind.KILL_ACTOR, node=1, step=6)
    summary = ray_run(tmp_path, etcd_binary, local_ray, kill, sleep=0.02)
    check(summary, reference, tmp_path)
    first = summary["recoveries"][0]
    assert (first["cause"], first["node"], first["step"]) == ("kill-node", "n1", 6)
    assert 2 in summary["world_size_by_step"]
    nodes = summary["ray"]["nodes"]
    assert nodes["n1"]["state"] == "lost" and nodes["n1"]["replaced_by"] == "n3"
    assert nodes["n3"]["bundle"] == nodes["n1"]["bundle"]
    assert summary["ray"]["lost_without_fault"] == []


def test_removed_ray_node_is_survived(
    local_ray: LocalRay, etcd_binary: str, reference: str, tmp_path: Path
) -> None:
    remove = RayFault(RayFaultKind.REMOVE_NODE, node=2, step=6)
    try:
        summary = ray_run(tmp_path, etcd_binary, local_ray, remove, sleep=0.02)
    finally:
        while len(local_ray.nodes) < RAYLETS:  # what later tests would find
            local_ray.add()
    check(summary, reference, tmp_path)
    first = summary["recoveries"][0]
    assert (first["cause"], first["node"], first["step"]) == ("kill-node", "n2", 6)
    nodes = summary["ray"]["nodes"]
    lost = nodes["n2"]["ray_node"]
    assert lost not in local_ray.nodes  # that raylet is gone
    # Its bundle was placed again on the spare raylet, and a new actor asked for there.
    assert nodes["n3"]["bundle"] == nodes["n2"]["bundle"]
    assert nodes["n3"]["ray_node"] not in ("", lost)


def test_an_added_raylet_grows_the_job(
    local_ray: LocalRay, etcd_binary: str, reference: str, tmp_path: Path
) -> None:
    """Room for four nodes (--nnodes 2:4) on three raylets: the job starts on three; a
    raylet added at step 2 gets a fourth agent, admitted at a step boundary."""
    local_ray.remove(next(iter(local_ray.nodes)))
    local_ray.cluster.wait_for_nodes()
    before = set(local_ray.nodes)
    add = RayFault(RayFaultKind.ADD_NODE, None, 2)
    try:
        summary = ray_run(tmp_path, etcd_binary, local_ray, add, sleep=0.25, nodes=4)
    finally:
        while len(local_ray.nodes) < RAYLETS:
            local_ray.add()
    check(summary, reference, tmp_path)
    world = summary["world_size_by_step"]
    # Three raylets: never more than three members before the fourth was added (fewer
    # when the machine is slow to start them), four at the end.
    assert max(world[:3]) <= 3 and world[-1] == 4, world
    join = [r for r in summary["recoveries"] if r["cause"] == "join-node"]
    assert [(r["node"], r["rolled_back_steps"]) for r in join] == [("n3", 0)], summary["recoveries"]
    nodes = summary["ray"]["nodes"]
    assert nodes["n3"]["ray_node"] not in before  # on the raylet added mid-run
    assert summary["agent_exit_codes"] == {f"n{i}": 0 for i in range(4)}, summary["ray"]
    assert summary["faults"][0]["node"] == "n3"
