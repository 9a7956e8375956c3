"""`e2e/cluster up [--nodes N] [--work-dir DIR] | down | status`: a local test cluster.

Where it sits: the command a person (or a test) runs to get a whole keepstep cluster on
one machine. `up` starts, each process detached in its own session so that all of them
outlive the command: the control plane (controlplane.py), an etcd for the training jobs,
N process-backed nodes (`python -m keepstep.e2e.noderunner`), the CRDs of manifests/crd/
(applied with kubectl, waited for until Established) and the operator (`python -m
keepstep.operator`). It returns once every node is Ready. `down` stops what state.json
records, by PID, clients before servers; `status` says what runs and asks kubectl.

The work dir (.e2e/ in the repository by default) holds everything:
    kubeconfig  certs/  etcd/  kube-*.log  etcd.log   the control plane
    jobs-etcd/  jobs-etcd.log                         the etcd of the training jobs
    nodes/<node>/  nodes/<node>.log                   each node's pods' logs, its own log
    operator.log  state.json                          the operator; what runs (clusterstate)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from keepstep.e2e import procs
from keepstep.e2e.clusterstate import (
    STATE_FILE,
    ClusterError,
    ClusterState,
    NodeSpec,
    node_specs,
)
from keepstep.e2e.controlplane import REPO, ControlPlane, build_binaries, etcd_argv, etcd_healthy
from keepstep.e2e.procs import ProcessRecord, StartupError, StartupTimeout

CRD_DIR = REPO / "manifests" / "crd"
DEFAULT_WORK_DIR = REPO / ".e2e"
# A crash at import shows within this long; kopf has no readiness signal to wait for.
OPERATOR_SETTLE_S = 2.0
Popen = subprocess.Popen[bytes]


def missing_parts() -> list[str]:
    """What `up` needs from other parts of the repository and does not find."""
    missing = []
    if not sorted(CRD_DIR.glob("*.yaml")):
        missing.append(f"no CustomResourceDefinition YAML in {CRD_DIR}")
    for module, what in (
        ("keepstep.e2e.noderunner", "the process-backed node runner"),
        ("keepstep.operator.__main__", "the operator's entry point"),
    ):
        if importlib.util.find_spec(module) is None:
            missing.append(f"no module {module} ({what})")
    return missing


def stop_stage(name: str) -> int:
    """Stop order: the operator and the nodes while the API server can still hear them
    (a node deletes its Node on the way out), then the API server's clients, the API
    server, and the etcds last."""
    if name == "operator" or name.startswith("node/"):
        return 0
    if name in ("kube-scheduler", "kube-controller-manager"):
        return 1
    return 2 if name == "kube-apiserver" else 3


def stop_all(
    records: tuple[ProcessRecord, ...], timeout: float, popens: dict[int, Popen] | None = None
) -> list[ProcessRecord]:
    """Stop `records` stage by stage; returns those that were running."""
    running = [r for r in records if procs.is_running(r)]
    for stage in range(4):
        batch = [r for r in records if stop_stage(r.name) == stage]
        procs.stop(batch, timeout=timeout, popens=popens)
    return running


class _Up:
    """One `up`: keeps state.json current after every process it starts."""

    def __init__(self, work_dir: Path, nodes: tuple[NodeSpec, ...], timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self.popens: dict[int, Popen] = {}
        self.control_plane_s = 0.0
        bin_dir = build_binaries()
        kubeconfig = work_dir / "kubeconfig"
        self.state = ClusterState(work_dir, kubeconfig, "", bin_dir, nodes=nodes)
        self.state.save()

    def record(self, record: ProcessRecord, popen: Popen) -> None:
        self.popens[record.pid] = popen  # to reap it if `up` fails and stops it again
        self.state = self.state.with_process(record)
        self.state.save()

    def spawn(self, name: str, argv: list[str], log: Path) -> None:
        self.record(*procs.spawn(name, argv, log, cwd=REPO))

    def run(self) -> ClusterState:
        d = self.state.work_dir
        remaining = self.deadline - time.monotonic()
        cp = ControlPlane.start(
            d, timeout=remaining, detach=True, bin_dir=self.state.bin_dir, on_start=self.record
        )
        self.state = replace(self.state, kubeconfig=cp.kubeconfig, server=cp.server)
        self.control_plane_s = cp.startup_seconds["total"]
        record, popen, (port, _) = procs.start_on_free_ports(
            "jobs-etcd",
            lambda p: etcd_argv(cp.bin_dir / "etcd", d / "jobs-etcd", "jobs", p[0], p[1]),
            2,
            d / "jobs-etcd.log",
            ready=lambda p: etcd_healthy(p[0]),
            deadline=self.deadline,
            what="etcd /health",
        )
        self.state = replace(self.state, jobs_etcd=f"http://127.0.0.1:{port}")
        self.record(record, popen)
        python, kubeconfig = sys.executable, str(cp.kubeconfig)
        for node in self.state.nodes:
            node_dir = d / "nodes" / node.name
            node_dir.mkdir(parents=True)
            argv = [python, "-m", "keepstep.e2e.noderunner", "--kubeconfig", kubeconfig]
            argv += ["--name", node.name, "--ip", node.ip, "--work-dir", str(node_dir)]
            self.spawn(f"node/{node.name}", argv, d / "nodes" / f"{node.name}.log")
        self._apply_crds(cp)
        argv = [python, "-m", "keepstep.operator", "--etcd", self.state.jobs_etcd]
        argv += ["--kubeconfig", kubeconfig]
        self.spawn("operator", argv, d / "operator.log")
        settled = time.monotonic() + OPERATOR_SETTLE_S
        names = {n.name for n in self.state.nodes}
        try:
            procs.wait_ready(
                self._watched(),
                lambda: ready_nodes(cp) >= names and time.monotonic() >= settled,
                deadline=self.deadline,
                what=f"{len(names)} Ready nodes",
            )
        except StartupTimeout as err:
            late = sorted(names - ready_nodes(cp))
            if not late:
                raise
            record = next(r for r in self.state.processes if r.name == f"node/{late[0]}")
            raise StartupTimeout(
                record.name,
                f"not Ready in time ({', '.join(late)} not Ready); log {record.log}:\n"
                f"{procs.log_tail(record.log)}",
            ) from err
        return self.state

    def _apply_crds(self, cp: ControlPlane) -> None:
        applied = cp.kubectl("apply", "-f", str(CRD_DIR), "-o", "name", timeout=60.0)
        if applied.returncode != 0:
            raise StartupError("manifests/crd", f"kubectl apply failed:\n{applied.stderr}")
        names = [name.rpartition("/")[2] for name in applied.stdout.split()]
        cp.wait_for_crds(names, timeout=max(self.deadline - time.monotonic(), 1.0))

    def _watched(self) -> list[tuple[ProcessRecord, Popen]]:
        return [(r, self.popens[r.pid]) for r in self.state.processes if r.pid in self.popens]


def ready_nodes(cp: ControlPlane) -> set[str]:
    status, body = cp.access.get("/api/v1/nodes", timeout=5.0)
    if status != 200:
        return set()
    return {
        node["metadata"]["name"]
        for node in json.loads(body)["items"]
        for cond in node.get("status", {}).get("conditions", [])
        if cond["type"] == "Ready" and cond["status"] == "True"
    }


def up(
    work_dir: Path, node_count: int, *, timeout: float = 180.0, out: TextIO | None = None
) -> ClusterState:
    """Start a cluster in `work_dir`; on any failure stop what was started and raise.
    With `out`, say how long the control plane took to start."""
    nodes = node_specs(node_count)
    missing = missing_parts()
    if missing:
        raise ClusterError("cannot start the cluster: " + "; ".join(missing))
    previous = ClusterState.load(work_dir)
    if previous is not None:
        alive = [r.name for r in previous.processes if procs.is_running(r)]
        if alive:
            raise ClusterError(
                f"a cluster is already up in {work_dir} ({', '.join(alive)} running); "
                "run `e2e/cluster down` first"
            )
        shutil.rmtree(work_dir)  # a cluster that is down: start afresh
    elif work_dir.exists() and any(work_dir.iterdir()):
        raise ClusterError(f"{work_dir} is not empty and holds no {STATE_FILE}: not ours")
    work_dir.mkdir(parents=True, exist_ok=True)
    starter = _Up(work_dir, nodes, timeout)
    try:
        state = starter.run()
        if out is not None:
            print(f"control plane ready in {starter.control_plane_s:.1f} s", file=out)
        return state
    except BaseException:
        stop_all(starter.state.processes, timeout=10.0, popens=starter.popens)
        raise


def down(work_dir: Path, *, timeout: float = 15.0) -> list[ProcessRecord] | None:
    """Stop everything state.json records; the processes that were running, or None if
    no cluster was ever started in `work_dir`. Logs and state.json stay for a post-mortem."""
    state = ClusterState.load(work_dir)
    return None if state is None else stop_all(state.processes, timeout)


def status(work_dir: Path, out: TextIO) -> int:
    """Print what runs; 0 if everything recorded runs, 1 otherwise."""
    state = ClusterState.load(work_dir)
    if state is None:
        print(f"no cluster in {work_dir} (run `e2e/cluster up`)", file=out)
        return 1
    running = {r.pid for r in state.processes if procs.is_running(r)}
    whole = len(running) == len(state.processes)
    print(
        f"cluster in {work_dir}: {'up' if whole else 'DOWN' if not running else 'PARTLY DOWN'}",
        file=out,
    )
    for r in state.processes:
        print(
            f"  {r.name:<24} pid {r.pid:<8} {'running' if r.pid in running else 'stopped':<8}"
            f" {r.log}",
            file=out,
        )
    print(f"kubeconfig: {state.kubeconfig}\njobs etcd:  {state.jobs_etcd}", file=out)
    if any(r.name == "kube-apiserver" and r.pid in running for r in state.processes):
        kubectl = [str(state.bin_dir / "kubectl"), f"--kubeconfig={state.kubeconfig}"]
        done = subprocess.run(
            [*kubectl, "get", "nodes,trainjobs", "-A"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        print(done.stdout + done.stderr, end="", file=out)
    return 0 if whole else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/cluster", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up_cmd = commands.add_parser("up", help="start a cluster; returns when its nodes are Ready")
    up_cmd.add_argument("--nodes", type=int, default=3, help="process-backed nodes (default 3)")
    up_cmd.add_argument("--timeout", type=float, default=180.0, help="seconds (default 180)")
    down_cmd = commands.add_parser("down", help="stop everything the last `up` started")
    down_cmd.add_argument("--timeout", type=float, default=15.0, help="per stage, seconds")
    status_cmd = commands.add_parser("status", help="what runs, and kubectl get nodes,trainjobs")
    for sub in (up_cmd, down_cmd, status_cmd):
        sub.add_argument(
            "--work-dir",
            type=Path,
            default=DEFAULT_WORK_DIR,
            help="where state, logs and the kubeconfig go (default: .e2e/)",
        )
    args = parser.parse_args(argv)
    work_dir = args.work_dir.resolve()
    try:
        if args.command == "up":
            began = time.monotonic()
            state = up(work_dir, args.nodes, timeout=args.timeout, out=sys.stdout)
            took = time.monotonic() - began
            print(
                f"cluster up in {took:.1f} s: {len(state.nodes)} nodes, operator, jobs etcd "
                f"{state.jobs_etcd}\nexport KUBECONFIG={state.kubeconfig}"
            )
            return 0
        if args.command == "down":
            stopped = down(work_dir, timeout=args.timeout)
            if stopped is None:
                print(f"no cluster in {work_dir}: nothing to stop")
            elif not stopped:
                print(f"the cluster in {work_dir} was already down: nothing to stop")
            else:
                print(f"stopped {len(stopped)} processes: {', '.join(r.name for r in stopped)}")
            return 0
        return status(work_dir, sys.stdout)
    except (ClusterError, procs.ProcessError, subprocess.SubprocessError, ValueError) as err:
        print(f"e2e/cluster {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
