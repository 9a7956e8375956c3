"""`python -m keepstep.operator`: the TrainJob operator (the only place it reads the
environment or its command line).

    python -m keepstep.operator --etcd URL [--namespace NS ...] [--kubeconfig PATH]
        [--standalone | --peering NAME] [--lost-pod-grace S] [--below-min-grace S]
        [--pending-grace S] [--backoff-limit N] [--failure-window S]
        [--backoff-base S] [--backoff-max S] [--resync S] [--api-timeout S] [--health URL]
        [--metrics URL] [--agent-env NAME=VALUE ...]
        [--etcd-ca-secret NS/NAME [--etcd-server-secret NAME --etcd-server-names DNS,...]]
        [--verbose]

It runs kopf (with its liveness endpoint at --health URL when given: the pod's liveness
and readiness probes) and, unless --peering names a peering object, as a
standalone operator (one replica), and with --metrics URL serves its Prometheus metrics
there (`metrics`). Each --agent-env NAME=VALUE is a default of every agent container's
environment, for the jobs whose trainer.env does not set NAME (`agent_defaults`). Without
--namespace it watches every namespace (the cluster-wide install, manifests/rbac.yaml);
with it, only the namespaces named (repeat the flag, or separate them with commas),
needing nothing cluster-scoped (the namespaced install, manifests/namespaced/).
Credentials: --kubeconfig, else the pod's service account when running in a cluster, else
the default kubeconfig.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import kopf

from keepstep.operator.agent_defaults import AGENT_ENV_NAMES, parse_agent_env
from keepstep.operator.agents import AgentStore
from keepstep.operator.connection import Connection, load_connection
from keepstep.operator.errors import OperatorError
from keepstep.operator.handlers import Runtime, build_registry
from keepstep.operator.kube import Kube, KubeError
from keepstep.operator.metrics import Metrics, MetricsServer
from keepstep.operator.reconcile import Reconciler
from keepstep.operator.settings import DecideConfig, OperatorSettings

if TYPE_CHECKING:
    from keepstep.agent.kv.etcd import EtcdKV
    from keepstep.operator.etcd_access import JobAccess


def parse_args(argv: Sequence[str] | None = None) -> tuple[OperatorSettings, bool]:
    """The settings, and whether to log verbosely."""
    parser = argparse.ArgumentParser(
        prog="python -m keepstep.operator",
        description="The keepstep TrainJob operator.",
    )
    parser.add_argument("--etcd", required=True, help="job etcd client URL, given to agents")
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch only these namespaces (repeat, or NS1,NS2; default: all)",
    )
    parser.add_argument("--kubeconfig", help="default: in-cluster, else ~/.kube/config")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--standalone", action="store_true", help="no peering (the default)")
    group.add_argument("--peering", metavar="NAME", help="take part in kopf peering NAME")
    parser.add_argument(
        "--lost-pod-grace",
        type=float,
        default=15.0,
        metavar="S",
        help="a running job's pod whose agent record is missing this long is replaced (15)",
    )
    parser.add_argument(
        "--agent-start-grace",
        type=float,
        default=120.0,
        metavar="S",
        help="a running pod whose agent never registered this long is replaced (120)",
    )
    parser.add_argument(
        "--below-min-grace",
        type=float,
        default=120.0,
        metavar="S",
        help="a running job with fewer than minNodes live agents this long fails (120)",
    )
    parser.add_argument(
        "--pending-grace",
        type=float,
        default=300.0,
        metavar="S",
        help="a pod Pending this long is lost (a TrainJob's failurePolicy may say otherwise) (300)",
    )
    parser.add_argument(
        "--backoff-limit",
        type=int,
        default=6,
        metavar="N",
        help="pod failures of one cause a job survives within the window (6)",
    )
    parser.add_argument(
        "--failure-window",
        type=float,
        default=600.0,
        metavar="S",
        help="pod failures older than this are forgotten (600)",
    )
    parser.add_argument(
        "--backoff-base",
        type=float,
        default=1.0,
        metavar="S",
        help="pod creation after the n-th failure waits base * 2^(n-1) seconds (1)",
    )
    parser.add_argument(
        "--backoff-max", type=float, default=300.0, metavar="S", help="at most this long (300)"
    )
    parser.add_argument(
        "--resync", type=float, default=5.0, metavar="S", help="reconcile at least this often (5)"
    )
    parser.add_argument(
        "--api-timeout", type=float, default=10.0, metavar="S", help="per API request (10)"
    )
    parser.add_argument(
        "--health",
        metavar="URL",
        help="serve liveness/readiness at this URL, e.g. http://0.0.0.0:8080/healthz (none)",
    )
    parser.add_argument(
        "--metrics",
        metavar="URL",
        help="serve Prometheus metrics at this URL, e.g. http://0.0.0.0:8081/metrics (none)",
    )
    parser.add_argument(
        "--agent-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a default of every agent container's environment, for jobs whose trainer.env "
        f"does not set NAME (repeat; NAME one of {', '.join(AGENT_ENV_NAMES)})",
    )
    parser.add_argument(
        "--etcd-ca-secret",
        metavar="NS/NAME",
        help="the job etcd's CA Secret (made if missing): TLS to etcd and an etcd user and "
        "client-certificate Secret per TrainJob (none: plain etcd, for development)",
    )
    parser.add_argument(
        "--etcd-server-secret",
        metavar="NAME",
        help="with --etcd-ca-secret: make the etcd members' server certificate Secret NAME "
        "in the CA's namespace if missing, for --etcd-server-names (none: made elsewhere)",
    )
    parser.add_argument(
        "--etcd-server-names",
        metavar="DNS,...",
        default="",
        help="the DNS names the etcd members' certificate is valid for",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logs, kopf's included")
    args = parser.parse_args(argv)
    try:
        settings = OperatorSettings(
            etcd=args.etcd,
            namespaces=tuple(n for arg in args.namespace for n in arg.split(",") if n),
            kubeconfig=args.kubeconfig,
            lost_pod_grace_s=args.lost_pod_grace,
            below_min_grace_s=args.below_min_grace,
            agent_start_grace_s=args.agent_start_grace,
            pending_grace_s=args.pending_grace,
            backoff_limit=args.backoff_limit,
            failure_window_s=args.failure_window,
            backoff_base_s=args.backoff_base,
            backoff_max_s=args.backoff_max,
            resync_s=args.resync,
            api_timeout_s=args.api_timeout,
            standalone=args.peering is None,
            peering=args.peering,
            health=args.health,
            metrics=args.metrics,
            etcd_ca_secret=args.etcd_ca_secret,
            etcd_server_secret=args.etcd_server_secret,
            etcd_server_names=tuple(n for n in args.etcd_server_names.split(",") if n),
            agent_env=parse_agent_env(args.agent_env),
        )
    except OperatorError as error:
        parser.error(str(error))
    return settings, bool(args.verbose)


def main(argv: Sequence[str] | None = None) -> int:
    settings, verbose = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # kopf reports every handler call at INFO; our reconciles say what they changed.
        logging.getLogger("kopf").setLevel(logging.WARNING)
    in_cluster = settings.kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    try:
        connection = load_connection(settings.kubeconfig, in_cluster)
    except Exception as error:  # the client's loader raises its own assorted types
        print(f"keepstep.operator: no Kubernetes credentials: {error}", file=sys.stderr)
        return 2
    metrics = Metrics()
    try:  # before anything else starts: a taken port ends the operator at once
        server = serve_metrics(settings, metrics)
    except OSError as error:
        print(f"keepstep.operator: --metrics {settings.metrics}: {error}", file=sys.stderr)
        return 1
    try:
        return operate(settings, connection, metrics)
    finally:
        if server is not None:
            server.stop()


def operate(settings: OperatorSettings, connection: Connection, metrics: Metrics) -> int:
    """Connect to etcd and run kopf until the operator is stopped; the exit status."""
    kube = Kube(connection, settings.api_timeout_s, settings.create_parallelism, metrics=metrics)
    try:
        kv, access = connect_etcd(settings, kube)
    except (KubeError, ValueError) as error:
        print(f"keepstep.operator: the job etcd's CA: {error}", file=sys.stderr)
        return 1
    agents = AgentStore(kv, settings.etcd_timeout_s)
    runtime = Runtime(
        settings=settings,
        connection=connection,
        reconciler=Reconciler(kube, agents, DecideConfig.of(settings), access=access),
        agents=agents,
        access=access,
        metrics=metrics,
    )
    try:
        kopf.run(
            registry=build_registry(),
            memo=runtime,
            standalone=settings.standalone,
            peering_name=settings.peering,
            liveness_endpoint=settings.health,
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
        )
    except KubeError as error:
        print(f"keepstep.operator: {error}", file=sys.stderr)
        return 1
    finally:
        kv.close()
    return 0


def serve_metrics(settings: OperatorSettings, metrics: Metrics) -> MetricsServer | None:
    """The --metrics endpoint, started (None without the flag); OSError if it cannot bind."""
    endpoint = settings.metrics_endpoint
    if endpoint is None:
        return None
    server = MetricsServer(metrics.registry, endpoint.host, endpoint.port, endpoint.path)
    return server.start()


def connect_etcd(settings: OperatorSettings, kube: Kube) -> tuple[EtcdKV, JobAccess | None]:
    """The operator's etcd client: plain, or (with --etcd-ca-secret) TLS as the root user,
    with the `JobAccess` that gives each job its own user and Secret."""
    # Imported here: the etcd client's import is heavy, and --help should not wait for it.
    from keepstep.agent.kv.etcd import EtcdKV
    from keepstep.operator.etcd_access import EtcdAuthority, JobAccess

    if settings.etcd_ca_secret is None:
        return EtcdKV(settings.etcd, timeout=settings.etcd_timeout_s), None
    namespace, name = settings.etcd_ca_secret.split("/")
    authority = EtcdAuthority.load_or_create(kube, namespace, name)
    if settings.etcd_server_secret:
        authority.ensure_server_secret(
            kube, namespace, settings.etcd_server_secret, settings.etcd_server_names
        )
    root = authority.root_credentials()
    kv = EtcdKV(settings.etcd, timeout=settings.etcd_timeout_s, credentials=root)
    return kv, JobAccess(authority, kube, kv)


if __name__ == "__main__":
    sys.exit(main())
