"""One side of deferred acceptance as the layout's flat passes run it.

Where it sits: under ``assign`` (owners) and ``replica_assign`` (replicas), whose one pass
over every chunk offers each chunk to the nodes of its ranking in turn. A node under its
cap keeps what it is offered; a full one keeps the nearest keys (a key is a chunk's
distance above its number) and turns the farthest away. Every key turned away is
remembered per node, for the derived layouts' updates to take back.
"""

from __future__ import annotations

import heapq

__all__ = ["TAKEN", "TURNED_AWAY", "Acceptance"]

TAKEN = -1  # offer(): kept, nothing displaced
TURNED_AWAY = -2  # offer(): refused


class Acceptance:
    """Per node: its cap, its load, the keys it keeps (a list until it fills, then a
    max-heap of negated keys) and those it turned away (``rejected``, min-heaps)."""

    def __init__(self, cap: list[int], loads: list[int], rejected: dict[int, list[int]]) -> None:
        self.cap, self.loads, self.rejected = cap, loads, rejected
        self._held: dict[int, list[int]] = {}  # node -> negated keys, until it fills
        self._heaps: dict[int, list[int]] = {}  # full node -> max-heap (negated keys)

    def offer(self, n: int, key: int) -> int:
        """Offer ``key`` to node n: ``TAKEN``, ``TURNED_AWAY``, or the key it displaced."""
        loads, cap = self.loads, self.cap
        if loads[n] < cap[n]:
            loads[n] += 1
            if loads[n] < cap[n]:
                self._held.setdefault(n, []).append(-key)
            else:
                heap = self._held.pop(n, [])
                heap.append(-key)
                heapq.heapify(heap)
                self._heaps[n] = heap
            return TAKEN
        heap = self._heaps[n]
        if key < -heap[0]:
            out = -heapq.heapreplace(heap, -key)
            heapq.heappush(self.rejected.setdefault(n, []), out)
            return out
        heapq.heappush(self.rejected.setdefault(n, []), key)
        return TURNED_AWAY
