"""Membership decisions: pure functions from what an agent observed to the next epoch.

Each returns the proposed `EpochRecord` (or None for "no change") and a reason that
tests and logs read. Agents apply a decision with a compare-and-set on the epoch key, so
when two agents decide at once exactly one proposal wins and everyone adopts it.

Missing state: a sharded job's epoch can fail on entering because its members lack
optimizer state none of them holds (its holder's worker is restarting, or a double fault
took an owner and its replica). Then the next epoch must admit a worker from outside it
(`newcomers`), not repeat the same members; the healer waits for one, bounded. When none
can come (`state_holders_gone`) or none came in time, the next epoch's members all resume
from the durable checkpoint (`after_failure`'s ``fallback``: `EpochRecord.checkpoint_step`).

Backing off: a timeout that fired while nothing was lost (every member answered the
probes and is still ready) was a false alarm, most likely a machine too loaded to answer
within the default bounds. Retrying the same bounds could fire again forever, so the next
epoch doubles its `timeout_scale` (the store and collective timeouts of the workers, up to
`MAX_TIMEOUT_SCALE` times their defaults). A real loss or a planned change keeps the scale:
the machine is as loaded as before.

Split brain: a node cut off from the others by the network still reaches etcd, and its
probes of the others time out as a hung node's would. Deciding from its side it would
remove everyone else. So an agent decides after a failure only if the nodes that answered
it are a majority of the epoch's nodes not known dead (`minority`); otherwise the others
decide, or, if they are gone, their leases expire and the count changes. A node that
stays cut off never decides: the nodes it cannot reach hold leases, so they reach etcd.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from keepstep.agent.node.probe import ProbeResult
from keepstep.agent.protocol import EpochRecord, NodeRecord, member_id, node_of

# The longest a false alarm can stretch the epoch's timeouts: 16 x the 2 s store bound is
# 32 s, past which a store that does not answer is taken as gone whatever the load.
MAX_TIMEOUT_SCALE = 16.0


def first_epoch(
    pending: Collection[str],
    expected_members: int,
    min_members: int,
    waited_s: float,
    grace_s: float,
    now: float,
) -> tuple[EpochRecord | None, str]:
    """Epoch 0: all expected workers are waiting, or enough of them after the grace period."""
    members = sorted(pending)
    if len(members) >= expected_members:
        return EpochRecord(0, members, "all nodes ready", 0, now), "all nodes ready"
    if len(members) >= min_members and waited_s >= grace_s:
        reason = f"{len(members)} of {expected_members} workers ready after {waited_s:.0f} s"
        return EpochRecord(0, members, reason, 0, now), reason
    return None, f"waiting: {len(members)} of {expected_members} workers ready"


def at_boundary(
    current: EpochRecord,
    pending: Collection[str],
    leaving_nodes: Collection[str],
    done: int,
    now: float,
) -> tuple[EpochRecord | None, str]:
    """A planned change at a step boundary: admit waiting workers, let drained nodes go."""
    leaving = set(leaving_nodes)
    stay = [m for m in current.members if node_of(m) not in leaving]
    admit = [m for m in pending if m not in current.members and node_of(m) not in leaving]
    members = sorted({*stay, *admit})
    if members == sorted(current.members):
        return None, "no change"
    if not members:
        return None, "every node is leaving: the job ends with this epoch"
    parts = []
    if admit:
        parts.append("admit " + ",".join(sorted(admit)))
    gone = sorted(set(current.members) - set(members))
    if gone:
        parts.append("drain " + ",".join(gone))
    reason = "; ".join(parts)
    record = EpochRecord(
        current.epoch + 1, members, reason, done, now, timeout_scale=current.timeout_scale
    )
    return record, reason


def newcomers(
    current: EpochRecord, pending: Collection[str], leaving_nodes: Collection[str]
) -> list[str]:
    """Workers waiting to be admitted that are not members of ``current`` (restarted
    workers, joiners), on nodes that stay."""
    leaving = set(leaving_nodes)
    return sorted(m for m in pending if m not in current.members and node_of(m) not in leaving)


def after_failure(
    current: EpochRecord,
    probes: Mapping[str, ProbeResult],
    pending: Collection[str],
    leaving_nodes: Collection[str],
    done: int,
    now: float,
    missing_state: bool = False,
    fallback: tuple[int, str] | None = None,
) -> tuple[EpochRecord | None, str]:
    """The survivors of a failed epoch, plus ready joiners, minus draining nodes.

    A member stays if its node answered the probe and offers that worker as ready.
    ``missing_state``: the epoch failed because its members lack sharded state that none
    of them holds; only a worker from outside it can bring it, so without a ready one
    there is no next epoch (None), and the timeouts stay (nothing timed out).
    ``fallback``: (step, why) no worker can bring it (a double fault took every holder),
    so the next epoch's members all resume from the durable checkpoint of that step.
    """
    leaving = set(leaving_nodes)

    def ready(member: str) -> bool:
        result = probes.get(node_of(member))
        return result is not None and result.alive and member in result.ready

    survivors = [m for m in current.members if ready(m) and node_of(m) not in leaving]
    joiners = [m for m in pending if ready(m) and node_of(m) not in leaving]
    members = sorted({*survivors, *joiners})
    lost = sorted(set(current.members) - set(survivors))
    details = [
        f"{node}: {probes[node].detail}"
        for node in sorted({node_of(m) for m in lost})
        if node in probes and probes[node].detail
    ]
    reason = (
        "lost "
        + (",".join(lost) if lost else "nothing")
        + (f" ({'; '.join(details)})" if details else "")
    )
    if not members:
        return None, reason + "; no worker left to train"
    checkpoint_step = -1
    if missing_state:
        admitted = sorted(set(members) - set(current.members))
        if fallback is not None:
            checkpoint_step, why = fallback
            reason += (
                f"; sharded state lost ({why}): all resume from the durable checkpoint "
                f"of step {checkpoint_step}"
            )
        elif not admitted:
            return None, reason + "; sharded state is missing and no other worker is ready"
        else:
            reason = f"{reason}; admit {','.join(admitted)} for the missing sharded state"
    scale = current.timeout_scale
    if not lost and not missing_state and scale < MAX_TIMEOUT_SCALE:
        scale = min(scale * 2, MAX_TIMEOUT_SCALE)
        reason += f"; timeouts raised to {scale:g}x (a timeout fired while all answered)"
    record = EpochRecord(
        current.epoch + 1,
        members,
        reason,
        done,
        now,
        timeout_scale=scale,
        checkpoint_step=checkpoint_step,
    )
    return record, reason


def state_holders_gone(
    current: EpochRecord, nodes: Collection[str], nproc: int, pending: Collection[str]
) -> bool:
    """Whether no worker could bring sharded state ``current`` lacks: none is waiting to
    be admitted, and every worker of every live node (``nodes``: those with a record,
    ``nproc`` workers each) is a member already. A worker outside the epoch on a live
    node may be restarting from the snapshot its node kept; a dead node's snapshots went
    with it, and a joiner brings none."""
    if any(m not in current.members for m in pending):
        return False
    return not outside_nodes(current, nodes, nproc)


def outside_nodes(current: EpochRecord, nodes: Collection[str], nproc: int) -> list[str]:
    """The nodes among ``nodes`` with a worker (of ``nproc`` each) that ``current`` lacks."""
    members = set(current.members)
    return sorted(n for n in nodes if any(member_id(n, r) not in members for r in range(nproc)))


def minority(current: EpochRecord, probes: Mapping[str, ProbeResult]) -> str | None:
    """Why this agent must leave the decision after a failure to the others (None: it may
    decide). Of the epoch's nodes, those that refused the probe (killed) or are gone from
    etcd (lease expired: not in `probes`) are dead and not counted; of the rest, those that
    answered must be more than half, or exactly half with the first of them in order (a
    tie between two halves has one winner)."""
    nodes = sorted(current.nodes())
    answered = [n for n in nodes if n in probes and probes[n].alive]
    silent = [n for n in nodes if n in probes and probes[n].timed_out]
    counted = sorted({*answered, *silent})
    if 2 * len(answered) > len(counted) or (
        2 * len(answered) == len(counted) and counted and counted[0] in answered
    ):
        return None
    quiet = f" ({', '.join(silent)} silent)" if silent else ""
    return (
        f"{len(answered)} of the epoch's {len(counted)} live nodes answered{quiet}: cut off "
        "from most of them, this node leaves the decision to the others"
    )


def suspects(probes: Mapping[str, ProbeResult], silent: Collection[str] = ()) -> list[str]:
    """Nodes to probe again before they are blamed: those that let the probe time out.

    A killed node refuses the connection at once; a node that accepted but did not answer
    in time is hung, or only slow on a loaded machine. Its lease in etcd is still alive
    (a node whose lease expired is not probed at all), so it gets a second, longer chance,
    unless it is `silent`: this agent's heartbeats found it silent for their whole bound
    already, which was that chance.
    """
    return sorted(
        node for node, result in probes.items() if result.timed_out and node not in silent
    )


def not_offered(record: EpochRecord, node: str, offered: Collection[str]) -> list[str]:
    """The members of `record` on `node` that this node does not offer as ready.

    An epoch is agreed from probes, and a probe can answer before its agent has learned
    that a worker died (a loaded machine runs the agent's threads late). Such an epoch
    names a process that is gone: its rendezvous would wait until a cold replacement has
    started (seconds). The agent ends it at once instead, so that the survivors agree the
    next epoch without that member, and the replacement is admitted when it is ready.
    """
    return [m for m in record.members if node_of(m) == node and m not in offered]


def with_store(record: EpochRecord, nodes: Mapping[str, NodeRecord]) -> EpochRecord:
    """Name the store the epoch rendezvouses on: the one of its first node that has a live
    record (a node of the epoch, so the store is lost only when the epoch is over anyway)."""
    for node in record.nodes():
        found = nodes.get(node)
        if found is not None and found.store_port:
            return replace(record, store=found.store_address())
    return record


def superseded_unstarted(before: EpochRecord, new: EpochRecord) -> bool:
    """Whether `new` replaces `before` at the step `before` started at: no step was ever
    committed in `before`, so its rendezvous can be ended. Two planned changes at one
    boundary (a drain, then a node back) can tell one member the first epoch and the others
    the second; without an abort of the first, that member waits out the rendezvous's
    timeout (30 s) for peers who went on to the second."""
    return new.epoch > before.epoch and new.start_step == before.start_step and bool(before.store)
