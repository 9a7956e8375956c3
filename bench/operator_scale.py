"""The operator at scale: a 1000-node TrainJob on 1000 kwok nodes of a real control plane.

    scripts/env python bench/operator_scale.py [--nodes 1000] [--resync 2] [--json PATH]

Starts the real kube-apiserver, controller-manager and scheduler (keepstep.e2e's
ControlPlane), an etcd for the job records, kwok (keepstep.e2e.kwok) and N fake nodes it
plays, applies the TrainJob CRD, then measures:

1. end to end, with the operator as a process (`python -m keepstep.operator`), from
   `kubectl create` of an N-node TrainJob: the time to all N pods existing, to all N bound
   by the real scheduler, to all N Running (kwok plays their kubelets) and to the
   operator's status saying so (nextPodIndex N, phase Pending: no agent runs in a kwok
   pod). Then the agents are played (N node records, progress, an epoch written into the
   job etcd): the time from the epoch to the status reading phase Running with N nodes
   and world size N. Idle for 4 resyncs, nothing may be written (the job's
   resourceVersion, the pods' names and uids, the operator's events). Last, one pod is
   deleted: the time to its replacement existing, and Running;
2. in process, with the operator's own `Reconciler` on a second N-node job: the first
   reconcile (its API calls, split into reads and writes, and its time), then, once its
   pods run, the next reconciles, which must write nothing (their API calls are the reads
   of one observation): twice listing the pods, twice taking them from a cache as the
   operator process does.

Prints one line per figure and, with --json, writes them to a file; exits 1 if a
no-change reconcile wrote anything or the status was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "manifests" / "crd" / "trainjob.yaml"
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
KWOK_LEASE_S = 120  # renewed every 30 s: 1000 nodes cost ~33 Lease updates per second
NODE_GRACE_S = 60  # the controller-manager's node-monitor grace, above kwok's renewals


class Api:
    """Counting reads with the admin's token: metadata-only lists and field selectors keep
    polling 1000 pods cheap for the API server that is being measured."""

    def __init__(self, cp: Any, namespace: str) -> None:
        self.ns = namespace
        access = cp.access
        context = ssl.create_default_context(cafile=str(access.ca_file))
        self._open = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        ).open
        self._server, self._token = access.server, access.token

    def _get(self, path: str, accept: str = "application/json") -> Any:
        request = urllib.request.Request(
            self._server + path,
            headers={"Authorization": f"Bearer {self._token}", "Accept": accept},
        )
        with self._open(request, timeout=30.0) as response:
            return json.loads(response.read())

    def pods(self, job: str, fields: str = "") -> dict[str, str]:
        """The job's pods (name -> uid), optionally narrowed by a field selector."""
        path = f"/api/v1/namespaces/{self.ns}/pods?labelSelector=keepstep.dev/job%3D{job}"
        if fields:
            path += f"&fieldSelector={quote(fields)}"
        items = self._get(path, METADATA_ONLY)["items"] or []
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items}

    def status(self, job: str) -> dict[str, Any]:
        path = f"/apis/keepstep.dev/v1alpha1/namespaces/{self.ns}/trainjobs/{job}"
        status: dict[str, Any] = self._get(path).get("status") or {}
        return status

    def job_version(self, job: str) -> str:
        path = f"/apis/keepstep.dev/v1alpha1/namespaces/{self.ns}/trainjobs/{job}"
        return str(self._get(path)["metadata"]["resourceVersion"])

    def events(self) -> dict[str, str]:
        """Events the operator posted (the scheduler posts its own): name -> reason."""
        path = f"/api/v1/namespaces/{self.ns}/events?fieldSelector=source%3Dkeepstep-operator"
        return {e["metadata"]["name"]: e["reason"] for e in self._get(path)["items"] or []}


def wait_for(what: str, probe: Callable[[], Any], timeout: float, every: float = 0.1) -> float:
    """Seconds until `probe()` holds; exits the benchmark after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if probe():
            return time.monotonic() - start
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def milestones(api: Api, job: str, nodes: int, t0: float) -> dict[str, float]:
    """Seconds from `t0` until all pods exist, are bound, are Running, and until the
    operator's status counts them (nextPodIndex), each polled until it first holds."""
    probes: dict[str, Callable[[], bool]] = {
        "seconds_to_all_pods_created": lambda: len(api.pods(job)) >= nodes,
        "seconds_to_all_pods_bound": lambda: len(api.pods(job, "spec.nodeName!=")) >= nodes,
        "seconds_to_all_pods_running": (
            lambda: len(api.pods(job, "status.phase=Running")) >= nodes
        ),
        "seconds_to_status_written": lambda: api.status(job).get("nextPodIndex") == nodes,
    }
    out: dict[str, float] = {}
    deadline = t0 + 300.0
    while len(out) < len(probes):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after 300 s; reached only {sorted(out)}")
        for name, probe in probes.items():
            if name not in out and probe():
                out[name] = round(time.monotonic() - t0, 3)
        time.sleep(0.1)
    return out


def play_agents(etcd: str, job_key: str, pods: list[str], step: int) -> float:
    """Write what the agents of `pods` would once they trained to `step` in epoch 1: node
    and progress records first, the epoch last. Returns when the epoch was written."""
    from keepstep.agent import protocol
    from keepstep.agent.kv.etcd import EtcdKV

    kv = EtcdKV(etcd, timeout=10.0)
    try:

        def one(pod: str) -> None:
            node = protocol.NodeRecord(pod, "10.240.0.1", 1, 2)
            kv.put(protocol.key(job_key, "nodes", pod), protocol.encode(node), 10.0)
            progress = protocol.ProgressRecord(pod, step, 1, len(pods), 1000.0)
            kv.put(protocol.key(job_key, "progress", pod), protocol.encode(progress), 10.0)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, pods))
        members = [protocol.member_id(p, 0) for p in sorted(pods)]
        epoch = protocol.encode(protocol.EpochRecord(1, members))
        kv.put(protocol.key(job_key, "epoch"), epoch, 10.0)
        return time.monotonic()
    finally:
        kv.close()


def end_to_end(cp: Any, etcd: str, nodes: int, resync: float, log: Path) -> dict[str, Any]:
    from keepstep.e2e.kwok_nodes import kwok_trainjob

    ns = "bench-process"
    cp.kubectl("create", "namespace", ns, check=True)
    cp.wait_for_service_account(ns)
    api = Api(cp, ns)
    argv = [
        sys.executable, "-m", "keepstep.operator", "--etcd", etcd,
        "--kubeconfig", str(cp.kubeconfig), "--namespace", ns, "--resync", str(resync),
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        # A one-node job first, so the measurement below excludes the operator's start-up.
        cp.kubectl("create", "-n", ns, "-f", "-", input=kwok_trainjob("warmup", 1), check=True)
        wait_for("the operator to start", lambda: api.pods("warmup"), 120, 0.5)
        t0 = time.monotonic()
        # From before `kubectl create` (its own start-up included).
        cp.kubectl("create", "-n", ns, "-f", "-", input=kwok_trainjob("scale", nodes), check=True)
        figures: dict[str, Any] = {"nodes": nodes, **milestones(api, "scale", nodes, t0)}
        pending = api.status("scale")
        figures["status_before_agents"] = {
            k: pending.get(k) for k in ("phase", "nodes", "worldSize", "nextPodIndex", "selector")
        }

        # The agents report: how soon does the status show every node live?
        epoch_at = play_agents(etcd, f"{ns}.scale", sorted(api.pods("scale")), step=42)

        def all_live() -> bool:
            s = api.status("scale")
            return s.get("phase") == "Running" and s.get("nodes") == nodes

        wait_for("phase Running with every node", all_live, 60)
        figures["seconds_from_epoch_to_status_running"] = round(time.monotonic() - epoch_at, 3)
        running = api.status("scale")
        figures["status_with_agents"] = {
            k: running.get(k) for k in ("phase", "nodes", "worldSize", "step", "epoch")
        }

        time.sleep(2 * resync)
        before = (api.job_version("scale"), api.pods("scale"))
        events_before = api.events()
        time.sleep(4 * resync)
        after = (api.job_version("scale"), api.pods("scale"))
        changed = int(before[0] != after[0]) + len(set(before[1].items()) ^ set(after[1].items()))
        figures["job_or_pod_writes_during_4_idle_resyncs"] = changed
        figures["operator_events_during_4_idle_resyncs"] = sorted(
            r for n, r in api.events().items() if n not in events_before
        )

        # One pod of the big job is lost: how soon does its replacement exist, and run?
        replacement = f"scale-node-{nodes}"
        t0 = time.monotonic()
        cp.kubectl("delete", "-n", ns, "pod", "scale-node-7", "--wait=false", check=True)
        wait_for("the replacement", lambda: replacement in api.pods("scale"), 60, 0.02)
        figures["seconds_to_replace_a_deleted_pod"] = round(time.monotonic() - t0, 3)
        wait_for(
            "the replacement Running",
            lambda: replacement in api.pods("scale", "status.phase=Running"),
            60,
            0.05,
        )
        figures["seconds_to_replacement_running"] = round(time.monotonic() - t0, 3)
        return figures
    except SystemExit:
        lines = log.read_text(errors="replace").splitlines()
        print("\n".join([ln for ln in lines if " INFO " not in ln][-60:]), file=sys.stderr)
        print("\n".join(lines[-10:]), file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def in_process(cp: Any, etcd: str, nodes: int) -> dict[str, Any]:
    from keepstep.agent.kv.etcd import EtcdKV
    from keepstep.e2e.kwok_nodes import kwok_trainjob
    from keepstep.operator.agents import AgentStore
    from keepstep.operator.connection import load_connection
    from keepstep.operator.kube import Kube
    from keepstep.operator.reconcile import Reconciler
    from keepstep.operator.settings import DecideConfig

    ns = "bench-inproc"
    cp.kubectl("create", "namespace", ns, check=True)
    cp.wait_for_service_account(ns)
    cp.kubectl("create", "-n", ns, "-f", "-", input=kwok_trainjob("scale", nodes), check=True)
    kube = Kube(load_connection(str(cp.kubeconfig)), timeout=30.0, parallelism=16)
    kv = EtcdKV(etcd, timeout=5.0)
    reconciler = Reconciler(kube, AgentStore(kv, 5.0), DecideConfig(etcd))
    try:
        first = reconciler.reconcile(ns, "scale")
        # Measured in the steady state: the scheduler and kwok done with the pods.
        api = Api(cp, ns)
        running = "status.phase=Running"
        wait_for("the pods Running", lambda: len(api.pods("scale", running)) >= nodes, 300, 0.5)
        listed = [reconciler.reconcile(ns, "scale") for _ in range(2)]
        # What the operator process does: the pods come from its watch cache (kopf's index).
        cache = kube.list_pods(ns, "scale")
        cached = [reconciler.reconcile(ns, "scale", pods=cache) for _ in range(2)]
    finally:
        kv.close()

    def figures(o: Any, source: str = "") -> dict[str, Any]:
        out = {
            "seconds": round(o.seconds, 3),
            "decide_seconds": round(o.decide_seconds, 4),
            "api_reads": o.tally.reads,
            "api_writes": o.tally.writes,
            "api_calls": dict(o.tally.calls),
            "etcd_reads": o.etcd_reads,
            "etcd_writes": o.etcd_writes,
            "actions": len(o.decision.actions),
        }
        return {"pods_from": source, **out} if source else out

    return {
        "first_reconcile": figures(first),
        "no_change_reconciles": [
            *(figures(o, "list") for o in listed),
            *(figures(o, "cache") for o in cached),
        ],
    }


def report(figures: dict[str, Any], nodes: int) -> None:
    setup, e2e, rec = figures["setup"], figures["operator_process"], figures["reconciler"]
    print(
        f"{nodes} kwok nodes: created in {setup['seconds_to_create_nodes']} s, all schedulable"
        f" {setup['seconds_to_nodes_schedulable']} s later"
    )
    print(
        f"{nodes}-node TrainJob, operator process, from kubectl create: all pods created "
        f"{e2e['seconds_to_all_pods_created']} s, bound {e2e['seconds_to_all_pods_bound']} s, "
        f"Running {e2e['seconds_to_all_pods_running']} s, status written "
        f"{e2e['seconds_to_status_written']} s: {e2e['status_before_agents']}"
    )
    print(
        f"  agents played: status Running with every node "
        f"{e2e['seconds_from_epoch_to_status_running']} s after the epoch: "
        f"{e2e['status_with_agents']}"
    )
    print(
        f"  idle for 4 resyncs: {e2e['job_or_pod_writes_during_4_idle_resyncs']} TrainJob or pod"
        f" writes, events posted: {e2e['operator_events_during_4_idle_resyncs'] or 'none'}"
    )
    print(
        f"  a deleted pod replaced after {e2e['seconds_to_replace_a_deleted_pod']} s, "
        f"its replacement Running after {e2e['seconds_to_replacement_running']} s"
    )
    first = rec["first_reconcile"]
    print(
        f"first reconcile (in process): {first['seconds']} s, {first['api_reads']} API reads"
        f" + {first['api_writes']} writes {first['api_calls']}, etcd {first['etcd_reads']}"
        f" read + {first['etcd_writes']} write, decide {first['decide_seconds']} s"
    )
    for o in rec["no_change_reconciles"]:
        print(
            f"no-change reconcile (pods from {o['pods_from']}): {o['seconds']} s, "
            f"{o['api_reads']} API reads + "
            f"{o['api_writes']} writes {o['api_calls']}, etcd {o['etcd_reads']} read + "
            f"{o['etcd_writes']} writes, {o['actions']} actions, decide {o['decide_seconds']} s"
        )


def verdict(figures: dict[str, Any], nodes: int) -> list[str]:
    """What the run got wrong (empty: nothing)."""
    e2e, idle = figures["operator_process"], figures["reconciler"]["no_change_reconciles"]
    wrong = [f"no-change reconcile wrote: {o}" for o in idle if o["api_writes"] or o["etcd_writes"]]
    if (
        e2e["job_or_pod_writes_during_4_idle_resyncs"]
        or e2e["operator_events_during_4_idle_resyncs"]
    ):
        wrong.append("the operator wrote while nothing changed")
    before = e2e["status_before_agents"]
    if (before["phase"], before["nodes"], before["worldSize"]) != ("Pending", 0, 0):
        wrong.append(f"status before the agents: {before}")
    after = e2e["status_with_agents"]
    if (after["phase"], after["nodes"], after["worldSize"], after["step"]) != (
        "Running",
        nodes,
        nodes,
        42,
    ):
        wrong.append(f"status with the agents: {after}")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--resync", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--operator-log", type=Path, help="keep the operator's log here")
    args = parser.parse_args()

    from keepstep.e2e.controlplane import ControlPlane
    from keepstep.e2e.kwok import Kwok, KwokConfig
    from keepstep.e2e.kwok_nodes import KwokNodes
    from keepstep.launch.etcd_server import EtcdServer

    with tempfile.TemporaryDirectory(prefix="keepstep-opscale-") as tmp:
        work = Path(tmp)
        cp = ControlPlane.start(work / "cp", timeout=120.0, node_monitor_grace_period=NODE_GRACE_S)
        kwok = None
        try:
            kwok = Kwok.start(KwokConfig(cp.kubeconfig, work / "kwok", "bench", KWOK_LEASE_S))
            fake = KwokNodes(cp.kubeconfig, cp.access, "bench", timeout=30.0)
            t0 = time.monotonic()
            fake.create(args.nodes, "kwok")
            created = time.monotonic() - t0
            ready = fake.wait_schedulable(args.nodes, timeout=600.0)
            fake.close()
            with EtcdServer.start(str(cp.bin_dir / "etcd"), work / "etcd") as server:
                etcd = f"http://{server.endpoint}"
                cp.kubectl("apply", "-f", str(CRD), check=True)
                cp.wait_for_crds(["trainjobs.keepstep.dev"], timeout=60.0)
                log = args.operator_log or work / "op.log"
                figures: dict[str, Any] = {
                    "setup": {
                        "seconds_to_create_nodes": round(created, 3),
                        "seconds_to_nodes_schedulable": round(ready, 3),
                    },
                    "operator_process": end_to_end(cp, etcd, args.nodes, args.resync, log),
                    "reconciler": in_process(cp, etcd, args.nodes),
                    "cpus": os.cpu_count(),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                }
        finally:
            if kwok is not None:
                kwok.stop()
            cp.stop()
    report(figures, args.nodes)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    wrong = verdict(figures, args.nodes)
    for line in wrong:
        print(f"WRONG: {line}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
