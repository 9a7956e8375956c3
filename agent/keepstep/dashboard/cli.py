"""`keepstep dashboard`: serve the dashboard until interrupted.

    keepstep dashboard --run-dir runs/ [--port 8050] [--kubeconfig ~/.kube/config]

`--run-dir` is one run directory or a folder of them (`runs/`, where `keepstep run`
puts them); with `--kubeconfig` the page also lists the cluster's TrainJobs. The server
binds 127.0.0.1 only: the page shows job internals and has no authentication.
"""

from __future__ import annotations

import argparse
import errno
import sys
import threading
from pathlib import Path
from typing import Any

from keepstep.dashboard.server import DashboardApp, DashboardServer
from keepstep.dashboard.trainjobs import KubeTrainJobs, TrainJobsError
from keepstep.errors import ConfigError


def register(sub: Any) -> None:
    """Add the `dashboard` subcommand to the `keepstep` parser's subparsers."""
    parser = sub.add_parser(
        "dashboard",
        help="web page for live and finished runs",
        description="Serve a page (on 127.0.0.1 only) with throughput, world size, recoveries "
        "and goodput of the runs under --run-dir, until Ctrl-C.",
    )
    parser.add_argument(
        "--run-dir", default="runs", help="a run directory, or a folder of them (default: runs)"
    )
    parser.add_argument(
        "--port", type=int, default=8050, help="the port to serve on; 0 picks a free one [8050]"
    )
    parser.add_argument("--kubeconfig", help="also list the TrainJobs of this cluster")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.set_defaults(func=_cmd_dashboard)


def _cmd_dashboard(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    root = Path(args.run_dir)
    if not root.is_dir():
        raise ConfigError(f"--run-dir {root}: not a directory (a run directory or runs/)")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} must be between 0 and 65535")
    trainjobs: KubeTrainJobs | None = None
    if args.kubeconfig:
        try:
            trainjobs = KubeTrainJobs(Path(args.kubeconfig), args.context)
        except TrainJobsError as error:  # a kubeconfig that does not load is a bad argument
            raise ConfigError(str(error)) from None
    try:
        server = DashboardServer(DashboardApp(root, trainjobs), port=args.port).start()
    except OSError as error:
        if trainjobs is not None:
            trainjobs.close()
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port {args.port} is in use (another dashboard?): give a free port, or "
                "--port 0 for any"
            ) from None
        if error.errno == errno.EACCES:
            raise ConfigError(f"--port {args.port}: not allowed (below 1024 needs root)") from None
        raise
    print(f"keepstep dashboard: {server.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    stop = stop or threading.Event()
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a dashboard is meant to end
    finally:
        server.stop()
        if trainjobs is not None:
            trainjobs.close()
    return 0
