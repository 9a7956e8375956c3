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
    "StateMissing",
    "StateShapeError",
]


class BadMessage(KeepstepError, ValueError):
    """A message from a peer failed validation (its size, a type or a range); it is not used.

    Every member decodes the same bytes, so all of them raise it together.
    """


class StateShapeError(KeepstepError, ValueError):
    """Model or optimizer state changed shape, dtype or names between steps or on restore."""


class StateMissing(StateShapeError):
    """Entering an epoch, some of the sharded optimizer state has no copy on any member:
    the worker that still holds it is restarting (its node lives, with its snapshot), or
    a double fault took an owner and its replica. Every member of the epoch raises it."""


class PeerLost(KeepstepError):
    """A collective of the current membership epoch was given up: a peer died, hung or left.

    The step in flight is not committed; the job waits for the next epoch.
    ``missing_state``: the epoch was given up because its members lack state that only
    a worker outside it may hold (``StateMissing``): the next epoch must admit another
    worker, not repeat these members.
    """

    def __init__(self, epoch: int, reason: str, *, missing_state: bool = False) -> None:
        super().__init__(f"epoch {epoch}: {reason}")
        self.epoch = epoch
        self.reason = reason
        self.missing_state = missing_state


class SnapshotCorrupt(KeepstepError):
    """A snapshot slot failed its checksum or header check; it is never loaded."""


class SnapshotMissing(KeepstepError):
    """No valid snapshot holds the requested step."""


class ScriptStateWarning(UserWarning):
    """The script handles its own state in a way that a restarted worker, a joiner or a
    repeated step would not reproduce, so the members' numbers would diverge: it changes
    an optimizer's lr through an object the job does not track (an LR scheduler), or it
    advanced tracked state in a step that did not commit."""
