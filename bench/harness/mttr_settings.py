"""bench/mttr.py's job and fault spacing (`Settings`) and the flags that set them.

bench/mttr.py, mttr_matrix.py, torchrun_baseline.py and ray_train_mttr.py share them
(through bench/mttr.py, which re-exports every name here).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp.py"  # the default script, the only one with --sleep


# An agent restarts a crashed worker at most AgentConfig.max_restarts times in a row
# (`keepstep run` has no flag for it); each worker is killed at most this often per run,
# with time to rejoin in between, so no worker is ever given up.
WORKER_RESTARTS = 3


@dataclass(frozen=True)
class Settings:
    """One benchmark job and its fault schedule. Steps are counted in committed steps."""

    nodes: int = 4
    global_batch: int = 96
    micro_batch: int = 4
    seed: int = 0
    min_nodes: int = 2
    sleep: float = 0.01
    node_spacing: int = 55  # steps between node losses: ~6 s, about what a joiner needs
    worker_spacing: int = 25
    join_after: int = 0
    first_step: int = 10
    faults_per_run: int = 11  # node losses per run (each brings a join)
    tail_steps: int = 20
    run_timeout: float = 300.0
    shard: str | None = None  # `keepstep run --shard`: None keeps full replicas
    script: str = str(MLP)  # the training script (a str, so the settings dump to JSON)
    script_args: tuple[str, ...] = ()  # passed to the script after the job's own flags

    @property
    def takes_sleep(self) -> bool:
        """--sleep is examples/mlp.py's flag: another script would reject it."""
        return Path(self.script).resolve() == MLP

    def script_argv(self, sleep: float | None = None) -> list[str]:
        """The script and its arguments, as the tail of `keepstep run`'s command line."""
        argv = [self.script, *self.script_args]
        if self.takes_sleep:
            argv += ["--sleep", str(self.sleep if sleep is None else sleep)]
        return argv

    def __post_init__(self) -> None:
        if self.nodes < 2:  # a node loss must leave one to train on
            raise ValueError(f"--nodes {self.nodes} must be >= 2")
        if not Path(self.script).is_file():
            raise ValueError(f"--script {self.script}: no such file")
        n_micro, rest = divmod(self.global_batch, self.micro_batch)
        if self.micro_batch < 1 or rest:
            raise ValueError(
                f"--global-batch {self.global_batch} must be a multiple of --micro-batch "
                f"{self.micro_batch} (>= 1)"
            )
        if self.faults_per_run < 1 or self.nodes + self.faults_per_run > n_micro:
            raise ValueError(
                f"{self.nodes} nodes + {self.faults_per_run} joins need as many micro-batches; "
                f"--global-batch {self.global_batch} / --micro-batch {self.micro_batch} gives "
                f"{n_micro}: --faults-per-run must be 1..{n_micro - self.nodes}"
            )
        if not 0 <= self.join_after < self.node_spacing:
            raise ValueError(
                f"--join-after {self.join_after} must be >= 0 and below --node-spacing "
                f"{self.node_spacing}"
            )
        if self.worker_spacing < 1:
            raise ValueError(f"--worker-spacing {self.worker_spacing} must be >= 1")
        if not 2 <= self.min_nodes <= self.nodes:
            raise ValueError(f"--min-nodes {self.min_nodes} must be between 2 and --nodes")

    def per_run(self, kind: str, count: int) -> int:
        """Faults of `kind` in one run when `count` are still wanted."""
        cap = self.nodes * WORKER_RESTARTS if kind == "kill-worker" else self.faults_per_run
        return max(1, min(cap, count))

    def steps(self, kind: str, count: int) -> int:
        spacing = self.worker_spacing if kind == "kill-worker" else self.node_spacing
        return self.first_step + self.per_run(kind, count) * spacing + self.tail_steps


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--sleep", type=float, default=d.sleep, help="s per micro-batch")
    parser.add_argument("--global-batch", type=int, default=d.global_batch)
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch)
    parser.add_argument("--faults-per-run", type=int, default=d.faults_per_run)
    parser.add_argument("--node-spacing", type=int, default=d.node_spacing, help="steps")
    parser.add_argument("--worker-spacing", type=int, default=d.worker_spacing, help="steps")
    parser.add_argument("--join-after", type=int, default=d.join_after, help="steps")
    parser.add_argument("--workdir", help="keep run directories here (default: a temp dir)")
    parser.add_argument("--shard", choices=["zero1", "zero2"], help="shard the optimizer state")


def script_path(value: str) -> str:
    """--script: a file, as given or relative to the repository (an argparse type)."""
    for path in (Path(value), REPO / value):
        if path.is_file():
            return str(path.resolve())
    raise argparse.ArgumentTypeError(f"{value!r}: no such file (nor under {REPO})")


def node_count(value: str) -> int:
    """--nodes: an int >= 2, since a node loss must leave a node (an argparse type)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"{n}: nodes must be >= 2")
    return n


def add_job_args(parser: argparse.ArgumentParser) -> None:
    """The job's shape: node count and training script. Apart from add_settings_args,
    which bench/torchrun_baseline.py shares with a torchrun job of its own fixed shape."""
    d = Settings()
    parser.add_argument("--nodes", type=node_count, default=d.nodes, help="nodes at start")
    parser.add_argument("--script", type=script_path, default=d.script, help="training script")
    parser.add_argument(
        "--script-args",
        type=shlex.split,
        default=list(d.script_args),
        help="the script's own arguments, one string split as a shell would: "
        '--script-args "--layers 2" (a lone flag: --script-args=--flag)',
    )


def settings_from(args: argparse.Namespace) -> Settings:
    d = Settings()
    return replace(
        d,
        # The job's shape, where the parser has add_job_args; else the default job.
        nodes=getattr(args, "nodes", d.nodes),
        script=getattr(args, "script", d.script),
        script_args=tuple(getattr(args, "script_args", d.script_args)),
        sleep=args.sleep,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        faults_per_run=args.faults_per_run,
        node_spacing=args.node_spacing,
        worker_spacing=args.worker_spacing,
        join_after=args.join_after,
        shard=args.shard,
    )
