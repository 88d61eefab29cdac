"""Which learners an owner still waits for at the end of a run.

An owner declares its fragment final once no member is learning. A member's record saying
"learning" is only its claim: a peer that joined and never trained, or a hostile member that
keeps republishing "learning" and sends nothing, would hold every other peer's final fetch
forever. So the owner notes when each sender's contributions arrived, and a member whose record
says learning but that has sent nothing for several of its own intervals between contributions
(or of the fragment's usual interval, for a member never heard from) is not waited for.

A learner still at work keeps contributing every H steps and is waited for, however slow, as long
as its interval stays under ``SilenceBounds.cap_s``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["LearnerActivity", "SilenceBounds"]


@dataclass(frozen=True, slots=True)
class SilenceBounds:
    """How long a member claiming to learn may stay silent before an owner stops waiting for it.

    ``factor`` times the member's own last interval between contributions (a round it sat out,
    a slow step, and one more), or times the fragment's usual interval if it has none, clamped to
    ``[floor_s, cap_s]``; ``unknown_s`` when the owner has seen no interval at all (it took the
    fragment over just now)."""

    factor: float = 3.0
    floor_s: float = 30.0
    unknown_s: float = 120.0
    cap_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.unknown_s <= self.cap_s:
            raise ValueError(f"silence bounds must satisfy 0 < floor_s <= unknown_s <= cap_s, got "
                             f"{self.floor_s}, {self.unknown_s}, {self.cap_s}")
        if self.factor < 1:
            raise ValueError(f"the silence factor must be at least 1 interval, got {self.factor}")


class LearnerActivity:
    """When each sender's accepted contributions to one fragment arrived (times from the caller's
    clock). Keeps two numbers per sender and at most ``max_senders`` senders (the least recently
    heard are forgotten first: a forgotten member counts as never heard from)."""

    def __init__(self, bounds: SilenceBounds = SilenceBounds(), *, max_senders: int = 4096) -> None:
        self.bounds = bounds
        self.max_senders = max_senders
        self._last: dict[bytes, float] = {}  # insertion order = least recently heard first
        self._gap: dict[bytes, float] = {}

    def heard(self, sender: bytes, now: float) -> None:
        """``sender``'s contribution was accepted at ``now``."""
        previous = self._last.pop(sender, None)
        if previous is not None and now > previous:
            self._gap[sender] = now - previous
        self._last[sender] = now
        while len(self._last) > self.max_senders:
            oldest = next(iter(self._last))
            del self._last[oldest]
            self._gap.pop(oldest, None)

    def last_heard(self, sender: bytes) -> float | None:
        return self._last.get(sender)

    def usual_interval(self) -> float | None:
        """The median of the senders' last intervals: the fragment's round cadence per learner."""
        return statistics.median(self._gap.values()) if self._gap else None

    def bound(self, sender: bytes) -> float:
        """Seconds of silence after which ``sender`` is not waited for."""
        b = self.bounds
        gap = self._gap.get(sender)
        if gap is None:
            gap = self.usual_interval()
        if gap is None:
            return b.unknown_s
        return min(b.cap_s, max(b.floor_s, b.factor * gap))

    def silent(self, learning: Iterable[bytes], *, since: float, now: float) -> set[bytes]:
        """The members of ``learning`` silent for their bound, counted from their last accepted
        contribution or from ``since`` (when the owner began waiting for the end), the later."""
        out = set()
        for sender in learning:
            heard = self._last.get(sender)
            quiet_from = since if heard is None else max(heard, since)
            if now - quiet_from >= self.bound(sender):
                out.add(sender)
        return out
