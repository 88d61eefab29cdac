"""Dealing a dataset's shards over the learners, with no coordinator (rendezvous hashing).

Theory of operation: shard ``s`` goes to the learner ``l`` with the highest weight
``blake2b(s, l)`` (highest-random-weight hashing, Thaler and Ravishankar 1998). Every peer that
knows the same learner set computes the same owner for every shard without talking to anyone,
so the shards are disjoint and complete while the set holds. When a learner joins, it takes
exactly the shards on which it now has the highest weight, each from its previous owner; when
one leaves, only its own shards move, each to the learner with the next-highest weight. No
other shard changes hands (the property tests check both).

Cost: ``n_shards * len(learners)`` 8-byte BLAKE2b digests per deal, bounded by the caps below;
callers deal again only when the learner set changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

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


def owner_of(shard: int, learners: Sequence[bytes]) -> bytes:
    """The learner that holds ``shard``: the one with the highest weight (ties, which need a
    64-bit collision, go to the larger id). Raises ValueError for no learners or a bad id."""
    unique = _learner_set(learners)
    if not unique:
        raise ValueError("no learners to deal a shard to")
    return max(unique, key=lambda learner: (shard_weight(shard, learner), learner))


def deal_all(n_shards: int, learners: Sequence[bytes]) -> dict[bytes, tuple[int, ...]]:
    """Every learner's shards, ascending (a learner dealt none maps to ``()``).

    Raises ValueError for ``n_shards`` outside 1..MAX_SHARDS, no learners, or a bad id."""
    _check_shards(n_shards)
    unique = _learner_set(learners)
    if not unique:
        raise ValueError("no learners to deal shards to")
    dealt: dict[bytes, list[int]] = {learner: [] for learner in unique}
    for shard in range(n_shards):
        best = max(unique, key=lambda learner: (shard_weight(shard, learner), learner))
        dealt[best].append(shard)
    return {learner: tuple(shards) for learner, shards in dealt.items()}


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
