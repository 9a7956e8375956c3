"""Falling back to the durable checkpoint when a double fault took sharded state with it.

Where it sits: the healer calls it. A sharded job keeps each optimizer piece on its owner
and one replica on another node; when both go at once, no snapshot in the job holds the
piece, and no restart brings it back. Training on without it would be silently wrong, so
the epoch that follows resumes every member from the job's newest durable checkpoint:
the agent that decides looks up that step (`step_to_resume`), the epoch record names it
(`EpochRecord.checkpoint_step`), and every agent reads that step's checkpoint, joins a
sharded one's parts into one snapshot, and writes it to a file in its run directory, on
disk like a resumed job's checkpoint (`file_for`: shared memory is sized for the
snapshots); each of its workers imports it and resumes there, in the same process. The
steps after it are trained again, to the same bits (every value is keyed by step), and
the run's ledger counts only their newest commits.

Without a checkpoint URL, or before the first checkpoint is published, the job cannot go
on: `JobCannotContinue`, naming why.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from keepstep.agent.durable.parts import unbundle
from keepstep.agent.durable.reader import checkpoint_at, latest_checkpoint
from keepstep.agent.node.config import AgentConfig
from keepstep.agent.node.durable import write_private
from keepstep.agent.protocol import EpochRecord
from keepstep.agent.protocol.messages import JobCannotContinue
from keepstep.errors import KeepstepError

__all__ = ["READ_TIMEOUT_S", "Fallback"]

# How long reading a checkpoint back may take (as `keepstep run --resume` allows).
READ_TIMEOUT_S = 120.0

log = logging.getLogger(__name__)


class Fallback:
    """One agent's side of falling back: the step to resume (when it decides) and the
    file its workers resume from (for every fallback epoch, read once)."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._files: dict[int, Path] = {}  # epoch -> its checkpoint file (the newest only)

    def step_to_resume(self, why: str) -> int:
        """The step of the newest intact durable checkpoint, for an epoch that lacks
        sharded state because ``why``; ``JobCannotContinue`` if there is none to use."""
        url = self.cfg.checkpoint_url
        if not url:
            raise JobCannotContinue(
                f"the job cannot continue: {why}, and it writes no durable checkpoint to "
                "fall back to (keepstep run --checkpoint URL)"
            )
        try:
            found = latest_checkpoint(url, READ_TIMEOUT_S, self.cfg.storage_options)
        except (KeepstepError, OSError) as error:
            raise JobCannotContinue(
                f"the job cannot continue: {why}, and its durable checkpoints at {url} "
                f"cannot be read: {error}"
            ) from error
        if found is None:
            raise JobCannotContinue(
                f"the job cannot continue: {why}, and no durable checkpoint at {url} "
                "was completed yet"
            )
        info, _ = found
        log.warning("%s: every member resumes from the checkpoint of step %d", why, info.step)
        return info.step

    def file_for(self, record: EpochRecord) -> Path:
        """The file holding fallback epoch ``record``'s checkpoint as one snapshot, read
        and written the first time a worker asks (its workers ask together; one reads)."""
        step = record.checkpoint_step
        assert step >= 0, "only a fallback epoch names a checkpoint"
        with self._lock:
            path = self._files.get(record.epoch)
            if path is not None:
                return path
            url = self.cfg.checkpoint_url
            if not url:  # an epoch decided by an agent with other settings than this one
                raise JobCannotContinue(
                    f"epoch {record.epoch} resumes from the checkpoint of step {step}, "
                    f"but node {self.cfg.node} has no checkpoint URL"
                )
            try:
                _, blob = checkpoint_at(url, step, READ_TIMEOUT_S, self.cfg.storage_options)
                parts = unbundle(blob)
                if parts is not None:
                    from keepstep.elastic.sharded_checkpoint import join_parts  # torch

                    snapshot = join_parts(parts)
                else:
                    snapshot = blob
            except (KeepstepError, OSError) as error:  # SnapshotMissing, SnapshotCorrupt too
                raise JobCannotContinue(
                    f"epoch {record.epoch} resumes from the checkpoint of step {step} at "
                    f"{url}, which cannot be read: {error}"
                ) from error
            path = self.cfg.run_dir / f"fallback-{self.cfg.node}-step-{step}.ckpt"
            write_private(path, snapshot)
            for old in self._files.values():  # an earlier fallback's: its workers moved on
                if old != path:
                    old.unlink(missing_ok=True)
            self._files = {record.epoch: path}
            return path

    def close(self) -> None:
        with self._lock:
            for path in self._files.values():
                path.unlink(missing_ok=True)
            self._files = {}
