"""The run summary: the JSON contract other tools and checks read.

Built from the nodes' event logs and the launcher's fault log. A step may be committed
more than once (members that committed it before a failure rolled back and redid it);
only its commits in the newest epoch count, so the ledger shows what the final
parameters were trained on: every micro-batch of every step exactly once, and the values
`step.log` recorded (`metrics`, one per step and name) are those of the steps that stand.
Its recoveries are the one fold of the event logs (`keepstep.agent.protocol.recovery`),
given the launcher's faults so that each is timed from the fault injected. `faults` is the
launcher's fault log (`launch.injector`): each fault's `scheduled_step` and `step`, the
steps committed when it landed; `fault_step_error_max` is the largest difference (0: every
fault landed at its step; None: no step-scheduled fault landed). `fallbacks` lists the
epochs that resumed from the durable checkpoint after a double fault lost sharded state;
the steps they trained again count once, in their newest commits, like any rollback.

`micro_batches_by_step` says how many micro-batches each member computed at each step that
stands, run-length encoded, since the plan changes rarely: a list, in step order, of
`{"steps": [first, last], "counts": {member: micro-batches}}`, one entry per run of
consecutive steps with the same counts (`micro_batches_at` reads it back for one step).
A member with fewer than the others on a run without a membership change was planned
fewer by measured speed (`keepstep run --balance`); `weight_changes` lists those replans
from the agents' "weights-changed" events (`protocol.weights`): epoch, step (the new
weights apply from step + 1), old, new, counts.

`run_failures` is the run's verdict, the one `keepstep run`'s exit status follows: the
job trained every step, its workers agree on the parameters, and every agent exited 0
(an agent also fails the run after training, when its durable checkpoint failed), except
the nodes a fault killed or stopped on purpose.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from keepstep.agent.node.supervisor import describe_exit
from keepstep.agent.protocol import node_of
from keepstep.agent.protocol.events import EventKind
from keepstep.agent.protocol.recovery import Effect, InjectedFault, recoveries
from keepstep.launch.faults import FaultKind


def build_summary(
    events: Sequence[dict[str, Any]],
    faults: Sequence[dict[str, Any]],
    *,
    steps: int,
    global_batch: int,
    micro_batch: int,
    start_step: int = 0,
) -> dict[str, Any]:
    """`start_step` > 0 for a job resumed from a durable checkpoint: the steps before it
    are accounted for by the run that wrote the checkpoint.

    `metrics`: each name `step.log` recorded, one value per step (None where the step
    logged nothing); `skipped_steps`: steps committed without an optimizer step (a
    grad_scaler found inf or nan in the reduced gradient)."""
    n_micro = global_batch // micro_batch
    commits = [e for e in events if e["kind"] == EventKind.COMMIT]
    standing = standing_commits(commits)
    final = [c for c in commits if c["epoch"] == standing[c["step"]]["epoch"]]

    world: dict[int, int] = {}
    seen: dict[tuple[int, int], int] = defaultdict(int)
    counted: set[int] = set()
    mismatches: list[str] = []
    for c in final:
        world[c["step"]] = c["world_size"]
        # A member's own micro-batches must be what the epoch's plan gave it.
        if list(c["micro_batches"]) != list(c["assignment"].get(c["member"], [])):
            mismatches.append(
                f"step {c['step']}: {c['member']} computed {c['micro_batches']}, "
                f"planned {c['assignment'].get(c['member'])}"
            )
        if c["step"] in counted:
            continue
        counted.add(c["step"])
        for ids in c["assignment"].values():
            for mb in ids:
                seen[(c["step"], mb)] += 1
    slots = {(s, mb) for s in range(start_step, steps) for mb in range(n_micro)}
    once = sum(1 for slot in slots if seen.get(slot) == 1)
    duplicated = sum(n - 1 for n in seen.values() if n > 1)
    lost = sum(1 for slot in slots if slot not in seen)

    shas = sorted({e["params_sha256"] for e in events if e["kind"] == EventKind.FINISH})
    finished = [e["done"] for e in events if e["kind"] == EventKind.FINISH]
    records = _recoveries(events, faults)
    mttrs = [r["mttr_s"] for r in records if r["mttr_s"] is not None]
    return {
        "params_sha256": shas[0] if len(shas) == 1 else None,
        "params_sha256_disagree": shas if len(shas) > 1 else [],
        "steps": max(finished, default=0),  # what the workers that finished had trained
        "committed_steps": max(standing, default=start_step - 1) + 1,  # finished or not
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "start_step": start_step,
        "world_size_by_step": [world.get(s, 0) for s in range(steps)],
        "metrics": {
            name: [values.get(s) for s in range(steps)]
            for name, values in logged_metrics(standing).items()
        },
        "skipped_steps": sorted(s for s, c in standing.items() if c.get("skipped")),
        "micro_batches_by_step": micro_batches_by_step(standing),
        "weight_changes": weight_changes(events),
        "slow_drains": slow_drains(events),
        "fallbacks": fallbacks(events),
        "joins_unused": joins_unused(faults, standing),
        "recoveries": records,
        "mttr_p50_s": statistics.median(mttrs) if mttrs else None,
        "samples": {
            "expected": len(slots) * micro_batch,
            "seen_once": once * micro_batch,
            "lost": lost * micro_batch,
            "duplicated": duplicated * micro_batch,
            "plan_mismatches": mismatches,
        },
        "faults": list(faults),
        "fault_step_error_max": fault_step_error(faults),
    }


def joins_unused(
    faults: Sequence[Mapping[str, Any]], standing: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The nodes a join fault started that trained no standing step: the job ended (or went
    on without them) before they were admitted. `{"node", "step"}` each, `step` the one
    the join was injected at."""
    trained = {node_of(m) for c in standing.values() for m in c.get("assignment") or {}}
    return [
        {"node": f["node"], "step": f.get("step")}
        for f in faults
        if f.get("kind") == FaultKind.JOIN_NODE.value
        and f.get("t") is not None
        and f.get("node") not in trained
    ]


def micro_batches_by_step(
    standing: Mapping[int, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Each standing step's micro-batch count per member (its plan), run-length encoded:
    `[{"steps": [first, last], "counts": {member: n}}, ...]` in step order; a new run
    starts where the counts change or a step is missing."""
    spans: list[dict[str, Any]] = []
    for step in sorted(standing):
        plan = standing[step].get("assignment") or {}
        counts = {str(m): len(ids) for m, ids in sorted(plan.items())}
        last = spans[-1] if spans else None
        if last is not None and last["steps"][1] == step - 1 and last["counts"] == counts:
            last["steps"][1] = step
        else:
            spans.append({"steps": [step, step], "counts": counts})
    return spans


def micro_batches_at(spans: Iterable[Mapping[str, Any]], step: int) -> dict[str, int] | None:
    """The counts per member at `step` from a summary's `micro_batches_by_step` (None: the
    step did not stand, or is before the run's start)."""
    for span in spans:
        first, last = span["steps"]
        if first <= step <= last:
            return {str(m): int(n) for m, n in span["counts"].items()}
    return None


def slow_drains(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The agents' "drain-slow" events (`node/slow_drain`), in time order: member, node,
    epoch, step, ratio (its speed / the median), drained (false: refused), reason."""
    names = ("member", "node", "epoch", "step", "ratio", "drained", "reason")
    return [
        {name: e.get(name) for name in names} for e in events if e["kind"] == EventKind.DRAIN_SLOW
    ]


def fallbacks(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The epochs that resumed every member from the durable checkpoint because a double
    fault lost sharded state with every holder (`node/fallback`), in epoch order: epoch,
    the checkpoint's step, the steps committed before (`step`), so `rerun_steps` trained
    again, and the reason."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == EventKind.EPOCH_AGREED and e.get("checkpoint_step") is not None:
            ckpt, done = int(e["checkpoint_step"]), int(e.get("step") or 0)
            out.setdefault(
                int(e["epoch"]),
                {
                    "epoch": int(e["epoch"]),
                    "checkpoint_step": ckpt,
                    "step": done,
                    "rerun_steps": max(done - ckpt, 0),
                    "reason": e.get("reason", ""),
                },
            )
    return [out[k] for k in sorted(out)]


def weight_changes(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The plan's replans from measured speed, by (epoch, step): one per change even if a
    log holds it twice. A replan in an epoch that a later one rolled back stays listed:
    it was in force while that epoch trained."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        if e["kind"] == EventKind.WEIGHTS_CHANGED:
            at = (int(e["epoch"]), int(e["step"]))
            out.setdefault(
                at,
                {name: e.get(name) for name in ("epoch", "step", "old", "new", "counts")},
            )
    return [out[at] for at in sorted(out)]


def fault_step_error(faults: Iterable[Mapping[str, Any]]) -> int | None:
    """How many steps late the latest step-scheduled fault landed (None: none landed)."""
    errors = [
        int(f["step"]) - int(f["scheduled_step"])
        for f in faults
        if f.get("t") is not None and f.get("scheduled_step") is not None
    ]
    return max(errors, default=None)


def standing_commits(events: Iterable[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """Each committed step's commit that stands: one of those in the newest epoch that
    committed it (every member of an epoch records the same step, metrics and outcome).
    An earlier epoch's commit of the step was rolled back and redone."""
    out: dict[int, Mapping[str, Any]] = {}
    for e in events:
        if e["kind"] != EventKind.COMMIT:
            continue
        step = int(e["step"])
        if step not in out or int(e["epoch"]) > int(out[step]["epoch"]):
            out[step] = e
    return out


def logged_metrics(standing: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[int, float]]:
    """What `step.log` recorded, by name (sorted) and step, from the standing commits; a
    step that logged nothing (or a log written before commits carried metrics) has none."""
    out: dict[str, dict[int, float]] = {}
    for step in sorted(standing):
        for name, value in (standing[step].get("metrics") or {}).items():
            out.setdefault(str(name), {})[step] = float(value)
    return dict(sorted(out.items()))


_LOSES_NOBODY = frozenset(k.value for k in FaultKind if not k.changes_membership)
_EFFECTS = {FaultKind.JOIN_NODE.value: Effect.JOIN, FaultKind.DRAIN_NODE.value: Effect.DRAIN}
# Faults that end a node's agent by a signal: its exit status is the fault's, not a failure.
_ENDS_THE_AGENT = frozenset({FaultKind.KILL_NODE.value, FaultKind.HANG_NODE.value})


def run_failures(
    summary: Mapping[str, Any],
    *,
    steps: int,
    agent_exits: Mapping[str, int | None],
    faults: Sequence[Mapping[str, Any]] = (),
    agent_reasons: Mapping[str, str] | None = None,
) -> list[str]:
    """Why the run failed, one sentence each; empty when it succeeded. `agent_exits`: each
    node agent's exit status (None: it did not exit); `faults`: the fault log (a node that
    a kill-node or hang-node fault ended may have any status); `agent_reasons`: what an
    agent said when it failed, by node."""
    out: list[str] = []
    if summary["steps"] != steps:
        committed = summary.get("committed_steps")
        if summary["steps"] or committed is None:
            out.append(f"the job trained {summary['steps']} of {steps} steps")
        else:
            out.append(f"the job committed {committed} of {steps} steps; no worker finished")
    if summary["params_sha256"] is None:
        disagree = summary.get("params_sha256_disagree") or []
        out.append(
            f"the workers finished with {len(disagree)} different parameter digests"
            if disagree
            else "no worker reported its final parameters"
        )
    ended = {
        str(f["node"]) for f in faults if f.get("t") is not None and f["kind"] in _ENDS_THE_AGENT
    }
    reasons = agent_reasons or {}
    for node, code in sorted(agent_exits.items()):
        if code is None:
            out.append(f"agent {node} did not exit")
        elif code != 0 and node not in ended:
            why = f": {reasons[node]}" if reasons.get(node) else ""
            out.append(f"agent {node} exited with {describe_exit(code)}{why}")
    return out


def injected_faults(faults: Iterable[Mapping[str, Any]]) -> list[InjectedFault]:
    """Fault-log records (the launcher's, or any with its `kind`, `t` and `node`) as the
    recovery fold takes them; a kind the launcher does not know (the chaos injector's
    partitions, corrupted snapshots) is a failure. Left out: records never applied (no
    `t`), and slow-node faults, which lose nobody (a recovery after one keeps the cause its
    detector recorded: a false alarm shows as such). So an index into the result is one
    into the applied records that change the membership, in order."""
    return [
        InjectedFault(
            kind=str(f["kind"]),
            t=float(f["t"]),
            effect=_EFFECTS.get(str(f["kind"]), Effect.FAILURE),
            node=None if f.get("node") is None else str(f["node"]),
        )
        for f in faults
        if f.get("t") is not None and str(f["kind"]) not in _LOSES_NOBODY
    ]


# The keys of a summary's recovery: a contract that tests and tools read. The record's
# other fields (wall-clock times, members, the fault's index) stay out of it.
_SUMMARY_FIELDS = (
    "cause",
    "node",
    "epoch",
    "step",
    "detect_s",
    "agree_s",
    "communicator_s",
    "restore_s",
    "replan_s",
    "mttr_s",
    "rolled_back_steps",
    "reason",
    "timeout_scale",
    "reshard_s",  # of restore_s: a sharded optimizer state moved into the epoch's shards
    "reshard_bytes",  # that state's bytes the members received from peers
)


def _recoveries(
    events: Sequence[Mapping[str, Any]], faults: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One record per epoch after the first (`protocol.recovery`), timed from the injected
    fault that explains it, else from its detection. A re-admission without a fault of its
    own (a restarted worker coming back) has cause "rejoin" and names the node admitted (a
    join or drain nobody injected: "join", "drain"); a failure nobody injected keeps the
    cause (and node) its detector recorded."""
    return [
        {name: getattr(r, name) for name in _SUMMARY_FIELDS}
        for r in recoveries(events, injected_faults(faults))
    ]
