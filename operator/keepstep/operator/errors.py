"""The operator's error types: failures are types, and messages name the bad value."""

from __future__ import annotations


class OperatorError(Exception):
    """Base class of every error the operator raises on purpose."""


class SpecError(OperatorError, ValueError):
    """A TrainJob (or a setting) is invalid; the message names the field and the rule."""
