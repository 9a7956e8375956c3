"""What holding a due step for the node agent costs a worker, and whether any step is lost.

A worker (this process) commits a state of ``--gib`` GiB to a snapshot file every step,
with ``--step-ms`` of other work between commits (the copy overlaps it), and holds every
``--every``-th step (``SnapshotStore.hold``), as a member whose snapshot a durable
checkpoint reads does. An agent (a second process, as on a node) is told of each due step
``--agent-delay-ms`` after its commit (a busy agent), exports it from the file
(``keepstep.agent.node.durable.export_step``, which releases it) and reports how long that
took. The agent exports into memory it keeps between due steps (``ExportBuffers``, handed
back at once here: as if storage took each checkpoint before the next one was due), or into
fresh memory each time with ``--fresh``. Prints one JSON object:

    export_s, export_gb_s     the agent's export of one due step (copy out and verify),
                              the median over the due steps after the first
    first_export_s            the first one's: into fresh memory either way
    held_s                    per due step: how long the worker's second commit after it
                              waited for the release (its cost to the training loop)
    missed                    due steps the agent found gone (0 with the hold)

    scripts/env python bench/checkpoint_hold.py [--gib 1] [--step-ms 100] [--every 4]
        [--steps 24] [--agent-delay-ms 0] [--dir /dev/shm] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore

T = 120.0


def agent(path: str, delay_s: float, fresh: bool, steps: Connection, results: Connection) -> None:
    """The node agent's side: export each due step it is told of, after `delay_s`."""
    from keepstep.agent.node.durable import ExportBuffers, export_step

    buffers = ExportBuffers()
    results.send("ready")
    while (step := steps.recv()) is not None:
        time.sleep(delay_s)
        lease = buffers.lease("n0/0")
        t0 = time.perf_counter()
        blob = export_step(Path(path), step, alloc=None if fresh else lease.alloc)
        results.send((step, time.perf_counter() - t0, None if blob is None else len(blob)))
        del blob
        lease.release()
    results.send(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--agent-delay-ms", type=float, default=0.0)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--fresh", action="store_true", help="no memory kept between exports")
    args = parser.parse_args()
    if args.gib <= 0 or args.every < 1 or args.steps < 2 * args.every:
        parser.error("--gib must be > 0, --every >= 1 and --steps >= 2 x --every")
    state = {"w": torch.randn(int(args.gib * 2**30) // 4)}
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        path = Path(where) / "snapshot"
        buffer = FileBuffer.create(path)
        store = SnapshotStore(buffer)
        ctx = mp.get_context("spawn")
        to_agent, steps = ctx.Pipe()
        results, from_agent = ctx.Pipe()
        proc = ctx.Process(
            target=agent,
            args=(str(path), args.agent_delay_ms / 1e3, args.fresh, steps, from_agent),
        )
        proc.start()
        assert results.recv() == "ready"  # its imports are not what a running agent pays
        held: dict[int, float] = {}
        due: list[int] = []
        for step in range(1, args.steps + 1):
            state["w"].add_(1.0)
            store.commit(step, state, b"meta", timeout=T)
            if step - 2 in due:  # this commit took the due step's slot, once released
                held[step - 2] = store.held_s
            if step % args.every == 0:
                store.hold(step, T)
                due.append(step)
                to_agent.send(step)
            time.sleep(args.step_ms / 1e3)  # the next step's work; the copy overlaps it
            store.wait(T)
            print(f"step {step} committed (held {store.held_s:.3f} s)", file=sys.stderr)
        to_agent.send(None)
        exports = []
        while (result := results.recv()) is not None:
            exports.append(result)
        proc.join(T)
        store.close()
        buffer.close()
    found = [(s, n) for _, s, n in exports if n is not None]
    later = [s for s, _ in found[1:]] or [float("nan")]
    export_s = statistics.median(later)
    nbytes = max((n for _, n in found), default=0)
    print(
        json.dumps(
            {
                "gib": args.gib,
                "step_ms": args.step_ms,
                "every": args.every,
                "agent_delay_ms": args.agent_delay_ms,
                "fresh": args.fresh,
                "due": due,
                "first_export_s": round(found[0][0], 4) if found else None,
                "export_s": round(export_s, 4),
                "export_gb_s": round(nbytes / export_s / 1e9, 2),
                "held_s": {step: round(s, 4) for step, s in held.items()},
                "missed": [step for step, _, n in exports if n is None],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
