"""`e2e/cluster up | status | down`: a whole local cluster that outlives the command,
and that `down` removes without a trace."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from keepstep.e2e import cluster, procs
from keepstep.e2e.clusterstate import ClusterError, ClusterState
from keepstep.e2e.procs import StartupError

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "e2e" / "cluster"


def run_cluster(*args: str, timeout: float = 150.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def kubectl_json(state: ClusterState, *args: str) -> Any:
    done = subprocess.run(
        [
            str(state.bin_dir / "kubectl"),
            f"--kubeconfig={state.kubeconfig}",
            "get",
            *args,
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.e2e
def test_up_status_down(tmp_path: Path) -> None:
    work = tmp_path / "cluster"
    began = time.monotonic()
    done = run_cluster("up", "--nodes", "2", "--work-dir", str(work))
    took = time.monotonic() - began
    state = ClusterState.load(work)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert state is not None
        assert f"export KUBECONFIG={work / 'kubeconfig'}" in done.stdout
        assert took < 150.0

        # Every process outlived `up`, each in a session of its own.
        names = [r.name for r in state.processes]
        assert sorted(names) == sorted(
            [
                "etcd",
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
                "jobs-etcd",
                "node/node-1",
                "node/node-2",
                "operator",
            ]
        )
        for record in state.processes:
            assert procs.is_running(record), f"{record.name}:\n{procs.log_tail(record.log)}"
            assert os.getsid(record.pid) == record.pid
        assert state.jobs_etcd.startswith("http://127.0.0.1:")

        nodes = kubectl_json(state, "nodes")["items"]
        ready = {
            n["metadata"]["name"]: {c["type"]: c["status"] for c in n["status"]["conditions"]}
            for n in nodes
        }
        assert {name: conds.get("Ready") for name, conds in ready.items()} == {
            "node-1": "True",
            "node-2": "True",
        }
        crd = kubectl_json(state, "crd", "trainjobs.keepstep.dev")
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions["Established"] == "True"

        shown = run_cluster("status", "--work-dir", str(work), timeout=60)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert f"cluster in {work}: up" in shown.stdout
        for name in names:
            assert f"{name} " in shown.stdout
        assert "node/node-1" in shown.stdout and "Ready" in shown.stdout

        again = run_cluster("up", "--nodes", "1", "--work-dir", str(work), timeout=60)
        assert again.returncode == 1
        assert "already up" in again.stderr
    finally:
        stopped = run_cluster("down", "--work-dir", str(work), timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "stopped 8 processes" in stopped.stdout
    # The processes are no children of ours: init reaps them a moment after they exit.
    deadline = time.monotonic() + 10.0
    while not all(gone(r.pid) for r in state.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [r.name for r in state.processes if not gone(r.pid)] == []

    second = run_cluster("down", "--work-dir", str(work), timeout=60)
    assert second.returncode == 0, second.stderr
    assert "already down" in second.stdout
    after = run_cluster("status", "--work-dir", str(work), timeout=60)
    assert after.returncode == 1
    assert "DOWN" in after.stdout


def test_up_names_a_missing_part_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster, "CRD_DIR", tmp_path / "no-crds")
    with pytest.raises(ClusterError, match=r"no CustomResourceDefinition YAML in .*no-crds"):
        cluster.up(tmp_path / "cluster", 1, timeout=30.0)
    assert not (tmp_path / "cluster").exists()


@pytest.mark.e2e
def test_a_failed_up_stops_what_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crds = tmp_path / "crds"
    crds.mkdir()
    # Valid YAML the API server refuses: up fails after the control plane and etcd run.
    (crds / "bad.yaml").write_text(
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n"
        "metadata: {name: things.example.com}\nspec: {group: example.com}\n"
    )
    monkeypatch.setattr(cluster, "CRD_DIR", crds)
    work = tmp_path / "cluster"

    with pytest.raises(StartupError) as caught:
        cluster.up(work, 1, timeout=90.0)

    assert caught.value.component == "manifests/crd"
    state = ClusterState.load(work)
    assert state is not None
    assert {"etcd", "kube-apiserver", "jobs-etcd", "node/node-1"} <= {
        r.name for r in state.processes
    }
    assert [r.name for r in state.processes if not gone(r.pid)] == []
