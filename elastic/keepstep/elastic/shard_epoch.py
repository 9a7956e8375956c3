"""Who owns and who keeps which optimizer elements in one epoch of a sharded job.

Where it sits: between the pure chunked layout (shard/chunks.py, shard/copies.py) and
the job's ZeRO-1 (sharded.py, sharded_snapshot.py). One pure function of the parameter
sizes and the member set gives both the elements each member steps (``owned``) and the
elements its snapshot keeps (``held``: its own chunks and one replica of another node's).

Chunks for the life of a job
    Epochs cut the same chunks whatever their membership, so the chunked layout's promise
    holds across epochs: after a node is lost, the new owner of each lost chunk is
    (mostly) the member that kept its replica, and recovery moves little more than that
    (tests/elastic/test_shard_fetch.py). How many: ``job_chunks`` of the epoch's nodes,
    1,024 up to 16 nodes and doubled each time the nodes double past that, so a node
    keeps 64-128 chunks (more below 16 nodes) and its load stays within ~10% of an even
    share, while a member steps few pieces (about 1,024 / W at small W). A small model
    (under 64 Mi elements) is cut into fewer, down to 32 chunks a member, so that a chunk
    holds at least ``MIN_CHUNK`` elements: below that, the work per piece in entering an
    epoch (the layout, unpacking and joining pieces) outweighed the copy of its elements
    (bench/shard_enter_cpu.py, a 116 Ki-element transformer: on 8 nodes 38 ms a member
    with 1,024 chunks, 15 with 256; on 4 nodes 58 ms, 11 with 128). The count only
    grows: ``agreed_chunks`` takes the largest any member's last epoch cut (each member's
    ``MemberView`` says it), so a loss keeps the chunks and a join cuts anew only when the
    job outgrows them (one move of most of the state, at a planned change).
    ``bench/shard_recovery_bytes.py``, worst loss: 0-0.14x the lost elements moved at 2-8
    nodes, 0.43x at 16, 0.32x at 32 and 0.38x at 64 (with 1,024 chunks at 64 nodes, 16 a
    node, the load bound forced 2.3x).

Tensor-aligned chunks
    The layout cuts a flattening in which every parameter starts on a multiple of
    ``ALIGN`` (each one padded to whole units), and the pieces are mapped back to the
    real offsets. So every piece a member owns starts on an ``ALIGN`` boundary of its
    own tensor, and the windows it steps (zero/ownership.py) are the pieces themselves,
    with no scratch lanes beside them, however many pieces there are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from keepstep.elastic.shard import ChunkLayout, make_chunk_layout, place_replicas
from keepstep.elastic.shard.chunks import MAX_CHUNKS
from keepstep.elastic.shard.layout import Range, join_touching
from keepstep.elastic.zero import ALIGN, Ownership

__all__ = [
    "JOB_CHUNKS",
    "MIN_CHUNK",
    "EpochShards",
    "agreed_chunks",
    "as_node",
    "epoch_shards",
    "job_chunks",
    "ownership_for",
]

JOB_CHUNKS = 1024  # the fewest chunks of a large model: a job of up to 16 nodes
_PER_NODE = 64  # the fewest chunks a node keeps (below twice that), past 16 nodes
_SMALL_JOB = 16  # members (agreed_chunks counts members): up to this many, a small model
# may keep fewer (below)
# A small model's chunks in a job of up to _SMALL_JOB members: at least this many elements
# each (a piece costs ~30-50 us of CPU to lay out, unpack and join, the copy of ~64 Ki
# float32 elements), while each of the layout's members keeps at least
# _FEWEST_PER_MEMBER: with 16, losing a node made the survivors give up 12% more than the
# lost share (tests/elastic/test_zero_job.py). Past _SMALL_JOB members every member keeps
# _PER_NODE whatever the model: with 32 each, the caps on owners and replicas bind so
# often that a loss at 64 nodes moved 0.5x the lost elements to owners and ZeRO-1
# re-fetched 1.92x what the lost node held; with 64, 0.28x and 1.38x
# (bench/shard_recovery_bytes.py, a 184M-element model).
MIN_CHUNK = 1 << 16
_FEWEST_PER_MEMBER = 32


def job_chunks(nodes: int, elements: int | None = None) -> int:
    """The chunk count for an epoch of ``nodes`` nodes: ``JOB_CHUNKS``, doubled until each
    node has at least ``_PER_NODE`` chunks (and so fewer than twice that); for a model of
    ``elements`` (None: a large one) in a job of up to ``_SMALL_JOB`` of them, halved while
    a chunk would hold fewer than ``MIN_CHUNK`` elements and each would still keep
    ``_FEWEST_PER_MEMBER``."""
    chunks = JOB_CHUNKS
    while chunks < _PER_NODE * nodes and chunks < MAX_CHUNKS:
        chunks *= 2
    if elements is not None and nodes <= _SMALL_JOB:
        while elements < MIN_CHUNK * chunks and chunks // 2 >= _FEWEST_PER_MEMBER * nodes:
            chunks //= 2
    return chunks


def agreed_chunks(members: Sequence[str], last: Sequence[int | None], elements: int) -> int:
    """The chunk count of an epoch of ``members`` training a model of ``elements``, from
    what each one's last sharded epoch cut (``last``, from every member's view; None:
    none): the most of those, or more when the epoch has outgrown them. Every member
    computes it from the same views."""
    nodes = len({as_node(m) for m in members})
    return max([job_chunks(nodes, elements), *(c for c in last if c is not None)])


def as_node(member: str) -> str:
    """A member's name in the layout: "node/local" as the agents name it; a name without
    a node ("m0", local runs) counts as a node of its own."""
    return member if "/" in member else f"{member}/0"


@dataclass(frozen=True)
class EpochShards:
    """Per member (by the name it was given): the element ranges of the flattened
    ``sizes`` it owns and those its snapshot keeps, sorted and merged."""

    sizes: tuple[int, ...]
    owned: dict[str, tuple[Range, ...]]
    held: dict[str, tuple[Range, ...]]
    layout: ChunkLayout | None = field(default=None, compare=False, repr=False)
    chunks: int = JOB_CHUNKS  # the chunk count it was cut with

    def ownership(self, ranks: Sequence[str]) -> Ownership:
        """The owned ranges in rank order (``ranks``: the communicator's members)."""
        return Ownership(self.sizes, tuple(self.owned[m] for m in ranks))


def ownership_for(sizes: Sequence[int], members: Sequence[str]) -> Ownership:
    """Who owns which elements in a first epoch of ``members`` (in rank order)."""
    chunks = agreed_chunks(members, (), sum(sizes))
    return epoch_shards(sizes, members, chunks=chunks).ownership(members)


def epoch_shards(
    sizes: Sequence[int],
    members: Sequence[str],
    before: EpochShards | None = None,
    chunks: int = JOB_CHUNKS,
) -> EpochShards:
    """The shards of the epoch of ``members``, its state cut into about ``chunks`` chunks
    (``agreed_chunks``); see the module docstring. ``before``: the last epoch's, whose
    layout the new one is derived from when members only left (a loss, a drain) with the
    same chunks: the same shards as a fresh layout's at a fraction of the CPU, which every
    member spends at every epoch it enters."""
    real = (0, *accumulate(sizes))
    padded_sizes = [-(-n // ALIGN) * ALIGN for n in sizes]
    padded = (0, *accumulate(padded_sizes))
    units = padded[-1] // ALIGN
    chunk = ALIGN * max(1, -(-units // chunks))
    names = {m: as_node(m) for m in members}
    last = before.layout if before is not None else None
    if last is not None and last.sizes == tuple(padded_sizes) and last.chunk == chunk:
        layout = last.relayout(names.values())  # afresh unless members only left
    else:
        layout = make_chunk_layout(padded_sizes, names.values(), align=ALIGN, chunk=chunk)
    replicas = 1 if len(layout.node_members) > 1 else 0
    owns, keeps = place_replicas(layout, replicas=replicas).member_ranges()

    def unpad(ranges: Sequence[Range]) -> tuple[Range, ...]:
        # Ranges come sorted and disjoint, and the map to real offsets keeps their order.
        def real_parts() -> Iterator[tuple[int, int]]:
            t = 0
            for start, stop in ranges:
                while t < len(sizes) and padded[t + 1] <= start:
                    t += 1
                u = t
                while u < len(sizes) and padded[u] < stop:
                    lo = max(start, padded[u]) - padded[u]
                    hi = min(stop - padded[u], sizes[u])
                    yield real[u] + lo, real[u] + hi
                    u += 1

        return join_touching(real_parts())

    return EpochShards(
        sizes=tuple(sizes),
        owned={m: unpad(owns.get(n, ())) for m, n in names.items()},
        held={m: unpad(keeps.get(n, ())) for m, n in names.items()},
        layout=layout,
        chunks=chunks,
    )
