"""Command-line values checked as they are parsed, and the parser that reports them.

Where it sits: every `keepstep` subcommand (`keepstep.cli`, `launch.cli`, `agent.node.cli`,
`dashboard.cli`) builds its flags with these types, so that a bad value is refused by
argparse itself: before any import of torch, before etcd or any other process starts. Each
message names the value and what is allowed; argparse adds the flag (`argument --seed: -1:
must be an integer >= 0`). `Parser` prints that as one line and exits with 2 (usage).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn, TypeVar

from keepstep.errors import ConfigError

_T = TypeVar("_T")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (the value, the rule, where to
    look) and exit with status 2; subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A whole number >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be an integer >= {minimum}")
        return value

    return parse


def seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds > 0")
    return value


def seconds_or_off(text: str) -> float:
    """A finite number of seconds >= 0 (0: the mechanism is off)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds >= 0 (0: off)")
    return value


def checked(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """`parse` as an argparse type: its ConfigError (whose message names the value and the
    rule) becomes the argparse error, instead of argparse's generic "invalid value"."""

    def wrapped(text: str) -> _T:
        try:
            return parse(text)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return wrapped
