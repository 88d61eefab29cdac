"""How often a peer reads the member records, and which members of an open swarm offer to own.

Theory of operation (docs/scale_peers.md, "A capped roster, reads that back off").

*Cadence.* A peer's membership loop runs every couple of seconds, but the member records it
reads rarely change: republications reach it as refreshes, a dead member leaves the view when
its held record expires (no read needed), and a member that refuses connections is routed around
at once. ``ReadCadence`` reads every ``base_s`` while the view changes and doubles the gap after
each read that changed nothing (a member came or went, a role, address, reachability or
learning flag changed: not a step), up to ``max_s``; any change, a suspect or a wanted member
brings it back to ``base_s`` at once (``hurry``). ``renew_before`` is how far ahead a read asks
for refreshes of the records held, so that none of them nears expiry before the next read.

*Capped roster.* In an open swarm every reachable member may own, so the roster (the key every
peer reads whole) held every member. ``offers_to_own`` caps it: a member offers to own only
while fewer than ``cap`` of the roster's other candidates outrank it by ``roster_score`` (a
hash of the swarm id and the peer id, the same in every view). Every member can check every
other's rank, none can choose its own but by its key; once the roster is read the set is the
``cap`` best-ranked live candidates, and one that leaves is replaced by the next, which sees
the roster shrink at its next read. ``RosterSeat`` adds a grace: a member not offering takes a
place that opened in an established roster (at least half of ``cap`` others) only once it stayed
open ``grace_s``. An owner's record that lapsed for a moment on a loaded machine (a slow store, a
read that missed it) then costs nothing, where without the grace the next-ranked member took the
place, the fragments moved to it, and moved back when the owner republished.

*The line for a place.* A view that lacks one of the roster's records shows a place open to every
member that holds it, whatever that member's rank, and a deep member's offer moves fragments in
the views that see it (docs/scale_peers.md, "Places in the roster"). So the grace grows with
the line: a member waits ``grace_s`` once for itself and once more for each member *standing by*
(``RosterSeat.decide``'s ``waiting``: a member that may own and publishes that it would offer if
it ranked in) that outranks it in its view, at most ``cap`` of them. Where the place is truly
open, every view sees it: the best-ranked waiting member takes it after ``grace_s``, and then
stops waiting (it offers), so the next one's line is one shorter: places fill in rank order, one
``grace_s`` apart at most. Where only our view lacks a roster member, the members ahead of us see
no place and take none, and our view has the missing record back long before a deep member's
line is through. A member that claims to stand by but never takes a place delays us ``grace_s``
while its record is live in our view, ``cap`` such claims at most ``(cap + 1) * grace_s``.
And no place is taken from a stale view (``fresh``): on a starved loop whose reads do not
complete, every record lapses from the view in turn, the roster looks empty ("still forming")
and every member would take a place at once, whatever its rank.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable

__all__ = ["ReadCadence", "RosterSeat", "offers_to_own", "roster_score"]


class ReadCadence:
    """When the next membership read is due: ``base_s`` after a read that changed the view,
    twice the last gap (at most ``max_s``) after one that did not."""

    def __init__(self, *, base_s: float = 2.0, max_s: float = 8.0) -> None:
        if not 0 < base_s <= max_s:
            raise ValueError(f"need 0 < base_s <= max_s, got base_s={base_s}, max_s={max_s}")
        self.base_s, self.max_s = base_s, max_s
        self.gap_s = base_s  # the gap after the last read
        self._next_at = -math.inf
        self.reads = 0
        self.skipped = 0  # passes that found no read due

    def due(self, now: float) -> bool:
        """Whether a read is due at ``now`` (counts a pass that is not)."""
        if now >= self._next_at:
            return True
        self.skipped += 1
        return False

    def read(self, now: float, *, changed: bool) -> None:
        """A read ended at ``now``; ``changed``: it changed the view."""
        self.reads += 1
        self.gap_s = self.base_s if changed else min(self.max_s, 2 * self.gap_s)
        self._next_at = now + self.gap_s

    def hurry(self) -> None:
        """Read at the next pass, and every ``base_s`` until the view stops changing again."""
        self.gap_s = self.base_s
        self._next_at = -math.inf

    def renew_before(self, now: float, *, share_s: float, guard_s: float) -> float:
        """The expiry below which a held record is asked for as a refresh by a read at ``now``:
        ``share_s`` ahead, or further when the next read may come later than ``share_s -
        guard_s`` (so no record held comes within ``guard_s`` of expiry before it)."""
        return now + max(share_s, min(self.max_s, 2 * self.gap_s) + guard_s)


@functools.lru_cache(maxsize=1 << 14)
def roster_score(swarm: str, peer_id: bytes) -> int:
    """A member's rank for a place in ``swarm``'s roster (higher first), the same in every view."""
    h = hashlib.sha256(f"atoll/roster/{swarm}/".encode() + peer_id).digest()
    return int.from_bytes(h[:16], "big")


def offers_to_own(swarm: str, me: bytes, candidates: Iterable[bytes], cap: int) -> bool:
    """Whether ``me`` offers to own: fewer than ``cap`` of the other ``candidates`` (members that
    offer to own now, in our view) outrank it by ``roster_score``. Raises ``ValueError`` for a
    ``cap`` under 1."""
    if cap < 1:
        raise ValueError(f"the roster cap must be at least 1, got {cap}")
    mine = roster_score(swarm, me)
    above = sum(1 for pid in set(candidates) if pid != me and roster_score(swarm, pid) > mine)
    return above < cap


class RosterSeat:
    """One member's place in a capped roster over time: ``offers_to_own``, except that a member
    not offering waits before taking a place that opened in an established roster: ``grace_s``,
    and ``grace_s`` more for each waiting member that outranks it (module docstring)."""

    def __init__(self, *, cap: int, grace_s: float) -> None:
        if cap < 1 or grace_s < 0:
            raise ValueError(f"need cap >= 1 and grace_s >= 0, got cap={cap}, grace_s={grace_s}")
        self.cap, self.grace_s = cap, grace_s
        self.offering = False
        self._open_since: float | None = None  # when a place first looked open to us

    def decide(
        self,
        swarm: str,
        me: bytes,
        candidates: Iterable[bytes],
        now: float,
        *,
        waiting: Iterable[bytes] = (),
        fresh: bool = True,
    ) -> bool:
        """Whether ``me`` offers to own at ``now``, given the members offering in our view
        (``candidates``) and those standing by to (``waiting``). ``fresh``: the view was read
        lately; a member not offering takes no place from a stale view, whose records lapsed
        for want of a read and so show every place open (a roster "still forming")."""
        others = {pid for pid in candidates if pid != me}
        ranks = offers_to_own(swarm, me, others, self.cap)
        if not ranks or self.offering:
            self._open_since = None
            self.offering = ranks
            return ranks
        if not fresh:
            return False
        if 2 * len(others) < self.cap:  # a roster still forming: take the place at once
            self.offering = True
            return True
        if self._open_since is None:
            self._open_since = now
        self.offering = now - self._open_since >= self.grace_s * (
            1 + self.ahead(swarm, me, others, waiting)
        )
        return self.offering

    def ahead(
        self, swarm: str, me: bytes, candidates: Iterable[bytes], waiting: Iterable[bytes]
    ) -> int:
        """How many members standing by (``waiting``, less those already offering) outrank
        ``me``: the line before us for an open place, at most ``cap``."""
        mine, offering = roster_score(swarm, me), set(candidates)
        line = {pid for pid in waiting if pid != me and pid not in offering}
        return min(self.cap, sum(1 for pid in line if roster_score(swarm, pid) > mine))
