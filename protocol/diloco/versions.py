"""The highest version an owner can honestly have reached: a fence against version jumps.

Versions are fencing tokens: a learner adopts a fragment's version only if it is newer than the
one it holds, and a new owner starts from the newest it has seen. So one signed version of
2^63 - 1 would leave every honest version "old" for ever. Each version is one merge, a merge
closes a round, and a round needs contributions that took inner steps of wall time, so an honest
owner produces at most ``max_rounds_per_s`` versions a second (the default, 100, is far above any
real swarm: a round takes at least H inner steps of some island). A version above what that rate
allows since the newest version we know of (or since the swarm was created) is refused.
"""

from __future__ import annotations

import math

__all__ = ["MAX_ROUNDS_PER_S", "version_ceiling", "version_jump_reason"]

MAX_ROUNDS_PER_S = 100.0


def version_ceiling(
    *, held: int, held_at: float, now: float, max_rounds_per_s: float = MAX_ROUNDS_PER_S
) -> int:
    """The highest version reachable at ``now`` from version ``held`` known at ``held_at``.

    One round more than the elapsed time allows is granted, for the round that was already
    closing when ``held`` was seen, and clocks that disagree by a little."""
    if not (max_rounds_per_s > 0 and math.isfinite(max_rounds_per_s)):
        raise ValueError(f"max_rounds_per_s must be finite and > 0, got {max_rounds_per_s}")
    elapsed = max(0.0, now - held_at)
    return max(held, 0) + 1 + math.floor(elapsed * max_rounds_per_s)


def version_jump_reason(
    version: int,
    *,
    held: int,
    held_at: float | None,
    now: float,
    created: float | None = None,
    max_rounds_per_s: float = MAX_ROUNDS_PER_S,
) -> str | None:
    """Why ``version`` cannot have been produced (None when it can).

    Bounded from the newest version received from the swarm (``held`` at ``held_at``; None when
    none was) and, when the swarm's creation time is known, from version 0 at ``created``: the
    smaller bound wins. With neither known there is no bound."""
    ceiling, since = math.inf, ""
    if held_at is not None:
        ceiling = version_ceiling(
            held=held, held_at=held_at, now=now, max_rounds_per_s=max_rounds_per_s
        )
        since = f"version {held} was seen {max(0.0, now - held_at):.1f} s ago"
    if created is not None:
        from_start = version_ceiling(
            held=0, held_at=created, now=now, max_rounds_per_s=max_rounds_per_s
        )
        if from_start < ceiling:
            ceiling, since = (
                from_start,
                f"the swarm was created {max(0.0, now - created):.0f} s ago",
            )
    if version > ceiling:
        return (
            f"version {version} is above the {int(ceiling)} an owner can have reached "
            f"({since}, at most {max_rounds_per_s:g} merges a second)"
        )
    return None
