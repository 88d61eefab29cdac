"""Dealing a dataset's shards over the learners, with no coordinator: rendezvous hashing with
bounded loads.

Theory of operation: ``protocol.diloco.bounded_deal`` with the weight ``blake2b(s, l)`` of each
(shard, learner) pair: pairs are taken heaviest first, and a pair deals its shard to its learner
unless the shard is dealt already or the learner holds its share. With S shards and L learners,
S = qL + r, every learner holds q shards and r of them one more, so none is left idle while
another holds two more than it. Every peer that knows the same learner set computes the same
deal without talking to anyone, so the shards are disjoint and complete while the set holds.

Plain rendezvous (each shard to its heaviest learner, Thaler and Ravishankar 1998) moved only a
joiner's or a leaver's shards but left loads uneven: with 12 shards over 4 learners one learner
held none in about 1 deal in 8. Bounding the loads moves a few more shards when the set changes
(a joiner takes its q, and the learners it displaced may take one from another): over 200 random
sets, 1.0-1.8x the joiner's share on average (``tests/protocol/test_shard_deal.py`` bounds it).

Cost: ``n_shards * len(learners)`` 8-byte BLAKE2b digests per deal, bounded by the caps below;
callers deal again only when the learner set changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from protocol.diloco.bounded_deal import deal_bounded

__all__ = [
    "MAX_LEARNER_ID_BYTES",
    "MAX_LEARNERS",
    "MAX_SHARDS",
    "deal",
    "deal_all",
    "owner_of",
    "preferred_shard",
    "shard_preference",
    "shard_weight",
]

MAX_SHARDS = 1 << 16  # more shards than this buys nothing and costs hashing on every deal
MAX_LEARNERS = 4096  # a deal hashes n_shards * learners pairs
MAX_LEARNER_ID_BYTES = 256  # peer ids are 32 bytes; a cap keeps a hostile id from costing much

_PERSON = b"atoll-shard-deal"  # domain separation from every other BLAKE2b use in Atoll


def shard_weight(shard: int, learner: bytes) -> int:
    """The rendezvous weight of ``learner`` for ``shard``: a 64-bit integer from BLAKE2b."""
    digest = hashlib.blake2b(
        shard.to_bytes(8, "big") + learner, digest_size=8, person=_PERSON
    ).digest()
    return int.from_bytes(digest, "big")


def _learner_set(learners: Iterable[bytes]) -> list[bytes]:
    """The learners as a sorted, duplicate-free list, each id checked.

    Raises ValueError for an empty id, one longer than MAX_LEARNER_ID_BYTES, or more than
    MAX_LEARNERS learners."""
    unique = sorted(set(learners))
    if len(unique) > MAX_LEARNERS:
        raise ValueError(
            f"{len(unique)} learners exceed the cap of {MAX_LEARNERS}: "
            "deal over the learners of one island group"
        )
    for learner in unique:
        if not 0 < len(learner) <= MAX_LEARNER_ID_BYTES:
            raise ValueError(
                f"a learner id of {len(learner)} bytes: ids are 1 to {MAX_LEARNER_ID_BYTES} bytes"
            )
    return unique


def _check_shards(n_shards: int) -> None:
    if not 1 <= n_shards <= MAX_SHARDS:
        raise ValueError(f"n_shards must be 1 to {MAX_SHARDS}, got {n_shards}")


def deal_all(n_shards: int, learners: Sequence[bytes]) -> dict[bytes, tuple[int, ...]]:
    """Every learner's shards, ascending: ``n_shards // L`` or one more each for L learners (a
    learner dealt none, when there are more learners than shards, maps to ``()``).

    Raises ValueError for ``n_shards`` outside 1..MAX_SHARDS, no learners, or a bad id."""
    _check_shards(n_shards)
    unique = _learner_set(learners)
    if not unique:
        raise ValueError("no learners to deal shards to")
    dealt: list[list[int]] = [[] for _ in unique]
    for shard, learner in enumerate(deal_bounded(n_shards, unique, shard_weight)):
        dealt[learner].append(shard)
    return {unique[i]: tuple(shards) for i, shards in enumerate(dealt)}


def owner_of(shard: int, n_shards: int, learners: Sequence[bytes]) -> bytes:
    """The learner that holds ``shard`` when ``n_shards`` shards are dealt over ``learners``.

    Raises ValueError for a shard outside 0..n_shards-1 or what ``deal_all`` refuses."""
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} is not one of the {n_shards} shards")
    return next(learner for learner, held in deal_all(n_shards, learners).items() if shard in held)


def deal(n_shards: int, learners: Sequence[bytes], me: bytes) -> tuple[int, ...]:
    """The shards ``me`` holds among ``learners``, ascending.

    ``me`` counts as a learner even when ``learners`` does not list it yet (a joiner deals
    itself in before the others have heard of it; they deal it in once they do). The result may
    be empty when there are more learners than shards: see ``preferred_shard``.

    Raises ValueError for ``n_shards`` outside 1..MAX_SHARDS or a bad learner id."""
    return deal_all(n_shards, [*learners, me])[me]


def shard_preference(n_shards: int, me: bytes) -> list[int]:
    """Every shard, by ``me``'s weight on it, highest first: the order in which a learner dealt
    no usable shard borrows one (shared with its owner).

    Raises ValueError for ``n_shards`` outside 1..MAX_SHARDS or a bad learner id."""
    _check_shards(n_shards)
    _learner_set([me])
    return sorted(range(n_shards), key=lambda shard: (-shard_weight(shard, me), shard))


def preferred_shard(n_shards: int, me: bytes) -> int:
    """The shard on which ``me`` has its highest weight (``shard_preference``'s first).

    Raises ValueError for ``n_shards`` outside 1..MAX_SHARDS or a bad learner id."""
    return shard_preference(n_shards, me)[0]
