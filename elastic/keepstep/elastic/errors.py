"""Error types of the elastic library.

Failures are types, not strings: the training loop and the agent branch on the class.
Configuration errors say which value was wrong and what is allowed; data-plane errors
(a lost peer, a corrupt snapshot) are latched by the step and never committed.
"""

from __future__ import annotations


class KeepstepError(Exception):
    """Base class of every error keepstep raises on purpose."""


class ConfigError(KeepstepError, ValueError):
    """A job, plan or run argument is invalid; the message names the value and the rule."""


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
