"""A chaos scenario's job as a TrainJob, and a finished run read back from the cluster.

Where it sits: between the harness's `Job` (what `keepstep run` would be given) and the
`ClusterTarget` (chaos_cluster.py). Pure functions of their arguments: the manifest the
target applies, the job settings a TrainJob cannot express (the target refuses those),
when a run is over, and the summary the invariants read, built from the agents' event
logs the way `keepstep run` builds its own (`keepstep.launch.summary`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from keepstep.chaos.invariants import explaining
from keepstep.chaos.model import Job
from keepstep.launch.summary import build_summary

IMAGE = "keepstep/agent:chaos"  # the node runner ignores images: pods run this checkout
# Node runners advertise 8 CPUs: a request over half of that puts one pod on each node,
# so a node fault hits exactly one member, as a simulated node of `keepstep run` does.
CPU_PER_POD = "5"
FINAL_PHASES = ("Succeeded", "Failed")


def job_problems(job: Job) -> list[str]:
    """What of `job` a TrainJob cannot express (the pods' agents run with their defaults)."""
    out = []
    if job.mode != "exact":
        out.append(f"mode {job.mode!r}: a TrainJob's agents always reduce in exact mode")
    if job.hang_timeout != 1:
        out.append(f"hang_timeout {job.hang_timeout}: a TrainJob's agents use 1 s")
    return out


def trainjob_manifest(
    job: Job, name: str, *, joins: int, tmpdir: Path, checkpoints: Path | None
) -> dict[str, Any]:
    """The TrainJob that trains `job`: same script, arguments, shape, batch, steps and
    seed. `maxNodes` leaves room for the scenario's joins (each a `kubectl scale`); every
    pod's TMPDIR is `tmpdir`, so the agents' run directories land under it."""
    trainer: dict[str, Any] = {
        "image": IMAGE,
        "command": [sys.executable, str(Path(job.script).resolve())],
        "args": list(job.script_args),
        "env": [{"name": "TMPDIR", "value": str(tmpdir)}],
        "numNodes": job.nodes,
        "numProcPerNode": job.nproc_per_node,
        "numSteps": job.steps,
        "seed": job.seed,
        "resourcesPerNode": {"requests": {"cpu": CPU_PER_POD}},
    }
    spec: dict[str, Any] = {
        "trainer": trainer,
        "elasticPolicy": {
            "minNodes": job.min_nodes,
            "maxNodes": job.nodes + joins,
            "globalBatchSize": job.global_batch,
            "microBatchSize": job.micro_batch,
        },
    }
    if job.checkpoint_every and checkpoints is not None:
        spec["checkpoint"] = {"uri": checkpoints.as_uri(), "everySteps": job.checkpoint_every}
    return {
        "apiVersion": "keepstep.dev/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def phase(trainjob: Mapping[str, Any] | None) -> str | None:
    return ((trainjob or {}).get("status") or {}).get("phase")


def exit_codes(pods: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """pod -> its container's exit code, for every pod whose container has ended."""
    out = {}
    for name, pod in pods.items():
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        ended = statuses[0].get("state", {}).get("terminated")
        if ended is not None:
            out[name] = int(ended["exitCode"])
    return out


def run_summary(
    events: Sequence[dict[str, Any]],
    applied: Sequence[Mapping[str, Any]],
    job: Job,
    codes: Mapping[str, int],
) -> dict[str, Any]:
    """summary.json as `keepstep run` writes it, its recoveries explained by the faults
    that change the membership (`chaos.invariants.explaining`), as the chaos report's are."""
    summary = build_summary(
        events,
        [dict(f) for f in explaining(applied)],
        steps=job.steps,
        global_batch=job.global_batch,
        micro_batch=job.micro_batch,
    )
    summary["agent_exit_codes"] = dict(codes)
    return summary
