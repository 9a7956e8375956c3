"""The operator at scale: a 1000-node TrainJob against a real control plane.

    scripts/env python bench/operator_scale.py [--nodes 1000] [--resync 2] [--json PATH]

Starts the real kube-apiserver, controller-manager and scheduler (keepstep.e2e's
ControlPlane) and an etcd for the job records, applies the TrainJob CRD, then measures:

1. end to end, with the operator as a process (`python -m keepstep.operator`): the time
   from `kubectl create` of an N-node TrainJob to all N pods existing, and whether anything
   is written afterwards while nothing changes (the job's resourceVersion, the pods' names
   and uids, and the events the operator posted, over several resyncs);
   then the time from deleting one of its pods to its replacement existing;
2. in process, with the operator's own `Reconciler` on a second N-node job: the first
   reconcile (its API calls, split into reads and writes, and its time), then the next
   reconciles, which must write nothing (their API calls are the reads of one observation):
   twice listing the pods, twice taking them from a cache as the operator process does.

There are no nodes: pods stay Pending, which is all the operator needs. Prints one line per
figure and, with --json, writes them to a file.
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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "manifests" / "crd" / "trainjob.yaml"
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def trainjob(name: str, nodes: int) -> str:
    return json.dumps(
        {
            "apiVersion": "keepstep.dev/v1alpha1",
            "kind": "TrainJob",
            "metadata": {"name": name},
            "spec": {
                "trainer": {
                    "image": "keepstep:dev",
                    "command": ["python", "examples/mlp.py"],
                    "numNodes": nodes,
                    "numSteps": 100,
                },
                "elasticPolicy": {
                    "minNodes": 1,
                    "maxNodes": nodes,
                    "globalBatchSize": nodes,
                    "microBatchSize": 1,
                },
            },
        }
    )


class Api:
    """Bare GETs with the admin token (metadata-only lists keep polling cheap)."""

    def __init__(self, access: Any) -> None:
        context = ssl.create_default_context(cafile=str(access.ca_file))
        self._open = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        ).open
        self._server, self._token = access.server, access.token

    def get(self, path: str, accept: str = "application/json") -> Any:
        request = urllib.request.Request(
            self._server + path,
            headers={"Authorization": f"Bearer {self._token}", "Accept": accept},
        )
        with self._open(request, timeout=30.0) as response:
            return json.loads(response.read())

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return False
            raise
        return True

    def delete(self, path: str) -> None:
        request = urllib.request.Request(
            self._server + path, method="DELETE", headers={"Authorization": f"Bearer {self._token}"}
        )
        with self._open(request, timeout=30.0) as response:
            response.read()

    def pod_uids(self, namespace: str, job: str) -> dict[str, str]:
        """The job's pods by name -> uid: the operator only ever creates and deletes pods
        (the scheduler, not the operator, updates their status while they are Pending)."""
        path = f"/api/v1/namespaces/{namespace}/pods?labelSelector=keepstep.dev/job%3D{job}"
        items = self.get(path, METADATA_ONLY)["items"] or []
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items}

    def job_version(self, namespace: str, job: str) -> str:
        path = f"/apis/keepstep.dev/v1alpha1/namespaces/{namespace}/trainjobs/{job}"
        return str(self.get(path)["metadata"]["resourceVersion"])

    def events(self, namespace: str) -> dict[str, str]:
        """Events the operator posted (the scheduler posts its own): name -> reason."""
        path = f"/api/v1/namespaces/{namespace}/events?fieldSelector=source%3Dkeepstep-operator"
        return {e["metadata"]["name"]: e["reason"] for e in self.get(path)["items"] or []}


def wait_for(what: str, probe: Any, timeout: float, every: float = 0.1) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if probe():
            return time.monotonic() - start
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def end_to_end(
    cp: Any, api: Api, etcd: str, nodes: int, resync: float, log: Path
) -> dict[str, Any]:
    ns = "bench-process"
    cp.kubectl("create", "namespace", ns, check=True)
    cp.wait_for_service_account(ns)
    argv = [
        sys.executable, "-m", "keepstep.operator", "--etcd", etcd,
        "--kubeconfig", str(cp.kubeconfig), "--namespace", ns, "--resync", str(resync),
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        # A one-node job first, so the measurement below excludes the operator's start-up.
        cp.kubectl("create", "-n", ns, "-f", "-", input=trainjob("warmup", 1), check=True)
        wait_for("the operator to start", lambda: api.pod_uids(ns, "warmup"), 120, 0.5)
        t0 = time.monotonic()
        cp.kubectl("create", "-n", ns, "-f", "-", input=trainjob("scale", nodes), check=True)
        # From before `kubectl create` (its own start-up included) to the last pod listed.
        wait_for(f"{nodes} pods", lambda: len(api.pod_uids(ns, "scale")) >= nodes, 120, 0.2)
        all_created = time.monotonic() - t0
        settle = wait_for(
            "the status",
            lambda: (
                api.get(f"/apis/keepstep.dev/v1alpha1/namespaces/{ns}/trainjobs/scale")
                .get("status", {})
                .get("nextPodIndex")
                == nodes
            ),
            60,
        )
        time.sleep(2 * resync)
        before = (api.job_version(ns, "scale"), api.pod_uids(ns, "scale"))
        events_before = api.events(ns)
        time.sleep(4 * resync)
        after = (api.job_version(ns, "scale"), api.pod_uids(ns, "scale"))
        changed = int(before[0] != after[0]) + len(set(before[1].items()) ^ set(after[1].items()))
        idle_events = sorted(r for n, r in api.events(ns).items() if n not in events_before)
        # One pod of the big job is lost: how soon does its replacement exist?
        pods = f"/api/v1/namespaces/{ns}/pods"
        t0 = time.monotonic()
        api.delete(f"{pods}/scale-node-7")
        wait_for("the replacement", lambda: api.exists(f"{pods}/scale-node-{nodes}"), 60, 0.02)
        return {
            "nodes": nodes,
            "seconds_to_all_pods_created": round(all_created, 3),
            "seconds_to_replace_a_deleted_pod": round(time.monotonic() - t0, 3),
            "seconds_to_status_written": round(all_created + settle, 3),
            "job_or_pod_writes_during_4_idle_resyncs": changed,
            "operator_events_during_4_idle_resyncs": idle_events,
        }
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
    from keepstep.agent.etcd import EtcdKV
    from keepstep.operator.agents import AgentStore
    from keepstep.operator.connection import load_connection
    from keepstep.operator.kube import Kube
    from keepstep.operator.reconcile import Reconciler
    from keepstep.operator.settings import DecideConfig

    ns = "bench-inproc"
    cp.kubectl("create", "namespace", ns, check=True)
    cp.wait_for_service_account(ns)
    cp.kubectl("create", "-n", ns, "-f", "-", input=trainjob("scale", nodes), check=True)
    kube = Kube(load_connection(str(cp.kubeconfig)), timeout=30.0, parallelism=16)
    kv = EtcdKV(etcd, timeout=5.0)
    reconciler = Reconciler(kube, AgentStore(kv, 5.0), DecideConfig(etcd))
    try:
        first = reconciler.reconcile(ns, "scale")
        listed = [reconciler.reconcile(ns, "scale") for _ in range(2)]
        # What the operator process does: the pods come from its watch cache (kopf's index).
        cache = kube.list_pods(ns, "scale")
        cached = [reconciler.reconcile(ns, "scale", pods=cache) for _ in range(2)]
    finally:
        kv.close()

    def figures(o: Any, source: str) -> dict[str, Any]:
        return {
            "pods_from": source,
            "seconds": round(o.seconds, 3),
            "decide_seconds": round(o.decide_seconds, 4),
            "api_reads": o.tally.reads,
            "api_writes": o.tally.writes,
            "api_calls": dict(o.tally.calls),
            "etcd_reads": o.etcd_reads,
            "etcd_writes": o.etcd_writes,
            "actions": len(o.decision.actions),
        }

    return {
        "first_reconcile": {
            "seconds": round(first.seconds, 3),
            "decide_seconds": round(first.decide_seconds, 4),
            "api_reads": first.tally.reads,
            "api_writes": first.tally.writes,
            "api_calls": dict(first.tally.calls),
            "etcd_reads": first.etcd_reads,
            "etcd_writes": first.etcd_writes,
        },
        "no_change_reconciles": [
            *(figures(o, "list") for o in listed),
            *(figures(o, "cache") for o in cached),
        ],
    }


def report(figures: dict[str, Any], nodes: int) -> None:
    e2e, rec = figures["operator_process"], figures["reconciler"]
    first = rec["first_reconcile"]
    print(
        f"{nodes}-node TrainJob, operator process: all pods created "
        f"{e2e['seconds_to_all_pods_created']} s after kubectl create "
        f"(status written at {e2e['seconds_to_status_written']} s)"
    )
    print(f"  a deleted pod replaced after {e2e['seconds_to_replace_a_deleted_pod']} s")
    print(
        f"  idle for 4 resyncs: {e2e['job_or_pod_writes_during_4_idle_resyncs']} TrainJob or pod"
        f" writes, events posted: {e2e['operator_events_during_4_idle_resyncs'] or 'none'}"
    )
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--resync", type=float, default=2.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--operator-log", type=Path, help="keep the operator's log here")
    args = parser.parse_args()

    from keepstep.agent.etcd_server import EtcdServer
    from keepstep.e2e.controlplane import ControlPlane

    with tempfile.TemporaryDirectory(prefix="keepstep-opscale-") as tmp:
        work = Path(tmp)
        cp = ControlPlane.start(work / "cp", timeout=120.0)
        try:
            with EtcdServer.start(str(cp.bin_dir / "etcd"), work / "etcd") as server:
                etcd = f"http://{server.endpoint}"
                cp.kubectl("apply", "-f", str(CRD), check=True)
                cp.kubectl(
                    "wait", "--for=condition=Established", "crd/trainjobs.keepstep.dev",
                    "--timeout=60s", check=True,
                )  # fmt: skip
                api = Api(cp.access)
                figures: dict[str, Any] = {
                    "operator_process": end_to_end(
                        cp, api, etcd, args.nodes, args.resync, args.operator_log or work / "op.log"
                    ),
                    "reconciler": in_process(cp, etcd, args.nodes),
                    "cpus": os.cpu_count(),
                }
        finally:
            cp.stop()
    report(figures, args.nodes)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    e2e, idle = figures["operator_process"], figures["reconciler"]["no_change_reconciles"]
    ok = all(o["api_writes"] == 0 and o["etcd_writes"] == 0 for o in idle)
    ok = ok and e2e["job_or_pod_writes_during_4_idle_resyncs"] == 0
    ok = ok and not e2e["operator_events_during_4_idle_resyncs"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
