"""TensorBoard scalars for `step.log` metrics, written by the job's leader.

Where it sits: `keepstep.init(tensorboard=DIR)` (or $KEEPSTEP_TENSORBOARD, which
`keepstep run --tensorboard DIR` sets) makes a `Board`; at each committed step the member
that leads the epoch writes the step's reduced metrics (the same value on every member and
at every world size) as scalars at that step. A new leader after a failure opens its own
event file in the same folder, which TensorBoard reads as one run; a step repeated after a
rollback is written again with the same values.

TensorBoard is optional: the writer is torch's `SummaryWriter`, which needs the
`tensorboard` package; without it `open_board` says so at `init`, before any training. A
writer that fails later (a full disk) is reported once and switched off: metrics never stop
training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from keepstep.elastic.errors import ConfigError

__all__ = ["Board", "ScalarWriter", "open_board"]

log = logging.getLogger(__name__)


class ScalarWriter(Protocol):
    """What a Board needs of torch's SummaryWriter."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class Board:
    """Scalars to `log_dir`; the writer is made on the first write (a member that never
    leads never opens a file)."""

    def __init__(self, log_dir: str, make_writer: Callable[[str], ScalarWriter]) -> None:
        self.log_dir = log_dir
        self._make_writer = make_writer
        self._writer: ScalarWriter | None = None
        self._broken = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._broken or not metrics:
            return
        try:
            if self._writer is None:
                self._writer = self._make_writer(self.log_dir)
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, step)
            self._writer.flush()
        except OSError as error:
            self._broken = True
            log.warning("TensorBoard writing to %s stopped: %s", self.log_dir, error)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def open_board(log_dir: str) -> Board:
    """A Board over torch's SummaryWriter; ConfigError if TensorBoard is not installed."""
    if not log_dir:
        raise ConfigError("tensorboard='' must name a folder for the event files")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError(
            f"tensorboard={log_dir!r} needs the tensorboard package (pip install "
            f"tensorboard): {error}"
        ) from None

    def make(folder: str) -> ScalarWriter:
        writer: ScalarWriter = SummaryWriter(log_dir=folder)
        return writer

    return Board(log_dir, make)
