"""Buffers the forward changes (BatchNorm's running statistics): the same on every member.

Where it sits: ``Step`` calls ``begin_step`` when a step starts and ``end_micro_batch`` after
each of this member's micro-batches; at commit it puts ``flags`` in the gradient buffer's
caller slots (no collective of its own), sums ``gather`` over the epoch's communicator when
some member's buffers changed, and calls ``apply`` once the step commits.

Why: a training forward of BatchNorm updates its running mean and variance (and counts
its batches) from the micro-batch it sees. Each member sees only its own micro-batches, so
without this every member would end the step with other buffers, and the buffers would
depend on the world size: the run's hash would disagree between members, and with the
fault-free run's.

The rule: every micro-batch starts from the buffers as the step found them (what a
micro-batch leaves is recorded, then undone), and the commit sets each buffer that any
member's micro-batch changed to the mean, over the step's micro-batches in micro-batch
order, of what each left. One float64 slot row per micro-batch: exactly one member
computes a micro-batch and fills its row, the others add zeros, so the sum hands every
member every row exactly, and every member averages the same rows in the same order. A
BatchNorm with momentum m thus moves m of the way to the mean of its micro-batches'
statistics once per step, at any world size (run alone with gradient accumulation, it
would move once per micro-batch). Integer buffers (the batch counter) take the mean
rounded to the nearest integer: a counter every micro-batch advanced by one advances by one.

Only buffers a snapshot holds (persistent, of a real or integer dtype) are kept in step;
each step copies them once and compares them after every micro-batch (one host sync for
all), which for the usual normalization layers is small beside a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def synced_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Where the model's persistent buffers of a real or integer dtype live: (module,
    attribute) pairs, read afresh at each use, so a module that replaces a buffer's tensor
    (rather than writing into it) is still followed."""
    found = []
    for module in model.modules():
        for attr, buf in module._buffers.items():
            if buf is None or attr in module._non_persistent_buffers_set:
                continue
            if buf.dtype == torch.bool or buf.is_complex():
                continue
            found.append((module, attr))
    return found


class BufferSync:
    """One member's view of the buffers its micro-batches change, step by step."""

    def __init__(self, model: torch.nn.Module, n_micro: int) -> None:
        self._where = synced_buffers(model)
        self.n_micro = n_micro
        self._start: list[torch.Tensor] = []
        self._left: dict[tuple[int, int], torch.Tensor] = {}  # (buffer, mb id) -> value
        self._own: list[int] = []

    def _buffer(self, k: int) -> torch.Tensor:
        module, attr = self._where[k]
        buf = module._buffers[attr]
        assert buf is not None, f"buffer {attr} of {type(module).__name__} was set to None"
        return buf

    @property
    def count(self) -> int:
        """How many caller slots ``flags`` fills (one per buffer)."""
        return len(self._where)

    def begin_step(self) -> None:
        """Remember the buffers as the step finds them."""
        with torch.no_grad():
            self._start = [self._buffer(k).detach().clone() for k in range(self.count)]
        self._left.clear()
        self._own.clear()

    def end_micro_batch(self, mb_id: int) -> None:
        """Record what micro-batch ``mb_id`` left in each buffer it changed, and undo it."""
        self._own.append(mb_id)
        if not self._start:
            return
        with torch.no_grad():
            current = [self._buffer(k) for k in range(self.count)]
            # One host sync for all the buffers (they may live on a GPU).
            moved = torch.stack(
                [(buf != start).any() for buf, start in zip(current, self._start, strict=True)]
            ).tolist()
            for k, buf in enumerate(current):
                if moved[k]:
                    self._left[(k, mb_id)] = buf.detach().clone()
                    buf.copy_(self._start[k])

    def flags(self) -> list[float]:
        """1.0 for each buffer one of this member's micro-batches changed, else 0.0."""
        changed = {k for k, _ in self._left}
        return [1.0 if k in changed else 0.0 for k in range(self.count)]

    def gather(self, changed: Sequence[bool], device: torch.device) -> torch.Tensor:
        """One float64 row per micro-batch: the changed buffers as this member's
        micro-batches left them (unchanged ones: the step's value), zeros in the rows of
        micro-batches other members computed. To be summed across members, on ``device``
        (the communicator's); filled where the buffers are."""
        ks = self._changed(changed)
        where = self._start[ks[0]].device if ks else device
        rows = torch.zeros(self.n_micro, self._width(changed), dtype=torch.float64, device=where)
        for mb in self._own:
            at = 0
            for k in ks:
                value = self._left.get((k, mb), self._start[k])
                n = value.numel()
                rows[mb, at : at + n] = value.detach().reshape(-1).to(where, torch.float64)
                at += n
        return rows.reshape(-1).to(device)

    def apply(self, summed: torch.Tensor, changed: Sequence[bool]) -> None:
        """Set each changed buffer to the mean of the summed rows, in micro-batch order
        (float64 sums and a division, each rounded the same on any device)."""
        rows = summed.reshape(self.n_micro, self._width(changed))
        at = 0
        with torch.no_grad():
            for k in self._changed(changed):
                buf = self._buffer(k)
                n = buf.numel()
                part = rows[:, at : at + n].to(buf.device)
                total = part[0].clone()
                for mb in range(1, self.n_micro):
                    total += part[mb]
                mean = total / self.n_micro
                if not buf.is_floating_point():
                    mean = mean.round()
                buf.copy_(mean.reshape(buf.shape).to(buf.dtype))
                at += n

    def _changed(self, changed: Sequence[bool]) -> list[int]:
        if len(changed) != self.count:
            raise ValueError(f"{len(changed)} flags for {self.count} buffers")
        return [k for k, c in enumerate(changed) if c]

    def _width(self, changed: Sequence[bool]) -> int:
        return sum(self._start[k].numel() for k in self._changed(changed))
