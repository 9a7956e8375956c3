"""One node's view of a recovery, pieced together from its event log as events arrive.

The agent writes no single "recovery" event: a recovery is spread over `fault-detected`
(who noticed, when), `epoch-agreed` (the new membership; `agree_s` when it followed a
failure), `reconfigured` (per worker: `communicator_s`, `restore_s`, `replan_s`,
`resume_step`, `rolled_back_steps`) and the first `commit` of the new epoch. The
tracker keeps the pieces and returns a finished `RecoveryTrace` when that first commit
arrives; `telemetry.Telemetry` turns it into a span tree and metric points.

Only the node that agreed an epoch (wrote its `epoch-agreed`) reports that recovery, so
a job's recoveries are counted once however many agents export. Its view starts at its
own detection (or at `fault_t` when the detection event carries the fault's time), so
its MTTR can be shorter than the run summary's, which starts at the injected fault.

Phases are laid end to end from the start: detect, agree, communicator, restore,
replan, and first-step (what is left until the first commit: workers learning the
epoch and computing the step). Durations are measured; positions are reconstructed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PHASES = ("detect", "agree", "communicator", "restore", "replan", "first-step")


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class RecoveryTrace:
    """A recovery as this node saw it; times are wall-clock seconds."""

    epoch: int
    cause: str
    planned: bool
    start: float
    end: float
    phases: tuple[Phase, ...]
    resume_step: int | None
    rolled_back_steps: int
    members: tuple[str, ...]
    reason: str

    @property
    def mttr_s(self) -> float:
        return self.end - self.start


@dataclass
class _Pending:
    agreed: Mapping[str, Any]
    communicator_s: float = 0.0
    restore_s: float = 0.0
    replan_s: float = 0.0
    resume_step: int | None = None
    rolled_back_steps: int = 0


@dataclass
class RecoveryTracker:
    """Feed it one node's events in the order they were written."""

    _detected: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    _reconfigured: dict[int, list[Mapping[str, Any]]] = field(default_factory=dict)
    _open: dict[int, _Pending] = field(default_factory=dict)

    def observe(self, event: Mapping[str, Any]) -> list[RecoveryTrace]:
        """The recoveries this event completes (usually none, at most a few)."""
        kind = event.get("kind")
        if kind == "fault-detected":
            # The first detection of a failed epoch is the one the recovery starts from.
            self._detected.setdefault(int(event["epoch"]), event)
        elif kind == "epoch-agreed" and int(event["epoch"]) > 0:
            self._open.setdefault(int(event["epoch"]), _Pending(event))
        elif kind == "reconfigured":
            self._reconfigured.setdefault(int(event["epoch"]), []).append(event)
        elif kind == "commit":
            return self._close(int(event["epoch"]), float(event["t"]))
        return []

    def _close(self, epoch: int, t: float) -> list[RecoveryTrace]:
        done = sorted(e for e in self._open if e <= epoch)
        out = [self._trace(self._open.pop(e), t) for e in done]
        # A commit in `epoch` ends every recovery up to it, reported here or not.
        self._detected = {e: d for e, d in self._detected.items() if e >= epoch}
        self._reconfigured = {e: r for e, r in self._reconfigured.items() if e > epoch}
        return out

    def _trace(self, pending: _Pending, end: float) -> RecoveryTrace:
        agreed = pending.agreed
        epoch = int(agreed["epoch"])
        agreed_t = float(agreed["t"])
        planned = bool(agreed.get("planned", False))
        recon = self._reconfigured.get(epoch, [])
        detected = None if planned else self._detected.get(epoch - 1)
        if detected is not None:
            detected_t = float(detected["t"])
            start = min(float(detected.get("fault_t", detected_t)), detected_t)
            cause = str(detected.get("cause", "unknown"))
        else:
            detected_t = start = agreed_t - float(agreed.get("agree_s", 0.0))
            cause = _planned_cause(str(agreed.get("reason", ""))) if planned else "unknown"
        durations = {
            "detect": detected_t - start,
            "agree": max(agreed_t - detected_t, 0.0),
            "communicator": max((float(r["communicator_s"]) for r in recon), default=0.0),
            "restore": max((float(r["restore_s"]) for r in recon), default=0.0),
            "replan": max((float(r["replan_s"]) for r in recon), default=0.0),
        }
        phases: list[Phase] = []
        cursor = start
        for name in PHASES[:-1]:
            # Clamped so that clock noise never pushes a phase past the first commit.
            nxt = min(cursor + max(durations[name], 0.0), max(end, cursor))
            phases.append(Phase(name, cursor, nxt))
            cursor = nxt
        phases.append(Phase("first-step", cursor, max(end, cursor)))
        return RecoveryTrace(
            epoch=epoch,
            cause=cause,
            planned=planned,
            start=start,
            end=max(end, start),
            phases=tuple(phases),
            resume_step=min((int(r["resume_step"]) for r in recon), default=None),
            rolled_back_steps=max((int(r["rolled_back_steps"]) for r in recon), default=0),
            members=tuple(str(m) for m in agreed.get("members", ())),
            reason=str(agreed.get("reason", "")),
        )


def _planned_cause(reason: str) -> str:
    if "admit" in reason:
        return "join"
    if "drain" in reason:
        return "drain"
    return "planned"
