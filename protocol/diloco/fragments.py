"""Fragments: balanced tensor fragmentation, the staggered due-schedule, and fragment owners.

Decoupled DiLoCo (arXiv 2604.21428) synchronises the model in P fragments, each on its own
schedule, so only one fragment's worth of traffic is in flight at a time (the streaming idea).

Fragmentation (``plan_fragments``): tensors are sorted by size, largest first (numel descending,
then name ascending, so the plan does not depend on input order), and each goes into the bin
that is currently smallest (by numel, then by tensor count so zero-size tensors still fill empty
bins, then by index). Embedding tensors are merged differently (plain weighted mean instead of
radial-directional averaging), so they are binned apart: ``e`` fragments hold only embeddings and
the remaining ``P - e`` only other tensors, with ``e`` proportional to the embeddings' share of
all elements, at least 1 and at most the number of embedding tensors. Non-embedding fragments
come first (indices ``0 .. P-e-1``), embedding fragments last. Within a fragment, names keep the
sorted order (largest first); that is the order in which the node flattens them.

Due-schedule (``due_fragments``): inner steps are numbered from 1. Fragment ``p`` of ``P`` with
period ``H`` has offset ``o_p = floor(p * H / P)`` in ``[0, H)`` and is due at every step ``t``
with ``(t - 1 - o_p) % H == 0``: fragment 0 first at step 1, every fragment exactly once in any
window of ``H`` consecutive steps, consecutive sends of one fragment exactly ``H`` steps apart.
With ``P == H`` exactly one fragment is due per step, with ``P < H`` some steps have none, with
``P > H`` each step has ``floor(P/H)`` or ``ceil(P/H)``.

Owners (``owners_of``): rendezvous hashing of (swarm, fragment) over the members, primary first.
With the number of fragments given, the hashing has bounded loads (``balanced_owners``): every
(fragment, member) pair is ranked by its rendezvous score, highest first, and a fragment goes to
the first member of its pairs with room left, ``floor(P/N)`` fragments each and one more for the
first ``P mod N`` members to reach it. Plain hashing gave one of 4 members half of 8 fragments,
and that member's merges, seals and uploads set the pace of every round. A fragment's replica
is its owner among the members less its primary, so the member that takes over a failed
primary's fragment is the one holding its state. A member joining or leaving moves its own
fragments plus the few that the new room shifts (each move is a handoff).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from protocol.diloco.bounded_deal import deal_bounded
from protocol.errors import LocalProtocolError
from protocol.ids import rendezvous_rank, rendezvous_score

__all__ = [
    "Fragment",
    "FragmentPlan",
    "balanced_owners",
    "due_fragments",
    "due_offset",
    "owner_chain",
    "owners_of",
    "plan_fragments",
]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fragment:
    """One fragment: its index, tensor names and shapes (flattening order), size, kind."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[Shape, ...]
    numel: int
    is_embedding: bool


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    """The fragments of one model; every peer of a swarm must compute the same plan."""

    fragments: tuple[Fragment, ...]
    _by_name: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {name: f.index for f in self.fragments for name in f.names}
        object.__setattr__(self, "_by_name", by_name)

    def __len__(self) -> int:
        return len(self.fragments)

    def fragment_of(self, name: str) -> int:
        """Index of the fragment holding tensor ``name``; ``LocalProtocolError`` if none does."""
        try:
            return self._by_name[name]
        except KeyError:
            raise LocalProtocolError(f"tensor {name!r} is in no fragment of this plan") from None

    def plan_hash(self) -> bytes:
        """SHA-256 of the canonical plan (indices, kinds, names, shapes), for peers to compare."""
        canon = [
            [
                f.index,
                f.is_embedding,
                [[n, list(s)] for n, s in zip(f.names, f.shapes, strict=True)],
            ]
            for f in self.fragments
        ]
        text = json.dumps(canon, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(b"atoll/fragment-plan/v1\n" + text.encode()).digest()


def plan_fragments(
    shapes: Sequence[tuple[str, Shape]],
    n_fragments: int,
    *,
    embeddings: Collection[str] = (),
) -> FragmentPlan:
    """Balanced tensor fragmentation of ``shapes`` into ``n_fragments`` non-empty fragments.

    Raises ``LocalProtocolError`` for duplicate names, bad shapes, unknown embedding names,
    ``n_fragments`` < 1 or above the number of tensors, or too few fragments to keep embeddings
    apart from at least one fragment of other tensors.
    """
    sizes = _validated_sizes(shapes, embeddings)
    emb = [name for name in sizes if name in embeddings]
    other = [name for name in sizes if name not in embeddings]
    n_emb = _embedding_fragment_count(sizes, emb, other, n_fragments)
    groups = _balance(other, sizes, n_fragments - n_emb) + _balance(emb, sizes, n_emb)
    shape_of = dict(shapes)
    return FragmentPlan(
        tuple(
            Fragment(
                index=i,
                names=tuple(names),
                shapes=tuple(tuple(shape_of[n]) for n in names),
                numel=sum(sizes[n] for n in names),
                is_embedding=i >= n_fragments - n_emb,
            )
            for i, names in enumerate(groups)
        )
    )


def due_offset(fragment: int, n_fragments: int, period: int) -> int:
    """Offset ``floor(fragment * period / n_fragments)`` of ``fragment`` in the due-schedule.

    Raises ``LocalProtocolError`` unless ``0 <= fragment < n_fragments`` and ``period >= 1``.
    """
    _check_schedule(n_fragments, period)
    if not 0 <= fragment < n_fragments:
        raise LocalProtocolError(f"fragment {fragment} out of range 0..{n_fragments - 1}")
    return fragment * period // n_fragments


def due_fragments(step: int, n_fragments: int, period: int) -> tuple[int, ...]:
    """The fragments due at inner step ``step`` (>= 1), ascending; see the module docstring.

    Raises ``LocalProtocolError`` for ``step`` < 1, ``n_fragments`` < 1 or ``period`` < 1.
    """
    _check_schedule(n_fragments, period)
    if step < 1:
        raise LocalProtocolError(f"inner steps are numbered from 1, got {step}")
    r = (step - 1) % period
    # floor(p*H/P) == r  <=>  r*P/H <= p < (r+1)*P/H
    first = -(-r * n_fragments // period)
    stop = -(-(r + 1) * n_fragments // period)
    return tuple(range(first, stop))


def owners_of(
    swarm: str, fragment: int, members: Iterable[bytes], r: int, *, n_fragments: int | None = None
) -> tuple[bytes, ...]:
    """The ``r`` owners of ``fragment`` among ``members``, primary first: by rendezvous hash, or
    with ``n_fragments`` by ``balanced_owners`` (the owner among the members, then the owner
    among the members less those already named, and so on).

    Raises ``LocalProtocolError`` for a negative fragment, one not below ``n_fragments``, or
    ``r`` < 1.
    """
    if fragment < 0:
        raise LocalProtocolError(f"fragment index must be >= 0, got {fragment}")
    if n_fragments is None:
        return tuple(rendezvous_rank(swarm, fragment, members, r))
    if fragment >= n_fragments:
        raise LocalProtocolError(f"fragment {fragment} is not one of {n_fragments} fragments")
    return owner_chain(fragment, members, r, lambda rest: balanced_owners(swarm, n_fragments, rest))


def owner_chain(
    fragment: int,
    members: Iterable[bytes],
    r: int,
    assign: Callable[[frozenset[bytes]], Sequence[bytes]],
) -> tuple[bytes, ...]:
    """The first ``r`` owners of ``fragment`` by an assignment of every fragment (``assign``,
    e.g. ``balanced_owners`` over the members given, or a cache of it): its owner among the
    members, then its owner among the members less that one, and so on. Raises
    ``LocalProtocolError`` for ``r`` < 1."""
    if r < 1:
        raise LocalProtocolError(f"replica count r must be >= 1, got {r}")
    rest, chain = frozenset(members), list[bytes]()
    while rest and len(chain) < r:
        chain.append(assign(rest)[fragment])
        rest = rest - {chain[-1]}
    return tuple(chain)


def balanced_owners(swarm: str, n_fragments: int, members: Iterable[bytes]) -> tuple[bytes, ...]:
    """The primary owner of each of ``n_fragments`` fragments among ``members``: rendezvous
    hashing with bounded loads (see the module docstring). Every member owns ``floor(P/N)`` or
    ``ceil(P/N)`` fragments; the same members give the same answer in any order. Empty when
    there are no members. Raises ``LocalProtocolError`` for ``n_fragments`` < 1."""
    if n_fragments < 1:
        raise LocalProtocolError(f"n_fragments must be >= 1, got {n_fragments}")
    peers = sorted(set(members))
    if not peers:
        return ()
    dealt = deal_bounded(n_fragments, peers, lambda f, m: rendezvous_score(swarm, f, m))
    return tuple(peers[m] for m in dealt)


# ---------------------------------------------------------------- helpers


def _check_schedule(n_fragments: int, period: int) -> None:
    if n_fragments < 1:
        raise LocalProtocolError(f"n_fragments must be >= 1, got {n_fragments}")
    if period < 1:
        raise LocalProtocolError(f"period H must be >= 1, got {period}")


def _validated_sizes(
    shapes: Sequence[tuple[str, Shape]], embeddings: Collection[str]
) -> dict[str, int]:
    """Name -> numel in canonical order (numel descending, then name); validates the inputs."""
    sizes: dict[str, int] = {}
    for name, shape in shapes:
        if name in sizes:
            raise LocalProtocolError(f"tensor name {name!r} appears twice")
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise LocalProtocolError(f"tensor {name!r} has a bad shape {shape!r}")
        sizes[name] = math.prod(shape)
    unknown = sorted(set(embeddings) - sizes.keys())
    if unknown:
        raise LocalProtocolError(f"embedding tensors {unknown} are not among the model's tensors")
    order = sorted(sizes, key=lambda n: (-sizes[n], n))
    return {n: sizes[n] for n in order}


def _embedding_fragment_count(
    sizes: dict[str, int], emb: list[str], other: list[str], n_fragments: int
) -> int:
    """How many of the ``n_fragments`` hold embeddings (0 when there are none)."""
    total = len(emb) + len(other)
    if n_fragments < 1:
        raise LocalProtocolError(f"n_fragments must be >= 1, got {n_fragments}")
    if n_fragments > total:
        raise LocalProtocolError(
            f"{n_fragments} fragments for only {total} tensors: every fragment needs at least "
            f"one tensor; use at most {total} fragments"
        )
    if not emb:
        return 0
    if not other:
        return n_fragments
    if n_fragments < 2:
        raise LocalProtocolError(
            f"{n_fragments} fragment cannot keep {len(emb)} embedding tensors apart from "
            f"{len(other)} other tensors; use at least 2 fragments"
        )
    numel = sum(sizes.values())
    share = sum(sizes[n] for n in emb) / numel if numel else len(emb) / total
    wanted = round(n_fragments * share)
    return max(1, n_fragments - len(other), min(wanted, len(emb), n_fragments - 1))


def _balance(names: list[str], sizes: dict[str, int], bins: int) -> list[list[str]]:
    """Largest-first into the currently smallest bin (by numel, count, index)."""
    groups: list[list[str]] = [[] for _ in range(bins)]
    load = [0] * bins
    for name in names:  # already largest first
        i = min(range(bins), key=lambda b: (load[b], len(groups[b]), b))
        groups[i].append(name)
        load[i] += sizes[name]
    return groups
