"""The real Kubernetes control plane of the end-to-end tests, on loopback.

Where it sits: tests/e2e/conftest.py starts one per test session; `e2e/cluster up` starts
one that outlives the command (`detach=True`) and records its processes in state.json.
The binaries are the ones `e2e/controlplane/build` compiled from source (cached).

Start order, each step waiting for the one before: etcd (/health) -> kube-apiserver
(/readyz) -> kube-controller-manager and kube-scheduler together; start() returns once the
`default` ServiceAccount exists, which proves the controller-manager's controllers run.
Nothing but the API server listens: the controller-manager and scheduler run with
--secure-port=0. The node-lifecycle settings are short so that a lost node goes NotReady
within seconds and its pods are evicted soon after (the defaults take minutes).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from keepstep.e2e import kubeconfig as kc
from keepstep.e2e import procs
from keepstep.e2e.procs import ProcessRecord, StartupError

REPO = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO / "e2e" / "controlplane" / "build"
# helm is not part of the control plane: the chart's tests (tests/manifests) render with it.
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "helm",
)
# Stopped in this order: clients of the API server first, etcd last.
_STOP_STAGES = (("kube-scheduler", "kube-controller-manager"), ("kube-apiserver",), ("etcd",))

Popen = subprocess.Popen[bytes]


def build_binaries(timeout: float = 1800.0) -> Path:
    """Run e2e/controlplane/build (a no-op once cached) and return its bin folder."""
    try:
        done = subprocess.run(
            [str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise StartupError("e2e/controlplane/build", str(err)) from err
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise StartupError(
            "e2e/controlplane/build", f"exited with {done.returncode}:\n{done.stderr[-3000:]}"
        )
    bin_dir = Path(lines[-1])
    missing = [name for name in BINARIES if not (bin_dir / name).exists()]
    if missing:
        raise StartupError("e2e/controlplane/build", f"{bin_dir} lacks {', '.join(missing)}")
    return bin_dir


def etcd_argv(binary: Path, data_dir: Path, name: str, client: int, peer: int) -> list[str]:
    """A one-member etcd on loopback. The short heartbeat and election timeout keep its
    shortest lease at 1 s; no fsync, because a test cluster's data may die with it."""
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    return [
        str(binary),
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={name}={peer_url}",
        "--heartbeat-interval=50",
        "--election-timeout=500",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def etcd_healthy(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/health", timeout=1.0) as response:
            return b'"health":"true"' in response.read()
    except OSError:
        return False  # not listening yet, or no leader yet (503)


class ControlPlane:
    """A running control plane; `kubeconfig` is its admin kubeconfig."""

    def __init__(
        self,
        work_dir: Path,
        bin_dir: Path,
        access: kc.AdminAccess,
        on_start: Callable[[ProcessRecord, Popen], None] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.bin_dir = bin_dir
        self.access = access
        self.kubeconfig = work_dir / "kubeconfig"
        self.startup_seconds: dict[str, float] = {}  # per step, for the startup figures
        self._records: list[ProcessRecord] = []
        self._popens: dict[int, Popen] = {}
        self._on_start = on_start

    @classmethod
    def start(
        cls,
        work_dir: Path,
        *,
        timeout: float = 120.0,
        node_monitor_grace_period: int = 10,
        toleration_seconds: int = 5,
        detach: bool = False,
        bin_dir: Path | None = None,
        on_start: Callable[[ProcessRecord, Popen], None] | None = None,
    ) -> ControlPlane:
        """Start everything in `work_dir` (logs: <component>.log) and wait until it serves.

        A Node whose heartbeats stop goes NotReady after `node_monitor_grace_period`
        seconds; its pods are evicted `toleration_seconds` later. With `detach` the
        processes outlive this Python process (stop them by their records); without it
        they are stopped when the object is collected or the interpreter exits.
        `on_start(record, popen)` sees each process as soon as it runs (`e2e/cluster`
        records it at once).
        Raises StartupError naming the component that failed, with its log tail.
        """
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
        if node_monitor_grace_period < 2:
            raise ValueError(f"node_monitor_grace_period={node_monitor_grace_period} must be >= 2")
        if toleration_seconds < 0:
            raise ValueError(f"toleration_seconds={toleration_seconds} must be >= 0")
        began = time.monotonic()
        deadline = began + timeout
        bin_dir = bin_dir or build_binaries()
        work_dir = work_dir.resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
        # The API server writes this file on start; the port is filled in once it is known.
        ca_file = work_dir / "certs" / "apiserver.crt"
        access = kc.AdminAccess("https://127.0.0.1:0", kc.new_token(), ca_file)
        cp = cls(work_dir, bin_dir, access, on_start)
        if not detach:
            weakref.finalize(cp, _stop_quietly, cp._records, cp._popens)
        try:
            cp._start_all(deadline, node_monitor_grace_period, toleration_seconds)
        except BaseException:
            cp.stop()
            raise
        cp.startup_seconds["total"] = round(time.monotonic() - began, 2)
        return cp

    @property
    def processes(self) -> tuple[ProcessRecord, ...]:
        """The processes started, in start order (etcd, apiserver, controller-manager, ...)."""
        return tuple(self._records)

    @property
    def pids(self) -> dict[str, int]:
        return {r.name: r.pid for r in self._records}

    @property
    def server(self) -> str:
        return self.access.server

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 60.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this control plane; `check` raises on failure."""
        done = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, done.args, done.stdout, done.stderr
            )
        return done

    def wait_for_service_account(self, namespace: str, *, timeout: float = 30.0) -> None:
        """Wait until the controller-manager made `namespace`'s default ServiceAccount; a
        pod created before that is refused by the ServiceAccount admission plugin."""
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/default"
        procs.wait_ready(
            self._watched(),
            lambda: self.access.get(path, timeout=2.0)[0] == 200,
            deadline=time.monotonic() + timeout,
            what=f"the default ServiceAccount of namespace {namespace!r}",
        )

    def wait_for_crds(self, names: Sequence[str], *, timeout: float = 30.0) -> None:
        """Wait until each CustomResourceDefinition in `names` (e.g.
        "trainjobs.keepstep.dev") is Established and its resources can be listed.

        Polled here, not with `kubectl wait --for=condition=Established`: kubectl fails at
        once ("accessor error: <nil>") when it reads a CRD before the API server wrote its
        first conditions, which a loaded machine makes likely; and a list can still be
        refused (429, "storage is (re)initializing") just after.
        """
        crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"

        def served(name: str) -> bool:
            status, body = self.access.get(f"{crds}/{name}", timeout=2.0)
            if status != 200:
                return False
            crd = json.loads(body)
            conditions = (crd.get("status") or {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return False
            spec = crd["spec"]
            version = next(v["name"] for v in spec["versions"] if v.get("served"))
            path = f"/apis/{spec['group']}/{version}/{spec['names']['plural']}?limit=1"
            return self.access.get(path, timeout=2.0)[0] == 200

        procs.wait_ready(
            self._watched(),
            lambda: all(served(name) for name in names),
            deadline=time.monotonic() + timeout,
            what=f"the CustomResourceDefinitions {', '.join(names)} to be served",
        )

    def stop(self, timeout: float = 15.0) -> None:
        """Stop what start() started, by PID: API clients, then the API server, then etcd."""
        for stage in _STOP_STAGES:
            procs.stop(
                [r for r in self._records if r.name in stage], timeout=timeout, popens=self._popens
            )

    def _watched(self) -> list[tuple[ProcessRecord, Popen]]:
        return [(r, self._popens[r.pid]) for r in self._records if r.pid in self._popens]

    def _add(self, record: ProcessRecord, popen: Popen) -> None:
        self._records.append(record)
        self._popens[record.pid] = popen
        if self._on_start is not None:
            self._on_start(record, popen)

    def _took(self, step: str, began: float) -> None:
        self.startup_seconds[step] = round(time.monotonic() - began, 2)

    def _start_all(self, deadline: float, grace: int, toleration: int) -> None:
        began = time.monotonic()
        d, b = self.work_dir, self.bin_dir
        kc.write_service_account_keys(d / "sa.key", d / "sa.pub")
        kc.write_token_file(d / "tokens.csv", self.access.token)
        self._took("keys", began)

        began = time.monotonic()
        record, popen, (etcd_port, _) = procs.start_on_free_ports(
            "etcd",
            lambda p: etcd_argv(b / "etcd", d / "etcd", "cp", p[0], p[1]),
            2,
            d / "etcd.log",
            ready=lambda p: etcd_healthy(p[0]),
            deadline=deadline,
            what="etcd /health",
        )
        self._add(record, popen)
        self._took("etcd", began)

        began = time.monotonic()

        def on_port(ports: list[int]) -> kc.AdminAccess:
            return replace(self.access, server=f"https://127.0.0.1:{ports[0]}")

        def apiserver_ready(ports: list[int]) -> bool:
            status, body = on_port(ports).get("/readyz", timeout=2.0)
            return status == 200 and body.strip() == b"ok"

        record, popen, ports = procs.start_on_free_ports(
            "kube-apiserver",
            lambda p: [
                str(b / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={p[0]}",
                f"--cert-dir={d / 'certs'}",
                f"--token-auth-file={d / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={d / 'sa.pub'}",
                f"--service-account-signing-key-file={d / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                f"--default-not-ready-toleration-seconds={toleration}",
                f"--default-unreachable-toleration-seconds={toleration}",
                "--profiling=false",
                # The flow-control bootstrap costs a few seconds of startup on a busy machine
                # and a test cluster has no tenants to protect from each other.
                "--enable-priority-and-fairness=false",
                # The `kubernetes` Service cannot point at a loopback address; nothing in a
                # test cluster uses it, so do not log a failed reconcile every 10 s.
                "--endpoint-reconciler-type=none",
            ],
            1,
            d / "kube-apiserver.log",
            ready=apiserver_ready,
            deadline=deadline,
            what="kube-apiserver /readyz",
            watched=self._watched(),
        )
        self.access = on_port(ports)
        self._add(record, popen)
        self._took("kube-apiserver", began)
        kc.write_kubeconfig(self.kubeconfig, self.access)

        began = time.monotonic()
        common = [
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
        ]
        controllers = [
            str(b / "kube-controller-manager"),
            *common,
            f"--service-account-private-key-file={d / 'sa.key'}",
            f"--root-ca-file={self.access.ca_file}",
            "--node-monitor-period=1s",
            f"--node-monitor-grace-period={grace}s",
            "--node-startup-grace-period=30s",
            # Taint (and so evict from) lost nodes at once, not one node per 10 s.
            "--node-eviction-rate=10",
            "--secondary-node-eviction-rate=10",
        ]
        # The controller-manager goes last: a timeout below is blamed on the last one.
        for name, argv in (
            ("kube-scheduler", [str(b / "kube-scheduler"), *common]),
            ("kube-controller-manager", controllers),
        ):
            record, popen = procs.spawn(name, argv, d / f"{name}.log")
            self._add(record, popen)
        self.wait_for_service_account("default", timeout=max(deadline - time.monotonic(), 0.1))
        self._took("controllers", began)


def _stop_quietly(records: list[ProcessRecord], popens: dict[int, Popen]) -> None:
    try:
        for stage in _STOP_STAGES:
            procs.stop([r for r in records if r.name in stage], timeout=5.0, popens=popens)
    except procs.ProcessError:
        pass  # best effort at interpreter exit
