"""Rendezvous hashing with bounded loads: items dealt over bins by hash weights, every bin within
one item of every other. Shared by the fragments' owners (``fragments.balanced_owners``) and the
data shards' learners (``shard_deal``).

Every (item, bin) pair has a weight; pairs are taken heaviest first, and a pair deals its item to
its bin unless the item is dealt already or the bin is full. With I items and B bins, I = qB + r,
every bin takes q items and r of them one more (the first r to reach q + 1). Every caller that
knows the same bins computes the same deal. Ties (a collision of the weights) go to the larger
bin index, then the larger item.

Cost: I * B weights, and O(I * TOP) memory: an item keeps its TOP heaviest bins and ranks all of
them again only when those are full. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["deal_bounded"]

B = TypeVar("B")

TOP = 4  # bins an item keeps ranked; it ranks them all again only when these are full


def deal_bounded(n_items: int, bins: Sequence[B], weight: Callable[[int, B], int]) -> list[int]:
    """The bin index each of ``n_items`` items goes to; each bin gets ``n_items // len(bins)``
    items or one more. ``bins`` must be non-empty, in the order every caller uses (sorted)."""
    if not bins:
        raise ValueError("no bins to deal items to")
    base, extra = divmod(n_items, len(bins))
    load = [0] * len(bins)
    dealt = [-1] * n_items
    ranked = [_ranked(item, bins, weight, TOP) for item in range(n_items)]
    # one entry per undealt item: its heaviest bin not yet found full
    heap = [(-ranked[i][0][0], -ranked[i][0][1], -i, 0) for i in range(n_items)]
    heapq.heapify(heap)
    while heap:
        _, _, neg_item, at = heapq.heappop(heap)
        item = -neg_item
        b = ranked[item][at][1]
        if load[b] < base or (load[b] == base and extra > 0):
            if load[b] == base:
                extra -= 1  # one of the r places at q + 1
            load[b] += 1
            dealt[item] = b
            continue
        at += 1  # that bin is full for good: its next heaviest
        if at == len(ranked[item]):
            ranked[item] = _ranked(item, bins, weight, len(bins))
        heapq.heappush(heap, (-ranked[item][at][0], -ranked[item][at][1], neg_item, at))
    return dealt


def _ranked(
    item: int, bins: Sequence[B], weight: Callable[[int, B], int], top: int
) -> list[tuple[int, int]]:
    """The ``top`` heaviest (weight, bin index) pairs of ``item``, heaviest first."""
    return heapq.nlargest(top, ((weight(item, b), i) for i, b in enumerate(bins)))
