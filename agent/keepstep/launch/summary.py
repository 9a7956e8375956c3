"""The run summary: the JSON contract other tools and checks read.

Built from the nodes' event logs and the launcher's fault log. A step may be committed
more than once (members that committed it before a failure rolled back and redid it);
only its commits in the newest epoch count, so the ledger shows what the final
parameters were trained on: every micro-batch of every step exactly once.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from keepstep.agent.protocol import node_of


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
    are accounted for by the run that wrote the checkpoint."""
    n_micro = global_batch // micro_batch
    commits = [e for e in events if e["kind"] == "commit"]
    final_epoch: dict[int, int] = {}
    for c in commits:
        final_epoch[c["step"]] = max(final_epoch.get(c["step"], -1), c["epoch"])
    final = [c for c in commits if c["epoch"] == final_epoch[c["step"]]]

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

    shas = sorted({e["params_sha256"] for e in events if e["kind"] == "finish"})
    finished = [e["done"] for e in events if e["kind"] == "finish"]
    recoveries = _recoveries(events, faults)
    mttrs = [r["mttr_s"] for r in recoveries if r["mttr_s"] is not None]
    return {
        "params_sha256": shas[0] if len(shas) == 1 else None,
        "params_sha256_disagree": shas if len(shas) > 1 else [],
        "steps": max(finished, default=0),
        "global_batch": global_batch,
        "micro_batch": micro_batch,
        "start_step": start_step,
        "world_size_by_step": [world.get(s, 0) for s in range(steps)],
        "recoveries": recoveries,
        "mttr_p50_s": statistics.median(mttrs) if mttrs else None,
        "samples": {
            "expected": len(slots) * micro_batch,
            "seen_once": once * micro_batch,
            "lost": lost * micro_batch,
            "duplicated": duplicated * micro_batch,
            "plan_mismatches": mismatches,
        },
        "faults": list(faults),
    }


_PLANNED = {"join-node", "drain-node"}


def _changed_nodes(agreed: dict[str, Any], field: str, word: str) -> list[str]:
    """The nodes whose workers an epoch admitted (`field` "admitted", `word` "admit") or
    drained ("removed", "drain"): from the event's field, or from its reason ("admit
    n1/0,n4/0; drain n2/0") in event logs written before the field existed."""
    members = agreed.get(field)
    if members is None:
        found = re.search(rf"\b{word} ([^;]+)", str(agreed.get("reason", "")))
        members = found.group(1).split(",") if found else []
    return sorted({node_of(str(m).strip()) for m in members})


def _matching_fault(
    agreed: dict[str, Any], faults: Sequence[dict[str, Any]], used: set[int]
) -> dict[str, Any] | None:
    """The earliest unused fault, injected before this epoch was agreed, of a kind that
    explains it: a planned change (admit, drain) or a failure (kill, hang). A join is
    matched to the admission of its own node, not to a restarted worker coming back."""
    planned = bool(agreed.get("planned"))
    reason = str(agreed.get("reason", ""))
    admitted = _changed_nodes(agreed, "admitted", "admit")
    for index, fault in enumerate(faults):
        if index in used or fault["t"] > agreed["t"]:
            continue
        kind = fault["kind"]
        joined = kind == "join-node" and (
            fault.get("node") in admitted if fault.get("node") else bool(admitted)
        )
        if planned and (joined or (kind == "drain-node" and "drain" in reason)):
            used.add(index)
            return fault
        if not planned and kind not in _PLANNED:
            used.add(index)
            return fault
    return None


def _recoveries(
    events: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One record per epoch after the first: its cause and each phase's duration.

    A re-admission without a fault of its own (a restarted worker coming back) has cause
    "rejoin" and names the node admitted; a failure nobody injected keeps the cause (and
    node) its detector recorded.
    """
    agreed: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "epoch-agreed" and e["epoch"] > 0 and e["epoch"] not in agreed:
            agreed[e["epoch"]] = e
    out = []
    used: set[int] = set()
    previous_t = min((e["t"] for e in events), default=0.0)
    for epoch in sorted(agreed):
        a = agreed[epoch]
        fault = _matching_fault(a, faults, used)
        detected = [
            e for e in events if e["kind"] == "fault-detected" and previous_t <= e["t"] <= a["t"]
        ]
        if a.get("planned"):
            detected = []  # planned changes are announced, not detected
        recon = [e for e in events if e["kind"] == "reconfigured" and e["epoch"] == epoch]
        after = [e["t"] for e in events if e["kind"] == "commit" and e["epoch"] >= epoch]
        start = fault["t"] if fault else (detected[0]["t"] if detected else a["t"])
        detect_t = detected[0]["t"] if detected else (start if fault is None else a["t"])
        if fault is not None:
            cause = fault["kind"]
        elif detected:
            cause = detected[0]["cause"]
        else:
            cause = "rejoin" if "admit" in str(a.get("reason", "")) else "planned"
        if fault is not None:
            node = fault.get("node")
        elif detected:
            node = detected[0]["node"]
        else:  # a worker back after a restart, or a drain nobody injected
            changed = _changed_nodes(a, "admitted", "admit") or _changed_nodes(
                a, "removed", "drain"
            )
            node = ",".join(changed) or None
        out.append(
            {
                "cause": cause,
                "node": node,
                "epoch": epoch,
                "step": min((r["resume_step"] for r in recon), default=a.get("step")),
                "detect_s": max(detect_t - start, 0.0),
                "agree_s": max(a["t"] - detect_t, 0.0),
                "communicator_s": max((r["communicator_s"] for r in recon), default=0.0),
                "restore_s": max((r["restore_s"] for r in recon), default=0.0),
                "replan_s": max((r["replan_s"] for r in recon), default=0.0),
                "mttr_s": (min(after) - start) if after else None,
                "rolled_back_steps": max((r["rolled_back_steps"] for r in recon), default=0),
                "reason": a.get("reason", ""),
            }
        )
        previous_t = a["t"]
    return out
