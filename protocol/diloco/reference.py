"""What a new owner's clip reference starts from, so no owner starts without one.

An owner's clip measures each contribution against recent accepted whole norms (the merger's
``reference``). A fresh merger has none, and a new owner (after a takeover, a join, a view
change) used to judge its first rounds against whatever arrived: one sender alone in the round
set its own bound. So the reference travels in the replica handoff and the owner checkpoint,
and a new owner starts from

  * the handed reference, when it is plausible against what the owner measures itself;
  * else what it measures: the norm of the last published updates it can compute from two
    versions it holds, ``|Θ_v − Θ_u| / (v − u)`` per version, over the outer learning rate. At
    the node's defaults (outer lr 1, no momentum, the ``normed`` aggregate, whose step length is
    the median contribution norm) a version's update norm is the median contribution's whole
    norm, so it is the same unit as the reference; with momentum or a bounded step it is an
    estimate within a factor of a few, which is why it only seeds and bounds;
  * else nothing (a swarm's first round: no version was published yet).

Handed norms carry their senders (``HandedNorm``: sender key id, norm), so the successor's clip
counts a sender of its first round once, by that round's contribution, not also by the norm it
had merged under the predecessor (``merge_weights.clip_reference``). A norm with sender None is
anonymous: measured here, or handed by an older peer that sent norms alone; each such norm
holds its own vote.

A handed reference whose median lies more than ``factor`` times above (or below) the measured
estimate is ignored: a hostile predecessor could hand a huge reference that lets its own next
contribution through, or a tiny one that clips every honest sender. With nothing measured, a
norm above ``ceiling`` (the owner passes |Θ|: no honest pseudo-gradient is as long as the
fragment itself, an honest one is a few percent of it) is dropped all the same. Pure functions,
no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

__all__ = [
    "PLAUSIBLE_FACTOR",
    "HandedNorm",
    "as_history",
    "on_the_wire",
    "starting_history",
    "starting_reference",
    "update_norm_estimate",
]

HandedNorm = tuple[bytes | None, float]  # (sender key id, its merged whole norm); None: anonymous

# a version's update norm and the median contribution norm differ by the outer step's momentum
# (up to 1 / (1 - momentum)) and a round scaled below its quorum; beyond 10x, a reference is wrong
PLAUSIBLE_FACTOR = 10.0


def update_norm_estimate(update_norm: float, versions: int, *, lr: float) -> float | None:
    """The per-version update norm ``update_norm / versions / lr`` as a contribution-norm estimate,
    or None when it tells nothing (no version between the two states, a zero or non-finite norm)."""
    if (
        versions < 1
        or not (math.isfinite(update_norm) and update_norm > 0)
        or not (math.isfinite(lr) and lr > 0)
    ):
        return None
    return update_norm / versions / lr


def as_history(norms: Iterable[float | HandedNorm]) -> tuple[HandedNorm, ...]:
    """``norms`` as (sender, norm) pairs: a bare norm (an older peer's handoff or checkpoint, a
    measured estimate) is anonymous."""
    return tuple((n[0], float(n[1])) if isinstance(n, tuple) else (None, float(n)) for n in norms)


def on_the_wire(
    norms: Iterable[float | HandedNorm],
) -> tuple[tuple[float, ...], tuple[bytes, ...]]:
    """``ReplicaState.norm_history`` and ``norm_senders`` for ``norms`` (b"": anonymous; no
    senders at all when every norm is anonymous, the bytes an older sender makes)."""
    pairs = as_history(norms)
    senders = tuple(p or b"" for p, _ in pairs)
    return tuple(n for _, n in pairs), senders if any(senders) else ()


def starting_history(
    handed: Sequence[float | HandedNorm],
    measured: Sequence[float],
    *,
    factor: float = PLAUSIBLE_FACTOR,
    ceiling: float = math.inf,
) -> tuple[tuple[HandedNorm, ...], str]:
    """The reference a new owner starts from, each handed norm with its sender (bare norms and
    measured ones anonymous), and why. ``handed``: a predecessor's (replica handoff or
    checkpoint); ``measured``: estimates from ``update_norm_estimate``. Values that are not
    finite and >= 0, or above ``ceiling``, are dropped first."""
    pairs = as_history(handed)
    given = tuple(p for p in pairs if math.isfinite(p[1]) and 0 <= p[1] <= ceiling)
    seen = as_history(x for x in measured if math.isfinite(x) and 0 < x <= ceiling)
    dropped = (
        f"{len(pairs) - len(given)} of the handed norms dropped (not finite, < 0 or above "
        f"{ceiling:.4g}); "
        if len(given) < len(pairs)
        else ""
    )
    reference, why = _choose(given, seen, factor)
    return reference, dropped + why


def _choose(
    given: tuple[HandedNorm, ...], seen: tuple[HandedNorm, ...], factor: float
) -> tuple[tuple[HandedNorm, ...], str]:
    """The handed reference when plausible against the measured one, else the measured one."""
    if given and seen:
        mid = statistics.median(n for _, n in given)
        own = statistics.median(n for _, n in seen)
        if own / factor <= mid <= own * factor:
            return (
                given,
                f"handed reference of {len(given)} norms (median {mid:.4g}, measured {own:.4g})",
            )
        return seen, (
            f"handed reference ignored: its median {mid:.4g} is over {factor:g}x off the "
            f"{own:.4g} measured from published updates; seeded from those"
        )
    if given:
        return (
            given,
            f"handed reference of {len(given)} norms (nothing measured to check it against)",
        )
    if seen:
        return (
            seen,
            f"seeded from {len(seen)} published update norms "
            f"(median {statistics.median(n for _, n in seen):.4g})",
        )
    return (), "no reference handed and no published update to measure"


def starting_reference(
    handed: Sequence[float],
    measured: Sequence[float],
    *,
    factor: float = PLAUSIBLE_FACTOR,
    ceiling: float = math.inf,
) -> tuple[tuple[float, ...], str]:
    """``starting_history`` without the senders: the norms a new owner starts from, and why."""
    reference, why = starting_history(handed, measured, factor=factor, ceiling=ceiling)
    return tuple(n for _, n in reference), why
