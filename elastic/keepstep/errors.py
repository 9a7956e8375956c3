"""The roots of keepstep's error types, importable without torch.

Every part raises subclasses of these: the library inside training processes
(`keepstep.elastic.errors` adds its data-plane errors), the node agent and the
operator, whose image has no torch and therefore must not import `keepstep.elastic`.
"""

from __future__ import annotations


class KeepstepError(Exception):
    """Base class of every error keepstep raises on purpose."""


class ConfigError(KeepstepError, ValueError):
    """A job, plan or run argument is invalid; the message names the value and the rule."""
