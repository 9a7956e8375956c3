"""Draining a node whose member stays too slow: whether the job can spare it, then the drain.

Where it sits: a worker whose member the speed fold found too slow for long enough sends
`SlowDrain` over the link (`keepstep.elastic.slow_drain` decides that, on every member
alike, and only the slowest member asks). `node/requests` hands it to `SlowDrains.handle`,
which decides with the pure `admit` and, if the node may go, drains it the way SIGTERM
does (`NodeAgent.drain`: a `leaving` record, the change announced in the next commit, the
node gone at the boundary after it, nothing rolled back). Every request yields one
`drain-slow` event, drained or refused, with the measured speed ratio and the reason.

A node with several workers leaves whole: the slow member's node is drained. The guard
counts nodes, not members: after this node and every node already leaving are gone, at
least `min_nodes` (and at least one) must remain, so a slow drain never ends the job or
takes it below its minimum. A node drains once (`draining`): a second request, from the
same or another of its workers, is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection

from keepstep.agent.node.view import JobView
from keepstep.agent.protocol import EpochRecord, node_of
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.agent.protocol.messages import SlowDrain

__all__ = ["SlowDrains", "admit"]


def admit(
    node: str,
    member: str,
    current: EpochRecord | None,
    leaving: Collection[str],
    min_nodes: int,
    draining: bool,
) -> tuple[bool, str]:
    """Whether `node` may be drained because its `member` is too slow, and why (pure)."""
    if draining:
        return False, f"node {node} is draining already"
    if current is None or member not in current.members:
        epoch = "no epoch yet" if current is None else f"epoch {current.epoch}"
        return False, f"{member} is not a member of the current epoch ({epoch})"
    if node_of(member) != node:
        return False, f"{member} is not a worker of node {node}"
    stay = [n for n in current.nodes() if n != node and n not in leaving]
    need = max(min_nodes, 1)
    if len(stay) < need:
        return False, (
            f"draining {node} would leave {len(stay)} node(s) of epoch {current.epoch} "
            f"({', '.join(stay) or 'none'}); the job needs at least {need}"
        )
    return True, f"drain {node}: {len(stay)} node(s) stay (at least {need} needed)"


class SlowDrains:
    """Acts on `SlowDrain` requests for one node: decide, record, drain."""

    def __init__(
        self,
        node: str,
        min_nodes: int,
        view: JobView,
        events: EventLog,
        draining: Callable[[], bool],
        drain: Callable[[str], None],
    ) -> None:
        """`draining()`: whether the node drains already; `drain(cause)`: drain it."""
        self.node, self.min_nodes, self.view, self.events = node, min_nodes, view, events
        self.draining, self.drain = draining, drain
        self._lock = threading.Lock()  # one decision at a time: a node is drained once

    def handle(self, request: SlowDrain) -> None:
        with self._lock:
            seen = self.view.observe()
            ok, why = admit(
                self.node,
                request.member,
                seen.current,
                seen.leaving,
                self.min_nodes,
                self.draining(),
            )
            self.events.write(
                EventKind.DRAIN_SLOW,
                member=request.member,
                node=self.node,
                epoch=request.epoch,
                step=request.step,
                ratio=request.ratio,
                drained=ok,
                reason=f"{request.reason}; {why}",
            )
            if ok:
                self.drain("drain-slow")
