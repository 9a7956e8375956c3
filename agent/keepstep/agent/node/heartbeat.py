"""Heartbeats between neighbouring node agents: a stopped node is found in about half a second.

Where it sits: the agent runs one `HeartbeatMonitor`. It watches the nodes beside its own on
the ring of the current epoch's nodes (sorted; the one before and the one after, so every
node has two watchers) and asks each one's probe port (probe.py) every `interval`. A node
that has not answered for `bound` seconds, times the epoch's timeout_scale, is reported
once per epoch: the agent aborts the epoch with cause "heartbeat-missed", and the healer
removes the node if it misses its one probe too, without the second, longer one (these
missed heartbeats were that second chance). The node's etcd lease stays the backstop: it is at
least 1 s, which is why a stopped node took 1.2-1.4 s to find with the lease alone.

False alarms: a watcher that was itself stopped or starved of CPU would see every peer
silent for as long as it was. So silence is counted only over time the watcher ran: when
its own loop falls behind by more than half the bound, it forgets what it measured and
starts again. A node that is only slow (3x CPU throttling) still answers well within the
bound, since an answer is one JSON line from the agent's probe thread. A false alarm costs
an epoch change that loses nothing, which doubles the epoch's timeout_scale (agreement.py),
and with it this bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from keepstep.agent.node.probe import ProbeResult, probe_all
from keepstep.agent.protocol import EpochRecord, NodeRecord

log = logging.getLogger("keepstep.agent.heartbeat")

__all__ = ["HeartbeatMonitor", "Silence", "neighbours"]


def neighbours(me: str, nodes: Sequence[str]) -> tuple[str, ...]:
    """The nodes `me` watches: the ones before and after it on the sorted ring of `nodes`
    (one when there are two nodes, none when `me` is alone or not among them)."""
    ring = sorted(set(nodes))
    if me not in ring or len(ring) < 2:
        return ()
    i = ring.index(me)
    return tuple(sorted({ring[i - 1], ring[(i + 1) % len(ring)]}))


@dataclass
class Silence:
    """How long each watched node has been silent, counted only while the watcher ran.

    A pure fold over probe rounds (`round` with the clock passed in), so tests drive it
    with a fake clock.
    """

    bound: float  # seconds of silence that make a node lost (before timeout_scale)
    stall: float  # a round that starts this much later than expected resets the counts
    last_ok: dict[str, float] = field(default_factory=dict)
    reported: dict[str, int] = field(default_factory=dict)  # node -> epoch it was reported in
    _expected: float | None = None  # when the next round should start at the latest

    def round(
        self,
        started: float,
        ended: float,
        results: Mapping[str, ProbeResult],
        epoch: int,
        scale: float,
        attempt: float,
        next_in: float,
    ) -> list[tuple[str, float]]:
        """Fold one round of probes (sent in parallel at `started`, each bounded by
        `attempt` seconds, all done by `ended`; the next round due `next_in` after it) and
        say which nodes to report now, with how long each was silent."""
        late = self._expected is not None and started - self._expected > self.stall
        # Probes run in parallel, so a round longer than one attempt means this thread
        # was not running for part of it.
        stalled = late or ended - started > attempt + self.stall
        self._expected = ended + next_in
        for node in list(self.last_ok):
            if node not in results:
                del self.last_ok[node]  # no longer watched: start afresh if it comes back
        if stalled:
            # This watcher did not run for a while: it cannot tell what it missed.
            for node in results:
                self.last_ok[node] = ended
            return []
        lost = []
        for node, result in sorted(results.items()):
            first = self.last_ok.setdefault(node, started)
            if result.alive:
                self.last_ok[node] = ended
                continue
            silent = ended - first
            if silent >= self.bound * scale and self.reported.get(node) != epoch:
                self.reported[node] = epoch
                lost.append((node, silent))
        return lost

    def silent(self, now: float, scale: float) -> list[str]:
        """The watched nodes silent for at least the bound as of `now`."""
        return sorted(n for n, t in self.last_ok.items() if now - t >= self.bound * scale)


class HeartbeatMonitor:
    """Probes this node's ring neighbours every `interval` on its own thread.

    `observe` returns the current epoch and the live node records (the job view);
    `on_lost(epoch, node, silent_s)` is called once per epoch for a node silent for the
    bound. `silent_nodes()` is what the healer asks before it gives a suspect a second,
    longer probe.
    """

    def __init__(
        self,
        node: str,
        observe: Callable[[], tuple[EpochRecord | None, Mapping[str, NodeRecord]]],
        on_lost: Callable[[EpochRecord, str, float], None],
        bound: float,
        interval: float = 0.1,
    ) -> None:
        if not bound > 0 or not interval > 0:
            raise ValueError(f"heartbeat bound={bound!r} and interval={interval!r} must be > 0 s")
        self.node, self._observe, self._on_lost = node, observe, on_lost
        self.interval = interval
        # One attempt waits at most half the bound: a hung node misses two, a connection
        # lost on the way costs one attempt, not the node.
        self.attempt = max(bound / 2, 0.05)
        self._silence = Silence(bound, stall=bound / 2)
        self._lock = threading.Lock()
        self._scale = 1.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.attempt + 1.0)

    def silent_nodes(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._silence.silent(time.monotonic(), self._scale))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._round()
            except Exception:  # the monitor must outlive any one bad round
                log.exception("heartbeat round failed")

    def _round(self) -> None:
        epoch, nodes = self._observe()
        if epoch is None:
            return
        scale = epoch.timeout_scale
        targets = {
            n: (nodes[n].host, nodes[n].probe_port)
            for n in neighbours(self.node, epoch.nodes())
            if n in nodes and nodes[n].probe_port
        }
        started = time.monotonic()
        results = probe_all(targets, self.attempt * scale)
        ended = time.monotonic()
        with self._lock:
            self._scale = scale
            lost = self._silence.round(
                started, ended, results, epoch.epoch, scale, self.attempt * scale, self.interval
            )
        for node, silent in lost:
            self._on_lost(epoch, node, silent)
