"""One node's recoveries for telemetry, as its events arrive: a thin wrapper over the fold.

Where it sits: the agent's `EventLog` hands `telemetry.otel.Telemetry` each event as it is
written; Telemetry feeds it here and turns each finished `RecoveryRecord` into a span
tree and metric points. The records come from the one fold (`protocol.recovery`), which
is defined over a list of events. Telemetry cannot wait for the list to end: it reports
a recovery as soon as its first commit arrives. So this tracker keeps the few events the
fold needs and folds them again when a commit may have ended a recovery.

What it is given is one node's own log, and the fold makes of that the node's view: only
the node that agreed an epoch wrote its `epoch-agreed`, so only that node reports the
recovery (a job's recoveries are counted once however many agents export), timed from
its own detection (or the `fault_t` that detection carries). Its MTTR can therefore be
shorter than the run summary's, which folds every node's log from the injected fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keepstep.agent.protocol.events import Event, EventKind, kind_of
from keepstep.agent.protocol.recovery import RecoveryRecord, recoveries

# The kinds the fold reads besides commits; commits are not kept (see `observe`).
_KEPT = frozenset({EventKind.EPOCH_AGREED, EventKind.FAULT_DETECTED, EventKind.RECONFIGURED})
_OLD = EventKind.FAULT_DETECTED  # may lack `epoch` in old logs (the fold goes by time)


@dataclass
class RecoveryTracker:
    """Feed it one node's events in the order they were written."""

    _kept: list[Event] = field(default_factory=list)
    _open: set[int] = field(default_factory=set)  # epochs agreed here, not yet reported

    def observe(self, event: Event) -> list[RecoveryRecord]:
        """The recoveries this event completes (usually none, at most a few)."""
        kind = kind_of(event)
        if kind in _KEPT:
            # Checked on the way in (raising to the caller), so that a malformed event
            # cannot stay behind to break every later fold.
            float(event["t"])
            epoch = int(event.get("epoch", 0)) if kind is _OLD else int(event["epoch"])
            self._kept.append(event)
            if kind is EventKind.EPOCH_AGREED and epoch > 0:
                self._open.add(epoch)
            return []
        if kind is not EventKind.COMMIT:
            return []
        epoch = int(event["epoch"])
        closing = {e for e in self._open if e <= epoch}
        try:
            if not closing:
                return []
            # The first commit in an epoch at or after a recovery's ends it, and this is
            # the first one since the recovery opened: the fold needs no other commit.
            return [r for r in recoveries([*self._kept, event]) if r.epoch in closing]
        finally:
            # A commit in `epoch` ends every recovery up to it, reported here or not (a
            # malformed event spoils only that recovery).
            self._open -= closing
            self._prune(epoch)

    def _prune(self, epoch: int) -> None:
        """Forget the detections and measurements of recoveries up to `epoch`. Agreed
        epochs are kept (one per change): they say which members the job had before."""

        def done(e: Event) -> bool:
            if e.get("kind") == EventKind.RECONFIGURED:
                return int(e["epoch"]) <= epoch
            if e.get("kind") == EventKind.FAULT_DETECTED:
                return "epoch" not in e or int(e["epoch"]) < epoch
            return False

        self._kept = [e for e in self._kept if not done(e)]
