"""The Ray backend's pure parts: the replacement decision, its settings, its flags.
No Ray cluster: these run in the fast suite."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from keepstep.errors import ConfigError
from keepstep.launch.faults import parse_fault
from keepstep.launch.run_config import RunConfig
from keepstep.raylaunch.cli import add_arguments, ray_config, ray_faults
from keepstep.raylaunch.config import RayConfig, RayFault, RayFaultKind, parse_resource
from keepstep.raylaunch.nodes import NodeSlot, SlotState, growth, replacements

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")


def slot(name: str, state: SlotState, bundle: int = 0, replaced_by: str = "") -> NodeSlot:
    return NodeSlot(
        name=name, group=None, bundle=bundle, actor=None, state=state, why="ActorDiedError",
        replaced_by=replaced_by,
    )  # fmt: skip


def test_a_lost_node_is_replaced_in_its_bundle() -> None:
    slots = [slot("n0", SlotState.RUNNING, 0), slot("n1", SlotState.LOST, 1)]
    chosen, reason = replacements(slots, max_nodes=2, replace=True, job_finished=False)
    assert [(c.bundle, c.replaces) for c in chosen] == [(1, "n1")]
    assert reason == "replacing n1"


def test_no_replacement_once_replaced_finished_or_off() -> None:
    replaced = [slot("n0", SlotState.LOST, replaced_by="n2"), slot("n2", SlotState.PLACING)]
    assert replacements(replaced, max_nodes=2, replace=True, job_finished=False) == (
        [],
        "no lost node",
    )
    lost = [slot("n0", SlotState.LOST), slot("n1", SlotState.RUNNING, 1)]
    assert replacements(lost, max_nodes=2, replace=True, job_finished=True) == (
        [],
        "the job has finished",
    )
    assert replacements(lost, max_nodes=2, replace=False, job_finished=False) == (
        [],
        "replacing is off",
    )


def test_max_nodes_bounds_the_replacements() -> None:
    slots = [
        slot("n0", SlotState.RUNNING, 0),
        slot("n1", SlotState.LOST, 1),
        slot("n2", SlotState.LOST, 2),
        slot("n3", SlotState.RUNNING, 3),
    ]
    chosen, reason = replacements(slots, max_nodes=3, replace=True, job_finished=False)
    assert [c.replaces for c in chosen] == ["n1"]
    assert reason == "1 lost nodes not replaced: at --max-nodes 3"


def test_growth_up_to_max_nodes_on_free_ray_nodes() -> None:
    two = [slot("n0", SlotState.RUNNING), slot("n1", SlotState.RUNNING, 1)]
    grow = {"spread_by_resource": True, "job_finished": False}
    assert growth(two, free_nodes=3, max_nodes=4, **grow) == (
        2,
        "3 free Ray nodes, room for 2 more",
    )
    assert growth(two, free_nodes=0, max_nodes=4, **grow) == (0, "no free Ray node")
    assert growth(two, free_nodes=2, max_nodes=2, **grow) == (0, "at --max-nodes 2")
    placing = [*two, slot("n2", SlotState.PLACING, 2)]
    assert growth(placing, free_nodes=2, max_nodes=4, **grow) == (
        0,
        "a node is still being placed",
    )
    count, reason = growth(
        two, free_nodes=2, max_nodes=4, spread_by_resource=False, job_finished=False
    )
    assert count == 0 and "per-node resource" in reason
    done = growth(two, free_nodes=2, max_nodes=4, spread_by_resource=True, job_finished=True)
    assert done == (0, "the job has finished")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bundle": {}}, "at least one resource"),
        ({"bundle": {"CPU": 0}}, "CPU=0"),
        ({"etcd": "localhost"}, "HOST:PORT"),
        ({"etcd_tls": Path("x")}, "--etcd-tls is for an etcd given with --etcd"),
        ({"place_timeout": 0}, "place_timeout 0"),
        ({"address": " "}, "names no Ray cluster"),
    ],
)
def test_ray_config_names_the_bad_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RayConfig(**kwargs)  # type: ignore[arg-type]


def test_ray_fault_is_checked() -> None:
    assert str(RayFault(RayFaultKind.REMOVE_NODE, 2, 6)) == "remove-node:2@step=6"
    with pytest.raises(ConfigError, match="step 0"):
        RayFault(RayFaultKind.KILL_ACTOR, 1, 0)
    with pytest.raises(ConfigError, match="kind 'kill'"):
        RayFault("kill", 1, 3)  # type: ignore[arg-type]


def test_resources_and_flags() -> None:
    assert parse_resource("keepstep-node") == ("keepstep-node", 1.0)
    assert parse_resource("GPU=2") == ("GPU", 2.0)
    with pytest.raises(ConfigError, match="NAME=AMOUNT"):
        parse_resource("GPU=many")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--backend", "ray", "--address", "auto", "--ray-resource", "node=1", "--no-replace"]
    )
    cfg = ray_config(args)
    assert (cfg.address, dict(cfg.bundle), cfg.replace) == ("auto", {"node": 1.0}, False)
    assert ray_config(parser.parse_args([])).bundle == {"CPU": 1.0}


def test_only_kill_node_faults_map_to_ray(tmp_path: Path) -> None:
    def run_config(*faults: str) -> RunConfig:
        return RunConfig(
            script=MLP, script_args=(), nodes=3, global_batch=48, micro_batch=4, steps=10,
            run_dir=tmp_path, etcd_binary="etcd", faults=tuple(map(parse_fault, faults)),
        )  # fmt: skip

    assert ray_faults(run_config("kill-node:1@step=4")) == (
        RayFault(RayFaultKind.KILL_ACTOR, 1, 4),
    )
    with pytest.raises(ConfigError, match="only kill-node"):
        ray_faults(run_config("hang-node:1@step=4"))
