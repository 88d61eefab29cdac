"""Rendezvous hashing with bounded loads: the heap with a few ranked bins per item deals exactly
what taking every (item, bin) pair heaviest first deals, with every bin within one of another."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.bounded_deal import deal_bounded


def _weight(item: int, b: bytes) -> int:
    return int.from_bytes(hashlib.sha256(item.to_bytes(4, "big") + b).digest()[:8], "big")


def _small_weight(item: int, b: bytes) -> int:
    return _weight(item, b) % 3  # ties everywhere: the tie-break decides


def _every_pair_heaviest_first(
    n: int, bins: list[bytes], weight: Callable[[int, bytes], int]
) -> list[int]:
    base, extra = divmod(n, len(bins))
    pairs = sorted(
        ((weight(i, b), j, i) for i in range(n) for j, b in enumerate(bins)), reverse=True
    )
    load, dealt = [0] * len(bins), [-1] * n
    for _, j, i in pairs:
        if dealt[i] >= 0 or load[j] > base or (load[j] == base and extra == 0):
            continue
        extra -= load[j] == base
        load[j] += 1
        dealt[i] = j
    return dealt


bin_sets = st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=12, unique=True)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=0, max_value=60), bins=bin_sets, ties=st.booleans())
def test_the_same_deal_as_every_pair_heaviest_first(n: int, bins: list[bytes], ties: bool) -> None:
    weight = _small_weight if ties else _weight
    ordered = sorted(bins)
    dealt = deal_bounded(n, ordered, weight)
    assert dealt == _every_pair_heaviest_first(n, ordered, weight)
    loads = [dealt.count(j) for j in range(len(ordered))]
    assert max(loads, default=0) - min(loads, default=0) <= 1 and sum(loads) == n


def test_no_bins_is_refused() -> None:
    with pytest.raises(ValueError, match="no bins"):
        deal_bounded(3, [], _weight)
