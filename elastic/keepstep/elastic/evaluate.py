"""Evaluation split across members, with the same totals at any world size.

Where it sits: the script calls ``job.evaluate(dataset, fn, names=..., batch_size=...)``
between steps, the same way on every member (``if step.commit() and step.index % 500 ==
0:``). The dataset is cut into fixed batches (batch ``b`` holds samples ``b * batch_size``
on); each member computes a contiguous block of them under ``torch.no_grad()`` with the
model in eval mode, and ``fn(batch)`` returns the additive quantities to total (a summed
loss, a token count, correct answers).

Why the totals do not depend on the world size: each batch has its own slots in one
float64 buffer, filled by the one member that computed it, so the all-reduce adds values
to zeros only (exact in any order); every member then sums the slots in batch order. A
batch's values do not depend on who computes it (the model is the same everywhere, and
what ``fn`` draws is keyed by (seed, step, batch)).

Faults: a member lost during the all-reduce costs no result. The survivors get
``PeerLost``, compute the batches they lack themselves and return the same totals; the
epoch is lost, and the next step recovers as after any loss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from keepstep.elastic.data import check_dataset
from keepstep.elastic.errors import ConfigError, PeerLost
from keepstep.elastic.rng import EVAL, rng_scope

if TYPE_CHECKING:
    from keepstep.elastic.job import Job

__all__ = ["evaluate"]

log = logging.getLogger(__name__)

EvalFn = Callable[[Any], Mapping[str, object]]


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model.eval()`` and no gradients, then every module's own mode back (a module the
    script keeps in eval mode while training stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def evaluate(
    job: Job,
    dataset: Any,
    fn: EvalFn,
    names: Sequence[str],
    batch_size: int,
    collate: Callable[[list[Any]], Any],
) -> dict[str, float]:
    """Each of ``names`` totalled over ``fn(batch)`` for every batch of ``dataset``."""
    check_dataset(dataset)
    names = _names(names)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be an int >= 1")
    n_batches = -(-len(dataset) // batch_size)
    if n_batches == 0:
        raise ConfigError("evaluate: the dataset is empty")
    k, started = len(names), time.perf_counter()
    comm = job.comm
    alone = comm is None or comm.aborted(wait=False)
    rank, size = (0, 1) if alone or comm is None else (comm.rank, comm.size)
    mine = range(rank * n_batches // size, (rank + 1) * n_batches // size)
    device = torch.device("cpu") if comm is None else comm.device
    rows = torch.zeros(n_batches * (k + 1), dtype=torch.float64)

    def run(b: int) -> None:
        indices = range(b * batch_size, min(len(dataset), (b + 1) * batch_size))
        with rng_scope(job.config.seed, job.done, b, purpose=EVAL):
            out = fn(collate([dataset[i] for i in indices]))
        rows[b * k : (b + 1) * k] = torch.tensor(_values(out, names, b), dtype=torch.float64)
        rows[n_batches * k + b] = 1.0  # computed, once

    with eval_mode(job.model):
        for b in mine:
            run(b)
        if size > 1 and comm is not None:
            summed = rows.to(device)
            try:
                comm.allreduce(summed, dist.ReduceOp.SUM, job.collective_timeout)
                rows = summed.cpu()
            except PeerLost as error:
                log.warning("evaluate: %s; computing the other members' batches here", error)
                for b in range(n_batches):
                    if b not in mine:
                        run(b)
    counts = rows[n_batches * k :].tolist()
    if any(c != 1.0 for c in counts):
        raise ConfigError(  # a member evaluated another dataset or batch size
            f"evaluate: batches computed {sorted(set(counts))} times, not once each: every "
            "member must call job.evaluate with the same dataset and batch_size"
        )
    values = rows[: n_batches * k].view(n_batches, k).tolist()
    totals = {}
    for j, name in enumerate(names):
        total = 0.0
        for row in values:  # in batch order, on every member
            total += row[j]
        totals[name] = total
    log.info(
        "evaluate: %d batches on %d member(s) in %.3f s",
        n_batches,
        size,
        time.perf_counter() - started,
    )
    return totals


def _names(names: object) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise ConfigError(
            f"names={names!r}: the quantities fn returns to total, e.g. names=('loss', 'count')"
        )
    out = tuple(names)
    if not all(isinstance(n, str) for n in out) or len(set(out)) != len(out):
        raise ConfigError(f"names={names!r}: distinct strings")
    return out


def _values(out: object, names: tuple[str, ...], b: int) -> list[float]:
    if not isinstance(out, Mapping) or set(out) != set(names):
        got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
        raise ConfigError(f"evaluate: fn returned {got} for batch {b}; names={list(names)}")
    values = []
    for name in names:
        value = out[name]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"evaluate: fn's {name!r} for batch {b} is {value!r}, not a number")
        values.append(float(value))
    return values
