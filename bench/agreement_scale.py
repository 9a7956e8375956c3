"""Agreement at scale: a node's loss to every agent in the new epoch, on a real etcd.

    scripts/env python bench/agreement_scale.py [--sizes 10,100,1000] [--losses 3]
        [--procs 4] [--deciders 0] [--clients agent|process|shared] [--lease-ttl 10]
        [--json FILE]

Each simulated agent runs the agent's own membership code, nothing re-implemented: its
leased node record (`Registration`), its watched view of the job (`JobView` fed by an
`EtcdKV` watch), its probe server (`ProbeServer`) and the failure decision (`Healer.failure`:
probes, `agreement.after_failure`, compare-and-set of the epoch). Workers are simulated:
when an agent's view sees a member node's record deleted, its "worker" reports a failed
collective at once (as the agent's abort of the epoch's store makes a real one do).
`--procs` processes host the agents (`--clients agent`: one etcd client each, as on a
cluster; `process`: one per process, each agent still with its own lease and watch;
`shared`: one client and one watched `JobView` per process, shared by its agents, each
still with its own lease, probe server and healer: every agent's view of the job's keys is
the same data, so one copy stands for all, and a process's watch deliveries are counted
once per agent it hosts; only deciders' workers run, the others' wait is the view's).

A loss: the victim's probe server closes (a dead process refuses connections), its
keepalive stops and its lease is revoked, which deletes its record the way an expiry
would. Timed from the revoke, so the lease TTL (or the 0.5 s heartbeat) that detection
adds on a cluster is not in the figure. Counted per loss from etcd's /metrics: raft
proposals (every write request, failed compare-and-sets included), keys written, watch
events sent; and the watch events the agents received. `--deciders K`: only K agents'
workers decide (probe and compare-and-set); the others' wait for the agreed epoch, as
those that come late do. 0: all of them, as when every worker's collective fails at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agreement_io import METRICS, REPLY_TIMEOUT_S, Child, scrape, summarize, table
from keepstep.agent import protocol
from keepstep.agent.kv import KVStore, WatchEvent
from keepstep.agent.kv.etcd import EtcdKV
from keepstep.agent.node import agreement
from keepstep.agent.node.config import AgentConfig
from keepstep.agent.node.healer import Healer, stamp
from keepstep.agent.node.probe import ProbeServer
from keepstep.agent.node.registration import Registration
from keepstep.agent.node.view import JobView
from keepstep.agent.protocol import NodeRecord, key
from keepstep.agent.protocol.events import EventLog
from keepstep.launch.etcd_binary import find_etcd
from keepstep.launch.etcd_server import EtcdServer


def node_name(index: int) -> str:
    return f"n{index:05d}"


class Watcher:
    """A watched view of the job (`JobView` fed by an `EtcdKV` watch) and what it got;
    `on_lost(epoch)` runs when a member node's record goes. One per agent, or one per
    host process shared by its agents (`--clients shared`: every agent's view of the
    job's keys is the same data, so one copy stands for them all)."""

    def __init__(
        self, cfg: AgentConfig, kv: KVStore, node: str, on_lost: Callable[[int], None]
    ) -> None:
        self.cfg, self.kv, self.on_lost = cfg, kv, on_lost
        self.view = JobView(cfg.job, node)
        self.entered: dict[int, float] = {}  # epoch -> monotonic time the view got it
        self.events = 0  # watch events delivered
        self.cancel: Callable[[], None] = lambda: None

    def start(self) -> None:
        """As `NodeAgent.start`: watch the job's keys, then load what is there already."""
        job = self.cfg.job
        self.cancel = self.kv.watch_prefix(
            protocol.job_prefix(job), self._on_watch, below=protocol.watched_below(job)
        )
        for found in self.kv.get_prefix(protocol.job_prefix(job), self.cfg.op_timeout):
            self._apply(WatchEvent("put", found.key, found.value, found.mod_revision))

    def _on_watch(self, event: WatchEvent) -> None:
        self.events += 1
        self._apply(event)

    def _apply(self, event: WatchEvent) -> None:
        change = self.view.apply(event)
        if change.new_epoch is not None:
            self.entered[change.new_epoch.epoch] = time.monotonic()
        cur = self.view.current
        if change.lost_node is not None and cur is not None:
            self.on_lost(cur.epoch)


class SimAgent:
    """One node's membership code with a simulated worker (one member per node)."""

    def __init__(
        self, cfg: AgentConfig, kv: KVStore, own_kv: bool, decider: bool, shared: Watcher | None
    ) -> None:
        self.cfg, self.kv, self.own_kv, self.decider = cfg, kv, own_kv, decider
        self.member = protocol.member_id(cfg.node, 0)
        self.own_watch = shared is None
        self.watcher = shared or Watcher(cfg, kv, cfg.node, self.lost)
        self.events = EventLog(cfg.run_dir / f"events-{cfg.node}.jsonl")
        self.probe = ProbeServer(self._status, cfg.host)
        self.registration = Registration(
            kv, key(cfg.job, "nodes", cfg.node), cfg.lease_ttl, cfg.op_timeout, self._record
        )
        view = self.watcher.view
        self.healer = Healer(cfg, kv, view, self.events, self.registration, lambda: False)
        self.errors: list[str] = []

    def _status(self) -> dict[str, Any]:
        return {"node": self.cfg.node, "ready": [self.member], "draining": False}

    def _record(self) -> NodeRecord:
        return NodeRecord(self.cfg.node, self.cfg.host, self.probe.port, os.getpid())

    def register(self) -> None:
        self.registration.register()

    def watch(self) -> None:
        if self.own_watch:
            self.watcher.start()

    def lost(self, epoch: int) -> None:
        threading.Thread(target=self._worker_fails, args=(epoch,), daemon=True).start()

    def _worker_fails(self, epoch: int) -> None:
        """The simulated worker: its collective failed in `epoch`; it asks for the next."""
        try:
            if self.decider:
                self.healer.failure(self.member, epoch, 0, "collective failed: a peer is gone")
            else:
                self.watcher.view.wait_epoch_after(epoch, self.cfg.epoch_timeout)
        except Exception as error:
            self.errors.append(f"{self.cfg.node}: {error!r}")

    def crash(self) -> float:
        """Die as a crashed node does (its probe port refuses, its lease goes); returns
        when the revoke that deletes its record was sent (monotonic)."""
        self.probe.close()
        lease = self.registration.lease
        self.registration.stop()
        if self.own_watch:
            self.watcher.cancel()
        started = time.monotonic()
        if lease is not None:
            lease.revoke()
        if self.own_kv:
            self.kv.close()
        self.events.close()
        return started


class Host:
    """The agents of one process, driven by JSON commands (from stdin, or in-process)."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = opts
        shared = None if opts["clients"] == "agent" else EtcdKV(opts["etcd"], opts["op_timeout"])
        self.shared = shared
        self.agents: dict[str, SimAgent] = {}
        self.watcher: Watcher | None = None
        run_dir = Path(opts["run_dir"])
        for index in opts["indices"]:
            names = ("job", "etcd", "lease_ttl", "probe_timeout", "epoch_timeout", "op_timeout")
            cfg = AgentConfig(
                node=node_name(index), script="", run_dir=run_dir, heartbeat_timeout=0.0,
                **{name: opts[name] for name in names},
            )  # fmt: skip
            if opts["clients"] == "shared" and self.watcher is None:
                assert shared is not None
                # Named after no node, so no loss is its own; it wakes this host's deciders.
                self.watcher = Watcher(cfg, shared, f"host-{index}", self._lost)
            kv = shared or EtcdKV(opts["etcd"], opts["op_timeout"])
            decider = opts["deciders"] == 0 or index < opts["deciders"]
            self.agents[cfg.node] = SimAgent(cfg, kv, shared is None, decider, self.watcher)

    def _lost(self, epoch: int) -> None:
        for agent in list(self.agents.values()):
            if agent.decider:
                agent.lost(epoch)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "register":
            for agent in self.agents.values():
                agent.register()
        elif op == "watch":
            if self.watcher is not None:
                self.watcher.start()
            for agent in self.agents.values():
                agent.watch()
        elif op == "crash":
            return {"t": self.agents.pop(cmd["node"]).crash()}
        elif op == "wait":
            return self._wait(cmd["epoch"], set(cmd["lost"]), cmd["timeout"])
        elif op == "close":
            for agent in self.agents.values():
                agent.crash()
            if self.watcher is not None:
                self.watcher.cancel()
            if self.shared is not None:
                self.shared.close()
        return {}

    def _wait(self, epoch: int, lost: set[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            views = [a.watcher.view.current for a in self.agents.values()]
            if all(cur and cur.epoch >= epoch for cur in views):
                break
            time.sleep(0.02)
        out: dict[str, Any] = {"entered": {}, "digests": {}, "lost_in": [], "events": {}}
        for node, agent in self.agents.items():
            cur = agent.watcher.view.current
            # Shared: the host's deliveries stand for each of its agents' own.
            out["events"][node] = agent.watcher.events
            out["errors"] = out.get("errors", []) + agent.errors
            if cur is None or cur.epoch != epoch:
                out["digests"][node] = f"epoch {cur.epoch if cur else None}"
                continue
            out["entered"][node] = agent.watcher.entered[epoch]
            out["digests"][node] = hashlib.sha1(",".join(cur.members).encode()).hexdigest()
            if any(protocol.node_of(m) in lost for m in cur.members):
                out["lost_in"].append(node)
        return out


def child_main(opts: dict[str, Any]) -> None:
    """A host process: one JSON command a line on stdin, one JSON answer a line on stdout."""
    host = Host(opts)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        print(json.dumps(host.handle(cmd)), flush=True)
        if cmd["op"] == "close":
            return


def run_size(etcd: EtcdServer, n: int, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Start `n` agents, agree epoch 0, lose `args.losses` nodes one at a time."""
    job = f"scale-{n}"
    procs = max(1, min(args.procs, n))
    names = ("clients", "lease_ttl", "probe_timeout", "epoch_timeout", "op_timeout")
    base = {name: getattr(args, name) for name in names} | {
        "etcd": etcd.endpoint, "job": job, "run_dir": str(run_dir),
        "deciders": min(args.deciders, n - args.losses),
    }  # fmt: skip
    groups = [list(range(p, n, procs)) for p in range(procs)]
    where = {node_name(i): g for g, indices in enumerate(groups) for i in indices}
    started = time.monotonic()
    if args.procs == 0:  # in this process (the test): a host answers at once
        hosts = [Host({**base, "indices": list(range(n))})]
        where = dict.fromkeys(where, 0)

        def send(cmd: dict[str, Any], to: list[int] | None = None) -> list[dict[str, Any]]:
            return [hosts[0].handle(cmd)]
    else:
        children = [Child(__file__, {**base, "indices": g}) for g in groups]

        def send(cmd: dict[str, Any], to: list[int] | None = None) -> list[dict[str, Any]]:
            chosen = [children[i] for i in (range(len(children)) if to is None else to)]
            for child in chosen:
                child.send(cmd)
            return [child.answer(REPLY_TIMEOUT_S) for child in chosen]

    def say(what: str) -> None:  # progress on stderr, for runs that stall
        print(f"[{n} agents, {time.monotonic() - started:7.1f} s] {what}", file=sys.stderr)

    kv = EtcdKV(etcd.endpoint, args.op_timeout)
    try:
        send({"op": "register"})
        say("registered")
        send({"op": "watch"})
        say("watching")
        nodes = {
            r.key.rpartition("/")[2]: protocol.decode(NodeRecord, r.value)
            for r in kv.get_prefix(protocol.prefix(job, "nodes"), args.op_timeout)
        }
        members = [protocol.member_id(node, 0) for node in nodes]
        first, _ = agreement.first_epoch(members, n, n, 0.0, 0.0, time.time())
        assert first is not None and len(nodes) == n, f"{len(nodes)} of {n} registered"
        assert kv.create(key(job, "epoch"), protocol.encode(stamp(first, nodes)), args.op_timeout)
        check(send({"op": "wait", "epoch": 0, "lost": [], "timeout": args.epoch_timeout}), n, [])
        setup_s = time.monotonic() - started
        say("all in epoch 0")
        rng = random.Random(args.seed)
        candidates = [node_name(i) for i in range(base["deciders"] or 0, n)] or list(where)
        lost: list[str] = []
        losses = []
        for epoch in range(1, args.losses + 1):
            victim = rng.choice([c for c in candidates if c not in lost])
            before_wait = send({"op": "wait", "epoch": epoch - 1, "lost": lost, "timeout": 1.0})
            seen = {node: c for r in before_wait for node, c in r["events"].items()}
            before = scrape(etcd.metrics_endpoint)
            t_loss = send({"op": "crash", "node": victim}, [where[victim]])[0]["t"]
            lost.append(victim)
            replies = send(
                {"op": "wait", "epoch": epoch, "lost": lost, "timeout": args.epoch_timeout}
            )
            entered = check(replies, n - len(lost), lost)
            say(f"all survivors in epoch {epoch}")
            time.sleep(0.3)  # let etcd's counters settle
            after = scrape(etcd.metrics_endpoint)
            delays = sorted(t - t_loss for t in entered)
            received = sum(c - seen[node] for r in replies for node, c in r["events"].items())
            counted = {k: after[k] - before[k] for k in METRICS}
            losses.append(
                {"victim": victim, "p50_s": statistics.median(delays), "max_s": delays[-1],
                 "events_received": received, **counted}
            )  # fmt: skip
        send({"op": "close"})
    finally:
        kv.delete_prefix(protocol.job_prefix(job), args.op_timeout)
        kv.close()
        if args.procs != 0:
            for child in children:
                child.stop()
    return summarize(n, procs, base["deciders"], setup_s, losses)


def check(replies: list[dict[str, Any]], survivors: int, lost: list[str]) -> list[float]:
    """Every survivor is in one and the same epoch, which names no lost node."""
    digests: dict[str, str] = {}
    entered: list[float] = []
    for reply in replies:
        digests.update(reply["digests"])
        entered.extend(reply["entered"].values())
        assert not reply["lost_in"], f"epoch names a lost node at {reply['lost_in'][:5]}"
        assert not reply.get("errors"), f"agent errors: {reply['errors'][:3]}"
    assert len(digests) == survivors, f"{len(digests)} agents answered, {survivors} expected"
    assert len(set(digests.values())) == 1, f"agents disagree: {sorted(set(digests.values()))}"
    assert len(entered) == survivors, f"{len(entered)} of {survivors} entered the epoch"
    return entered


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000", help="agent counts, comma-separated")
    parser.add_argument("--losses", type=int, default=3, help="nodes lost one at a time, per size")
    parser.add_argument("--procs", type=int, default=4, help="host processes (0: this one)")
    parser.add_argument("--deciders", type=int, default=0, help="0: every survivor decides")
    parser.add_argument("--clients", choices=["agent", "process", "shared"], default="agent")
    parser.add_argument("--lease-ttl", type=float, default=10.0)
    parser.add_argument("--probe-timeout", type=float, default=2.0)
    parser.add_argument("--epoch-timeout", type=float, default=120.0)
    parser.add_argument("--op-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = find_etcd(os.environ)
    results = []
    with tempfile.TemporaryDirectory(prefix="keepstep-scale-") as tmp:
        with EtcdServer.start(binary, Path(tmp) / "etcd") as etcd:
            for n in [int(s) for s in args.sizes.split(",")]:
                run_dir = Path(tmp) / f"run-{n}"
                run_dir.mkdir()
                results.append(run_size(etcd, n, args, run_dir))
                print(table(results[-1:]), flush=True)
    report = {"cores": os.cpu_count(), "args": vars(args), "results": results}
    print(json.dumps(report, indent=1, default=str))
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
