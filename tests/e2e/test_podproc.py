"""The process-backed node's pure parts: pod -> process spec, decisions, pod and node status.

No API server here; the last tests start real local processes (no Kubernetes) to check
the node's process table: exit codes, signals to the whole group, stop and continue.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from keepstep.e2e.nodeobj import NodeConfig, lease_body, node_body, node_status_body
from keepstep.e2e.nodeprocs import NEVER_RAN, NodeProcesses, proc_state
from keepstep.e2e.podproc import (
    PodSpecError,
    container_env,
    exit_code,
    expand,
    process_spec,
    termination_file,
)
from keepstep.e2e.podstate import Act, LocalPod, Termination, backoff_s, decide
from keepstep.e2e.podstatus import desired_status, differs

IP = "127.0.3.4"
T0 = datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=UTC)


def pod(
    *,
    command: list[str] | None = None,
    env: list[dict[str, Any]] | None = None,
    restart: str = "Never",
    status: dict[str, Any] | None = None,
    deleting: int | None = None,
    grace: int | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": "p1",
        "namespace": "ns1",
        "uid": "u-1",
        "resourceVersion": "7",
        "labels": {"app": "x"},
    }
    if deleting is not None:
        meta["deletionTimestamp"] = "2030-01-02T03:04:05Z"
        meta["deletionGracePeriodSeconds"] = deleting
    spec: dict[str, Any] = {
        "nodeName": "node-a",
        "restartPolicy": restart,
        "serviceAccountName": "default",
        "containers": [
            {
                "name": "main",
                "image": "ignored:1",
                "command": ["python", "-c"] if command is None else command,
                "args": ["print(1)"],
                "env": env or [],
            }
        ],
    }
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"metadata": meta, "spec": spec, "status": status or {"phase": "Pending"}}


def local() -> LocalPod:
    """A pod whose process (pid 42) started one second after the node took it on."""
    return LocalPod("u-1", "ns1", "p1", T0).with_start(42, T0 + timedelta(seconds=1))


def _mk(base: LocalPod, changes: dict[str, Any]) -> LocalPod:
    return replace(base, **changes)


def ended(code: int, at: float = 100.0, **changes: Any) -> LocalPod:
    end = Termination(code, "Error" if code else "Completed", T0 + timedelta(seconds=5), at, T0)
    return _mk(local().with_end(end), changes)


# -- pod -> process ---------------------------------------------------------------------


def test_env_values_field_refs_and_expansion_in_order() -> None:
    env: list[dict[str, Any]] = [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "$(A)-$(LATER)-$$(A)"},
        {"name": "LATER", "value": "z"},
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
    ]
    got = container_env(pod(env=env), IP)
    assert got == {
        "A": "1",
        "B": "1-$(LATER)-$(A)",  # only names defined before; $$ escapes
        "LATER": "z",
        "NAME": "p1",
        "NS": "ns1",
        "UID": "u-1",
        "NODE": "node-a",
        "POD_IP": IP,
        "HOST_IP": IP,
        "APP": "x",
    }


def test_process_spec_runs_command_and_args_with_runner_env_under_pod_env() -> None:
    p = pod(
        command=["keepstep", "agent", "--node", "$(NODE)"],
        env=[
            {"name": "PATH", "value": "/pod/bin"},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
    )
    spec = process_spec(p, IP, {"PATH": "/runner/bin", "HOME": "/h"})
    assert spec.argv == ("keepstep", "agent", "--node", "p1", "print(1)")
    assert spec.env_dict() == {"PATH": "/pod/bin", "HOME": "/h", "NODE": "p1"}
    assert spec.log_name == "ns1_p1.log"
    assert spec.log_path(Path("/w")) == Path("/w/ns1_p1.log")


def test_the_termination_message_path_becomes_a_file_of_the_pods_own() -> None:
    p = pod(command=["keepstep", "agent", "--termination-log", "/dev/termination-log"])
    p["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    spec = process_spec(p, IP, {})
    assert spec.argv[:3] == ("keepstep", "agent", "--termination-log")
    assert spec.argv[3] == str(termination_file("ns1", "p1")) != "/dev/termination-log"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"command": []}, "needs a command"),
        ({"envFrom": [{"configMapRef": {"name": "c"}}]}, "envFrom is not supported"),
        (
            {"env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
            "valueFrom secretKeyRef is not supported",
        ),
        (
            {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.hostname"}}}]},
            "fieldRef 'spec.hostname' is not supported; allowed: metadata.name",
        ),
    ],
)
def test_specs_the_node_cannot_run_are_refused_by_name(
    change: dict[str, Any], message: str
) -> None:
    p = pod()
    p["spec"]["containers"][0].update(change)
    with pytest.raises(PodSpecError, match=message.replace("(", r"\(").replace("[", r"\[")):
        process_spec(p, IP, {})


def test_expand_and_exit_codes() -> None:
    assert expand("$(A)$(B)$$x$(", {"A": "1"}) == "1$(B)$x$("
    assert exit_code(3) == 3
    assert exit_code(-signal.SIGKILL) == 137
    assert exit_code(-signal.SIGTERM) == 143


# -- decisions ---------------------------------------------------------------------------


def acts(p: dict[str, Any] | None, lp: LocalPod | None, now: float = 0.0, **kw: Any) -> list[Act]:
    return list(decide(p, lp, now, can_start=kw.get("can_start", True)).actions)


def test_a_bound_pod_starts_unless_the_node_cannot_start_pods() -> None:
    assert acts(pod(), None) == [Act.START]
    held = decide(pod(), None, 0.0, can_start=False)
    assert held.actions == () and "does not start" in held.reason
    assert acts(pod(status={"phase": "Succeeded"}), None) == []
    assert acts(pod(), local()) == []


def test_a_pod_that_ran_before_a_reboot_is_marked_lost() -> None:
    was = {"phase": "Running", "containerStatuses": [{"name": "main", "state": {"running": {}}}]}
    assert acts(pod(status=was), None) == [Act.MARK_LOST]


def test_deletion_sigterm_then_sigkill_after_grace_then_finalize() -> None:
    deleting = pod(deleting=5)
    assert acts(deleting, local()) == [Act.TERMINATE]
    sent = _mk(local(), {"term_sent_at": 10.0})
    assert acts(deleting, sent, now=14.9) == []
    assert acts(deleting, sent, now=15.0) == [Act.KILL]
    assert acts(deleting, _mk(sent, {"kill_sent": True}), now=20.0) == []
    assert acts(deleting, ended(143)) == [Act.FINALIZE]
    assert acts(deleting, None) == [Act.FINALIZE]


def test_grace_comes_from_the_deletion_then_the_pod_then_the_default() -> None:
    sent = _mk(local(), {"term_sent_at": 0.0})
    no_deletion_grace = pod(deleting=0, grace=3)
    del no_deletion_grace["metadata"]["deletionGracePeriodSeconds"]
    assert acts(no_deletion_grace, sent, now=2.9) == []
    assert acts(no_deletion_grace, sent, now=3.0) == [Act.KILL]
    del no_deletion_grace["spec"]["terminationGracePeriodSeconds"]
    assert acts(no_deletion_grace, sent, now=29.0) == []
    assert acts(no_deletion_grace, sent, now=30.0) == [Act.KILL]


def test_a_pod_gone_from_the_api_is_killed_then_forgotten() -> None:
    assert acts(None, local()) == [Act.KILL]
    assert acts(None, ended(137)) == [Act.FORGET]
    assert acts(None, None) == []


@pytest.mark.parametrize(
    ("policy", "code", "restarts"),
    [
        ("Never", 0, False),
        ("Never", 3, False),
        ("OnFailure", 0, False),
        ("OnFailure", 3, True),
        ("Always", 0, True),
    ],
)
def test_restart_policy(policy: str, code: int, restarts: bool) -> None:
    p = pod(restart=policy)
    done = ended(code, at=100.0)
    assert acts(p, done, now=100.0 + backoff_s(0) - 0.01) == []
    assert acts(p, done, now=100.0 + backoff_s(0)) == ([Act.START] if restarts else [])
    assert acts(p, done, now=1000.0, can_start=False) == []


def test_a_spec_error_is_never_retried() -> None:
    assert acts(pod(restart="Always"), ended(NEVER_RAN, retry=False), now=1e6) == []


def test_backoff_doubles_up_to_a_cap() -> None:
    assert [backoff_s(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


# -- pod status -------------------------------------------------------------------------


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}


def test_status_running_then_terminal() -> None:
    assert desired_status(pod(), None, IP) is None
    running = desired_status(pod(), local(), IP)
    assert running is not None
    assert running["phase"] == "Running"
    assert (running["podIP"], running["hostIP"], running["podIPs"]) == (IP, IP, [{"ip": IP}])
    assert conditions(running) == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    (cs,) = running["containerStatuses"]
    assert cs["state"] == {"running": {"startedAt": "2030-01-02T03:04:06Z"}}
    assert (cs["name"], cs["ready"], cs["restartCount"]) == ("main", True, 0)
    assert running["startTime"] == "2030-01-02T03:04:05Z"

    failed = desired_status(pod(), ended(3), IP)
    assert failed is not None and failed["phase"] == "Failed"
    assert conditions(failed)["Ready"] == "False"
    (cs,) = failed["containerStatuses"]
    assert cs["state"]["terminated"]["exitCode"] == 3
    assert cs["state"]["terminated"]["reason"] == "Error"
    succeeded = desired_status(pod(), ended(0), IP)
    assert succeeded is not None and succeeded["phase"] == "Succeeded"


def test_status_between_restarts_is_running_with_the_last_exit() -> None:
    waiting = desired_status(pod(restart="OnFailure"), ended(3), IP)
    assert waiting is not None and waiting["phase"] == "Running"
    (cs,) = waiting["containerStatuses"]
    assert cs["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert cs["lastState"]["terminated"]["exitCode"] == 3
    again = ended(3).with_start(43, T0 + timedelta(seconds=9))
    (cs,) = desired_status(pod(restart="OnFailure"), again, IP)["containerStatuses"]  # type: ignore[index]
    assert (cs["restartCount"], cs["containerID"]) == (1, "process://43")
    assert cs["lastState"]["terminated"]["exitCode"] == 3


def test_the_schedulers_pod_scheduled_condition_is_kept() -> None:
    when = "2030-01-01T00:00:00Z"
    scheduled = {
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": when}]
    }
    status = desired_status(pod(status=scheduled), local(), IP)
    assert status is not None
    assert status["conditions"][0] == {
        "type": "PodScheduled",
        "status": "True",
        "lastTransitionTime": when,
    }


def test_differs_matches_lists_by_type_or_name_and_ignores_extra_fields() -> None:
    desired = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "podIPs": [{"ip": IP}],
    }
    observed: dict[str, Any] = {
        "phase": "Running",
        "qosClass": "BestEffort",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastProbeTime": None},
            {"type": "Ready", "status": "True", "lastProbeTime": None},
        ],
        "podIPs": [{"ip": IP}],
    }
    assert not differs(desired, observed)
    observed["conditions"][1]["status"] = "False"  # the node controller marked it NotReady
    assert differs(desired, observed)
    assert differs(desired, {"phase": "Running", "podIPs": [{"ip": IP}]})
    assert differs({"podIPs": [{"ip": IP}]}, {"podIPs": []})


# -- the Node and its Lease ---------------------------------------------------------------


def config(**changes: Any) -> NodeConfig:
    return NodeConfig(Path("kc"), "node-a", IP, Path("w"), **changes)


def test_node_config_is_validated_with_the_bad_value_named() -> None:
    with pytest.raises(ValueError, match="name='Node_A' must be a DNS subdomain"):
        NodeConfig(Path("kc"), "Node_A", IP, Path("w"))
    with pytest.raises(ValueError, match="ip='localhost' must be an IPv4 address"):
        NodeConfig(Path("kc"), "node-a", "localhost", Path("w"))
    with pytest.raises(ValueError, match="heartbeat_s=0 must be > 0"):
        config(heartbeat_s=0)
    with pytest.raises(ValueError, match="lease_duration_s=2 must be >= 1 and longer"):
        config(lease_duration_s=2, heartbeat_s=2.0)
    with pytest.raises(ValueError, match=r"capacity\['cpu'\]='eight' is not a quantity"):
        config(capacity={"cpu": "eight", "memory": "1Gi", "pods": "1"})
    with pytest.raises(ValueError, match="needs a key and an effect"):
        config(taints=(("k", "v", "Sometimes"),))


def test_node_status_lease_and_taints() -> None:
    body = node_status_body(config(), T0, T0 - timedelta(minutes=1))["status"]
    assert body["capacity"] == body["allocatable"] == {"cpu": "8", "memory": "32Gi", "pods": "110"}
    assert {"type": "InternalIP", "address": IP} in body["addresses"]
    ready = {c["type"]: c for c in body["conditions"]}["Ready"]
    assert (ready["status"], ready["lastHeartbeatTime"]) == ("True", "2030-01-02T03:04:05Z")
    assert ready["lastTransitionTime"] == "2030-01-02T03:03:05Z"
    lease = lease_body(config(), T0, "node-uid")
    assert lease["metadata"]["namespace"] == "kube-node-lease"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "node-uid"
    assert lease["spec"]["renewTime"] == "2030-01-02T03:04:05.600000Z"
    assert node_body(config())["spec"] == {}
    tainted = node_body(config(taints=(("only", "me", "NoSchedule"),)))
    assert tainted["spec"]["taints"] == [{"key": "only", "value": "me", "effect": "NoSchedule"}]
    assert tainted["metadata"]["labels"]["kubernetes.io/hostname"] == "node-a"


# -- the node's process table (real local processes, no API server) -----------------------


def wait_until(probe: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def script_pod(code: str, uid: str = "u-1") -> dict[str, Any]:
    p = pod(command=[sys.executable, "-c", code])
    p["spec"]["containers"][0]["args"] = []
    p["metadata"]["uid"] = uid
    p["metadata"]["name"] = uid
    return p


@pytest.mark.slow
def test_processes_exit_codes_logs_and_start_errors(tmp_path: Path) -> None:
    procs = NodeProcesses(IP, tmp_path, {"PATH": "/usr/bin:/bin"}, tmp_path)
    procs.start("a", script_pod("import os; print(os.environ['PATH']); raise SystemExit(3)", "a"))
    missing = pod(command=["/no/such/program"])
    assert procs.start("b", missing).ended is not None
    bad = pod(command=[])
    assert procs.start("c", bad).ended is not None
    wait_until(lambda: procs.reap(time.monotonic()) or not procs.get("a").running)  # type: ignore[union-attr]
    table = procs.snapshot()
    assert table["a"].ended is not None and table["a"].ended.exit_code == 3
    assert (tmp_path / "ns1_a.log").read_text() == "/usr/bin:/bin\n"
    assert table["b"].ended is not None and table["b"].ended.reason == "StartError"
    assert table["c"].ended is not None
    assert (table["c"].ended.reason, table["c"].retry) == ("CreateContainerConfigError", False)


@pytest.mark.slow
def test_hang_stops_the_whole_group_and_kill_all_reaps_it(tmp_path: Path) -> None:
    procs = NodeProcesses(IP, tmp_path, {}, tmp_path)
    # The pod's process starts a child; both are in the pod's process group.
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(c.pid, flush=True); time.sleep(60)"
    )
    pid = procs.start("a", script_pod(code, "a")).pid
    assert pid is not None
    log = tmp_path / "ns1_a.log"
    wait_until(lambda: log.exists() and log.read_text().strip())
    child = int(log.read_text())
    procs.hang()
    wait_until(lambda: proc_state(pid) == "T" and proc_state(child) == "T")
    assert not procs.can_start
    procs.resume()
    wait_until(lambda: proc_state(pid) in ("S", "R") and proc_state(child) in ("S", "R"))
    procs.kill_all()
    assert proc_state(pid) is None  # reaped, not a zombie
    wait_until(lambda: proc_state(child) in (None, "Z"))
    procs.reap(time.monotonic())
    end = procs.get("a").ended  # type: ignore[union-attr]
    assert end is not None and end.exit_code == 137
    assert not procs.can_start


@pytest.mark.slow
def test_terminate_all_gives_sigterm_then_sigkill(tmp_path: Path) -> None:
    procs = NodeProcesses(IP, tmp_path, {}, tmp_path)
    handler = {"a": "lambda *a: exit(7)", "b": "signal.SIG_IGN"}
    for uid, how in handler.items():
        code = f"import signal, time; signal.signal(signal.SIGTERM, {how}); print('ok', flush=True)"
        procs.start(uid, script_pod(code + "; time.sleep(60)", uid))
    for log in (tmp_path / "ns1_a.log", tmp_path / "ns1_b.log"):
        wait_until(lambda log=log: log.exists() and log.read_text() == "ok\n")  # handler set
    began = time.monotonic()
    procs.terminate_all(timeout=1.0)
    assert time.monotonic() - began < 5.0
    procs.reap(time.monotonic())
    table = procs.snapshot()
    assert [table[u].ended.exit_code for u in ("a", "b")] == [7, 137]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ip", "localhost"], "ip='localhost' must be an IPv4 address"),
        (["--ip", IP, "--taint", "no-effect"], "--taint 'no-effect' is not KEY[=VALUE]:EFFECT"),
        (["--ip", IP, "--taint", "k=v:Sometimes"], "needs a key and an effect"),
    ],
)
def test_command_line_names_a_bad_argument(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from keepstep.e2e.noderunner import main

    args = ["--kubeconfig", str(tmp_path / "kc"), "--name", "n1", "--work-dir", str(tmp_path)]
    assert main([*args, *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_secret_volume_is_written_for_the_pod_and_its_mount_path_rewritten(
    tmp_path: Path,
) -> None:
    mount = "/etc/keepstep/etcd-tls"
    code = "import os, sys; print(open(os.environ['CREDS'] + '/tls.crt').read(), sys.argv[1])"
    p = script_pod(code, "s")
    container = p["spec"]["containers"][0]
    container["args"] = [f"{mount}/ca.crt"]
    container["env"] = [{"name": "CREDS", "value": mount}]
    container["volumeMounts"] = [{"name": "creds", "mountPath": mount, "readOnly": True}]
    p["spec"]["volumes"] = [
        {"name": "creds", "secret": {"secretName": "job-tls"}},
        {"name": "unused", "secret": {"secretName": "other"}},  # mounted by no container
    ]
    store: dict[tuple[str, str], dict[str, bytes]] = {}
    asked: list[tuple[str, str]] = []

    def read(namespace: str, name: str) -> dict[str, bytes] | None:
        asked.append((namespace, name))
        return store.get((namespace, name))

    procs = NodeProcesses(IP, tmp_path, {"PATH": "/usr/bin:/bin"}, tmp_path, read_secret=read)
    # As the kubelet: no Secret yet, no process, and the pod is not taken on.
    assert procs.start("s", p).pid is None and procs.get("s") is None
    store[("ns1", "job-tls")] = {"tls.crt": b"CERT", "../escape": b"x"}
    assert procs.start("s", p).pid is not None
    wait_until(lambda: procs.reap(time.monotonic()) or not procs.get("s").running)  # type: ignore[union-attr]
    folder = tmp_path / "volumes" / "ns1_s" / "creds"
    assert (tmp_path / "ns1_s.log").read_text() == f"CERT {folder}/ca.crt\n"
    assert sorted(p.name for p in folder.iterdir()) == ["tls.crt"]  # a key is a name, never a path
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert set(asked) == {("ns1", "job-tls")}
