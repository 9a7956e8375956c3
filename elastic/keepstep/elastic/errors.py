"""Error types of the elastic library.

Failures are types, not strings: the training loop and the agent branch on the class.
Configuration errors say which value was wrong and what is allowed; data-plane errors
(a lost peer, a corrupt snapshot) are latched by the step and never committed.
"""

from __future__ import annotations

# The roots live outside the library so that the operator can catch them without torch.
from keepstep.errors import ConfigError, KeepstepError

__all__ = [
    "BadMessage",
    "ConfigError",
    "KeepstepError",
    "PeerLost",
    "ScriptStateWarning",
    "SnapshotCorrupt",
    "SnapshotMissing",
    "StateShapeError",
]


class BadMessage(KeepstepError, ValueError):
    """A message from a peer failed validation (its size, a type or a range); it is not used.

    Every member decodes the same bytes, so all of them raise it together.
    """


class StateShapeError(KeepstepError, ValueError):
    """Model or optimizer state changed shape, dtype or names between steps or on restore."""


class PeerLost(KeepstepError):
    """A collective of the current membership epoch was given up: a peer died, hung or left.

    The step in flight is not committed; the job waits for the next epoch.
    """

    def __init__(self, epoch: int, reason: str) -> None:
        super().__init__(f"epoch {epoch}: {reason}")
        self.epoch = epoch
        self.reason = reason


class SnapshotCorrupt(KeepstepError):
    """A snapshot slot failed its checksum or header check; it is never loaded."""


class SnapshotMissing(KeepstepError):
    """No valid snapshot holds the requested step."""


class ScriptStateWarning(UserWarning):
    """The script handles its own state in a way that a restarted worker, a joiner or a
    repeated step would not reproduce, so the members' numbers would diverge: it changes
    an optimizer's lr through an object the job does not track (an LR scheduler), or it
    advanced tracked state in a step that did not commit."""
