"""The pod status a process-backed node reports, and whether the API server has it already.

Where it sits: after each decision pass `noderunner.NodeRunner` computes
`desired_status(pod, local, node_ip)` from its `podstate.LocalPod` record and applies it
(server-side apply on the pod's status subresource) only when `differs` says the API
server's copy lacks part of it. The status follows the kubelet's: phase, podIP/hostIP (the
node's address: pod processes share the node's network), the conditions PodScheduled,
Initialized, ContainersReady and Ready, and one container status (running, waiting out a
restart back-off, or terminated with its exit code). Times come from the record, never
from a clock, so the same record always gives the same status and nothing is rewritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from keepstep.e2e.podproc import Pod, first_container
from keepstep.e2e.podstate import LocalPod, RestartPolicy, Termination, backoff_s, is_terminal


def rfc3339(at: datetime) -> str:
    """metav1.Time as the API server stores it: UTC, whole seconds (naive means UTC)."""
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def desired_status(pod: Pod, local: LocalPod | None, node_ip: str) -> dict[str, Any] | None:
    """The pod status the node reports, or None while it has nothing to say (not taken on)."""
    if local is None or (local.pid is None and local.ended is None):
        return None
    policy = RestartPolicy.of(pod)
    end = local.ended
    terminal = is_terminal(local, policy)
    if end is None:
        phase = "Running"
    elif terminal:
        phase = "Succeeded" if end.exit_code == 0 else "Failed"
    else:
        phase = "Running"  # between runs: waiting out the restart back-off
    seen = rfc3339(local.seen_at)
    if local.running and local.started_at is not None:
        ready: dict[str, Any] = {"status": "True", "lastTransitionTime": rfc3339(local.started_at)}
    else:
        changed = end.finished_at if end is not None else local.seen_at
        reason = "PodCompleted" if terminal else "ContainersNotReady"
        ready = {"status": "False", "reason": reason, "lastTransitionTime": rfc3339(changed)}
    container = first_container(pod)
    status: dict[str, Any] = {
        "restartCount": local.restarts,
        "name": container.get("name", ""),
        "image": container.get("image", ""),
        "imageID": "",
        "ready": local.running,
        "started": local.running,
    }
    if local.pid is not None:
        status["containerID"] = f"process://{local.pid}"
    last = local.last
    if end is None:
        status["state"] = {"running": {"startedAt": rfc3339(local.started_at or local.seen_at)}}
    elif terminal:
        status["state"] = {"terminated": _terminated(end, local.pid)}
    else:
        delay = backoff_s(local.restarts)
        status["state"] = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container",
            }
        }
        last = end
    if last is not None:
        status["lastState"] = {"terminated": _terminated(last, None)}
    return {
        "phase": phase,
        "startTime": seen,
        "hostIP": node_ip,
        "hostIPs": [{"ip": node_ip}],
        "podIP": node_ip,
        "podIPs": [{"ip": node_ip}],
        "conditions": [
            _scheduled(pod, seen),
            {"type": "Initialized", "status": "True", "lastTransitionTime": seen},
            {"type": "ContainersReady", **ready},
            {"type": "Ready", **ready},
        ],
        "containerStatuses": [status],
    }


def _terminated(end: Termination, pid: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "exitCode": end.exit_code,
        "reason": end.reason,
        "finishedAt": rfc3339(end.finished_at),
    }
    if end.started_at is not None:
        out["startedAt"] = rfc3339(end.started_at)
    if end.message:
        out["message"] = end.message
    if pid is not None:
        out["containerID"] = f"process://{pid}"
    return out


def _scheduled(pod: Pod, seen: str) -> dict[str, Any]:
    """PodScheduled as the scheduler set it; a pod created with spec.nodeName has none."""
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
            out = {"type": "PodScheduled", "status": "True"}
            if cond.get("lastTransitionTime"):
                out["lastTransitionTime"] = cond["lastTransitionTime"]
            return out
    return {"type": "PodScheduled", "status": "True", "lastTransitionTime": seen}


def differs(desired: Any, observed: Any) -> bool:
    """True unless everything in `desired` is already in `observed`: lists of objects
    match by `type` or `name` (conditions, container statuses), other lists by position."""
    return not _covers(observed, desired)


def _covers(observed: Any, desired: Any) -> bool:
    if isinstance(desired, Mapping):
        return isinstance(observed, Mapping) and all(
            key in observed and _covers(observed[key], value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(observed, list):
            return False
        for index, item in enumerate(desired):
            key = _list_key(item)
            if key is None:
                if index >= len(observed) or not _covers(observed[index], item):
                    return False
            elif not any(
                isinstance(o, Mapping) and o.get(key) == item[key] and _covers(o, item)
                for o in observed
            ):
                return False
        return True
    return bool(desired == observed)


def _list_key(item: Any) -> str | None:
    if isinstance(item, Mapping):
        for key in ("type", "name"):
            if key in item:
                return key
    return None
