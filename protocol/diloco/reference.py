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
from collections.abc import Sequence

__all__ = ["PLAUSIBLE_FACTOR", "starting_reference", "update_norm_estimate"]

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


def starting_reference(
    handed: Sequence[float],
    measured: Sequence[float],
    *,
    factor: float = PLAUSIBLE_FACTOR,
    ceiling: float = math.inf,
) -> tuple[tuple[float, ...], str]:
    """The reference a new owner starts from, and why. ``handed``: a predecessor's (replica
    handoff or checkpoint); ``measured``: estimates from ``update_norm_estimate``. Values that
    are not finite and >= 0, or above ``ceiling``, are dropped first."""
    given = tuple(float(x) for x in handed if math.isfinite(x) and 0 <= x <= ceiling)
    seen = tuple(float(x) for x in measured if math.isfinite(x) and 0 < x <= ceiling)
    if len(given) < len(handed):
        dropped = f"{len(handed) - len(given)} of the handed norms dropped (not finite, < 0 or above {ceiling:.4g}); "
        reference, why = starting_reference(given, seen, factor=factor)
        return reference, dropped + why
    if given and seen:
        mid, own = statistics.median(given), statistics.median(seen)
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
            f"seeded from {len(seen)} published update norms (median {statistics.median(seen):.4g})",
        )
    return (), "no reference handed and no published update to measure"
