"""Which learners an owner waits for: the members whose records say "learning", less the silent.

A merge's quorum is a share of the learners expected, and an owner declares its fragment final
once no member is learning. Both took a member record's "learning" at its word: members that
make the claim and send nothing (a peer that joined and never trained, identities a hostile
member adds, a peer that hangs) raised the quorum past what the real learners can reach, and
merges waited for ever (seven such members and three learners at a quorum share of 0.5), or held
every other peer's final fetch. So an owner notes when each sender's accepted contributions
arrived and how long the work between two of them takes (its step time times ``min_steps``,
2H: a learner ships each fragment every H steps and may hold one in flight; not the steps a
contribution holds, which are fewer in a staggered fragment's first one and grow while a round
waits, so that a bound from them grew with the stall it was to end), and does not wait for a
member silent for ``factor`` of that (for a member never heard from: of the median of those
heard), clamped to ``[floor_s, cap_s]`` (``[end_floor_s, cap_s]`` at the end of a run).
Silence counts from the member's last accepted contribution, or from when the owner first saw
it learning, whichever is later. The time between two contributions is not the measure: a
learner sends one per round, so it grows with every round that waits, and waiting on silent
members would lengthen the wait for them. A member found silent stays so until it is heard
from again (a bound that grows later does not count it back in).

A learner at work keeps contributing every H steps and stays expected, however slow, while H of
its steps take under ``cap_s / factor``; one slower than that is not waited for, but its
contributions are taken as before. Before the owner has heard from anyone nobody is silent
(nothing tells how long H steps take), except at the end of a run (``at_end``), where a member
never heard from is waited for ``unknown_s``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["LearnerActivity", "SilenceBounds"]


@dataclass(frozen=True, slots=True)
class SilenceBounds:
    """How long a member claiming to learn may stay silent before an owner stops waiting for it."""

    factor: float = 3.0  # intervals: a round it sat out, a slow step, and one more
    # in a round's quorum leaving a learner out only means rounds do not wait for it, while
    # waiting lets islands drift apart (a 30 s stall at 40 steps a second was 1,200 steps of
    # drift, and the merged model ended near its initial loss); at the end it means its last
    # work is refused, so a pause (a checkpoint, a collection) gets longer there
    floor_s: float = 5.0
    end_floor_s: float = 30.0
    unknown_s: float = 120.0  # at the end, when no interval is known at all
    cap_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.end_floor_s <= self.unknown_s <= self.cap_s:
            raise ValueError(
                f"silence bounds must satisfy 0 < floor_s <= end_floor_s <= unknown_s <= cap_s, "
                f"got {self.floor_s}, {self.end_floor_s}, {self.unknown_s}, {self.cap_s}"
            )
        if self.factor < 1:
            raise ValueError(f"the silence factor must be at least 1 interval, got {self.factor}")


class LearnerActivity:
    """When each member was first seen learning and each sender's contributions were accepted,
    in the caller's clock's seconds. At most ``max_senders`` of each are kept (the least recently
    heard or seen are forgotten first; a forgotten member counts as never heard from)."""

    def __init__(
        self,
        bounds: SilenceBounds = SilenceBounds(),
        *,
        min_steps: int = 0,
        max_senders: int = 4096,
    ) -> None:
        self.bounds = bounds
        self.min_steps = (
            min_steps  # the steps a learner trains between two contributions (2H); 0: its own
        )
        self.max_senders = max_senders
        self._last: dict[bytes, float] = {}  # insertion order: least recently heard first
        self._interval: dict[bytes, float] = {}
        self._first_seen: dict[bytes, float] = {}
        self._found_silent: set[bytes] = set()  # found silent in a round's count, until heard again

    def heard(
        self, sender: bytes, now: float, *, steps: int, step_time: float, accepted: bool = True
    ) -> None:
        """``sender``'s contribution reached the merger at ``now``, saying it holds ``steps`` inner
        steps of ``step_time`` seconds each (claims, bounded by the caller's checks; the bound they
        earn is capped anyway). A claim that makes no positive number keeps the last one. Only an
        ``accepted`` contribution counts as hearing from it; a refused one (a duplicate in a round
        that waits) still tells its pace: a staggered fragment's first contributions come at step
        1, with no step time yet, and in a round held below its quorum every later one is a
        duplicate, so without it the owner never learned a pace and waited for ever."""
        if accepted:
            self._last.pop(sender, None)
            self._last[sender] = now
            self._found_silent.discard(sender)
            self._trim(self._last, also=self._interval)
        work_s = (self.min_steps or steps) * step_time
        if math.isfinite(work_s) and work_s > 0:
            self._interval[sender] = work_s
            while len(self._interval) > self.max_senders:
                del self._interval[next(iter(self._interval))]

    def seen(self, learning: Iterable[bytes], now: float) -> None:
        """These members' records say learning at ``now``: silence counts from the first time."""
        for member in learning:
            if member not in self._first_seen:
                self._first_seen[member] = now
        self._trim(self._first_seen)

    def _trim(self, times: dict[bytes, float], also: dict[bytes, float] | None = None) -> None:
        while len(times) > self.max_senders:
            oldest = next(iter(times))
            del times[oldest]
            if also is not None:
                also.pop(oldest, None)
        while len(self._found_silent) > self.max_senders:
            self._found_silent.pop()

    def last_heard(self, sender: bytes) -> float | None:
        return self._last.get(sender)

    def usual_interval(self) -> float | None:
        """The median of the heard senders' work between contributions: how long 2H steps take."""
        return statistics.median(self._interval.values()) if self._interval else None

    def bound(self, sender: bytes, *, at_end: bool = False) -> float | None:
        """Seconds of silence after which ``sender`` is not waited for; None: no bound yet."""
        b = self.bounds
        interval = self._interval.get(sender)
        if interval is None:
            interval = self.usual_interval()
        if interval is None:
            return b.unknown_s if at_end else None
        return min(b.cap_s, max(b.end_floor_s if at_end else b.floor_s, b.factor * interval))

    def silent(
        self, learning: Iterable[bytes], *, since: float, now: float, at_end: bool = False
    ) -> set[bytes]:
        """The members of ``learning`` silent for their bound, counted from their last accepted
        contribution, from when they were first seen, or from ``since`` (when the owner began
        owning), the latest. Outside ``at_end``, those found silent before stay so until heard."""
        out = set()
        for member in learning:
            if not at_end and member in self._found_silent:
                out.add(member)
                continue
            bound = self.bound(member, at_end=at_end)
            if bound is None:
                continue
            heard = self._last.get(member)
            quiet_from = max(
                since, heard if heard is not None else self._first_seen.get(member, since)
            )
            if now - quiet_from >= bound:
                out.add(member)
        if not at_end:
            self._found_silent |= out
        return out
