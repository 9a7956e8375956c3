"""`python -m keepstep.e2e.chaos run SCENARIO.yaml --report PATH`: a chaos scenario in
cluster mode.

Where it sits: the cluster-mode twin of `keepstep chaos run` (which runs scenarios on
this machine with `keepstep run`). It takes the same scenario files and arguments, starts
a cluster of its own in `--work-dir` (a real control plane, an etcd for the jobs,
in-process node runners, the CRD and the operator: chaos_env.py), runs every run of the
scenario as a TrainJob on it (chaos_cluster.py), compares each with the same job run
locally without faults (cached, shared with local mode through `--reference-cache`),
writes the same report and stops the cluster. It lives with the end-to-end
infrastructure because the product never imports it. Exit status: 0 when every
invariant held (or the scenario was skipped), 1 when one was violated, 2 for a scenario
or job that cannot run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from keepstep.chaos.cli import add_run_arguments, run_and_report
from keepstep.chaos.local import LocalTarget
from keepstep.chaos.runner import ChaosError
from keepstep.chaos.scenario import load_scenario
from keepstep.chaos.schedule import expand
from keepstep.e2e.chaos_cluster import ClusterTarget, nodes_needed
from keepstep.e2e.chaos_env import ChaosCluster, ChaosClusterError
from keepstep.e2e.procs import ProcessError
from keepstep.errors import KeepstepError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keepstep.e2e.chaos", description=__doc__.split("\n")[0]
    )
    verbs = parser.add_subparsers(dest="command", required=True)
    run = verbs.add_parser("run", help="run one scenario file on a local cluster")
    add_run_arguments(run)
    run.add_argument(
        "--nodes", type=int, help="nodes of the cluster (default: the job's, plus spares)"
    )
    run.add_argument(
        "--work-dir",
        type=Path,
        help="the cluster's control plane, logs and nodes (default: <run dir>/cluster)",
    )
    args = parser.parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
        nodes = args.nodes or nodes_needed(scenario.job, expand(scenario))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.run_dir = args.run_dir or f"runs/chaos-cluster-{scenario.name}-{stamp}"
        work_dir = args.work_dir or Path(args.run_dir) / "cluster"

        def start() -> ChaosCluster:
            print(f"chaos: starting a cluster of {nodes} nodes in {work_dir}", file=sys.stderr)
            return ChaosCluster.start(work_dir, nodes)

        target = ClusterTarget(start)
        try:
            return run_and_report(scenario, args, target, reference_target=LocalTarget())
        finally:
            if target.started is not None:
                target.started.close()
    except (ChaosError, ChaosClusterError, ProcessError) as error:
        print(f"chaos (cluster): {error}", file=sys.stderr)
        return 2
    except KeepstepError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
