"""`keepstep chaos run --target ray`: the chaos harness's Ray target.

The fast tests check what each scenario fault becomes on Ray, and which kinds the target
skips and why. The slow one runs e2e/scenarios/ray-small.yaml through the target on the
local Ray cluster it starts (a raylet added, a worker and an actor killed, a Ray node
removed), against the local target's fault-free run, and requires every invariant of the
harness, the world grown onto the added raylet, and no process of the cluster left once
it is stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keepstep.chaos.local import LocalTarget
from keepstep.chaos.model import Fault, FaultKind, Job, Trigger
from keepstep.chaos.runner import run_scenario, summarize
from keepstep.chaos.scenario import load_scenario
from keepstep.chaos.schedule import RunPlan
from keepstep.cli import build_parser
from keepstep.errors import ConfigError
from keepstep.launch.faults import parse_fault
from keepstep.launch.run_config import RunConfig
from keepstep.raylaunch.chaos_target import BY_STEP_ONLY, UNSUPPORTED, RayTarget, map_faults
from keepstep.raylaunch.cli import ray_faults
from keepstep.raylaunch.config import RayConfig, RayFault, RayFaultKind
from keepstep.raylaunch.faults import RayFaultInjector

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "e2e" / "scenarios" / "ray-small.yaml"
JOB = Job(
    script=str(REPO / "examples" / "mlp.py"), nodes=3, global_batch=48, micro_batch=4, steps=60
)


def plan(*faults: Fault) -> RunPlan:
    return RunPlan(0, 0, faults)


def test_scenario_faults_become_ray_faults() -> None:
    mapped = map_faults(
        plan(
            Fault(FaultKind.JOIN_NODE, Trigger(step=2)),
            Fault(FaultKind.KILL_NODE, Trigger(step=9), node=1),
            Fault(FaultKind.KILL_NODE, Trigger(step=12), node=2, method="ray-node"),
            Fault(FaultKind.KILL_WORKER, Trigger(step=20), node=0),
        )
    )
    assert mapped.faults == (
        RayFault(RayFaultKind.ADD_NODE, None, 2),
        RayFault(RayFaultKind.KILL_ACTOR, 1, 9),
        RayFault(RayFaultKind.REMOVE_NODE, 2, 12),
        RayFault(RayFaultKind.KILL_WORKER, 0, 20),
    )
    assert mapped.joins == 1
    assert [r.skipped for r in mapped.records] == [None] * 4
    assert [r.kind for r in mapped.records] == [
        "join-node",
        "kill-node",
        "kill-node",
        "kill-worker",
    ]
    # The job may grow by one node: --nnodes 3:4, started on three raylets.
    cfg = RayTarget("etcd").run_config(JOB, mapped.joins, Path("run"))
    assert (cfg.nodes, cfg.min_nodes) == (4, 1)


def test_what_ray_cannot_apply_is_skipped_with_the_reason() -> None:
    mapped = map_faults(
        plan(
            Fault(FaultKind.HANG_NODE, Trigger(step=5), node=1),
            Fault(FaultKind.KILL_NODE, Trigger(time=3.0), node=1),
            Fault(FaultKind.KILL_WORKER, Trigger(during_recovery_of=0), node=2),
        )
    )
    assert mapped.faults == () and mapped.joins == 0
    skipped = [r.skipped for r in mapped.records]
    assert skipped == [UNSUPPORTED[FaultKind.HANG_NODE], BY_STEP_ONLY, BY_STEP_ONLY]
    # Every kind is either applied through Ray or reported as a skip.
    applied = {FaultKind.KILL_NODE, FaultKind.KILL_WORKER, FaultKind.JOIN_NODE}
    assert set(RayTarget("etcd").unsupported()) == set(FaultKind) - applied
    assert map_faults(None).records == ()


def test_the_chaos_command_offers_the_ray_target() -> None:
    args = build_parser().parse_args(["chaos", "run", str(SCENARIO), "--target", "ray"])
    assert args.target == "ray"
    scenario = load_scenario(SCENARIO)
    kinds = {f.kind for f in scenario.faults}
    assert kinds == {FaultKind.KILL_NODE, FaultKind.KILL_WORKER, FaultKind.JOIN_NODE}
    assert [f.method for f in scenario.faults if f.kind is FaultKind.KILL_NODE] == [
        None,
        "ray-node",
    ]


def test_ray_faults_that_add_a_node_name_none() -> None:
    assert str(RayFault(RayFaultKind.ADD_NODE, None, 2)) == "add-node@step=2"
    assert str(RayFault(RayFaultKind.KILL_WORKER, 0, 5)) == "kill-worker:0@step=5"
    with pytest.raises(ConfigError, match="takes no node"):
        RayFault(RayFaultKind.ADD_NODE, 1, 2)
    with pytest.raises(ConfigError, match="node None"):
        RayFault(RayFaultKind.KILL_WORKER, None, 2)
    twice = RayFault(RayFaultKind.ADD_NODE, None, 2)
    assert RayConfig(faults=(twice, twice)).faults == (twice, twice)  # two joins at one step
    cfg = RunConfig(
        script=JOB.script, script_args=(), nodes=3, global_batch=48, micro_batch=4, steps=20,
        run_dir=Path("run"), etcd_binary="etcd", faults=(parse_fault("kill-worker:1@step=4"),),
    )  # fmt: skip
    assert ray_faults(cfg) == (RayFault(RayFaultKind.KILL_WORKER, 1, 4),)


def test_an_added_ray_node_is_named_by_the_node_grown_onto_it() -> None:
    added: list[str] = []
    injector = RayFaultInjector(
        [RayFault(RayFaultKind.ADD_NODE, None, 3)], {}, None, added.append,
        add_node=lambda: added.append("raylet"),
    )  # fmt: skip
    injector.on_progress(2)
    assert added == [] and injector.log == []
    injector.on_progress(3)  # no gates armed: due once the step is seen
    assert added[-1] == "raylet"  # started once the job goes on, after the record
    (entry,) = injector.log
    assert (entry["kind"], entry["ray"], entry["node"], entry["step"]) == (
        "join-node", "add-node", None, 3,
    )  # fmt: skip
    injector.grown("n3")
    injector.grown("n4")  # a second growth: no added node left to name
    assert entry["node"] == "n3"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ray_small_keeps_every_invariant(etcd_binary: str, tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIO)
    target = RayTarget(etcd_binary)
    try:
        result = run_scenario(
            scenario, target, tmp_path / "runs", say=print, reference_target=LocalTarget()
        )
    finally:
        left = target.close()
    assert left == [], left  # no process of the Ray cluster once it is stopped
    (only,) = result.runs
    assert only.verdict.passed and not only.verdict.violations, only.verdict.violations
    data = json.loads(json.dumps(summarize(result), default=str))
    assert data["passed"] and data["target"] == "ray"
    faults = only.outcome.seen.faults
    assert len(faults) == 4 and all(f["t"] is not None for f in faults), faults
    for fault in faults:  # each landed at its step, the job held at that boundary
        assert fault["step"] == fault["scheduled_step"] and fault["held"], fault
    summary = only.outcome.summary
    assert summary is not None
    # The job started on three raylets and grew onto the one added at step 2: the epoch
    # that admitted its node grew by what it admitted less what it removed (when, depends
    # on how fast the machine starts a node; a loss may come first, and a node restarted
    # after it may be admitted in the same epoch).
    joined = faults[0]["node"]
    assert any(r["cause"] == "join-node" and r["node"] == joined for r in summary["recoveries"])
    epochs = sorted(
        (e for e in only.outcome.events if e["kind"] == "epoch-agreed"), key=lambda e: e["epoch"]
    )
    sizes = {e["epoch"]: len(e["members"]) for e in epochs}
    grew = [e for e in epochs if f"{joined}/0" in (e.get("admitted") or [])]
    assert grew, epochs
    change = len(grew[0]["admitted"]) - len(grew[0].get("removed") or ())
    assert change > 0 and sizes[grew[0]["epoch"]] == sizes[grew[0]["epoch"] - 1] + change, epochs
    nodes = summary["ray"]["nodes"]
    assert nodes["n1"]["state"] == "lost" and nodes["n2"]["state"] == "lost"
    assert nodes["n2"]["ray_node"] not in {n["ray_node"] for k, n in nodes.items() if k != "n2"}
    assert summary["ray"]["lost_without_fault"] == []
    print(json.dumps(data["by_kind"], indent=1))
    print(json.dumps(data["recoveries"], indent=1))
