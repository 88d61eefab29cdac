"""A bounded view of the members: the roster in full, anyone else only when needed, by id.

Theory of operation (docs/scale_peers.md). Reading every member's record every pass costs each
peer O(N) bytes a pass, the whole swarm O(N²). Yet a learner that cannot own needs only the
members that can (to send contributions, fetch versions, find replicas) and, now and then, one
other learner by id: a holder a version pointer names, a requester it serves a version to. So
owner-capable members also publish their record under a second key, the *roster*, which every
peer reads whole (O(owners) a pass); a peer that may not own reads only the roster, and asks the
members key for the few other records it needs by subkey (``FindValue.only``), at most
``per_read`` a pass. ``MemberLookups`` decides which: the ids wanted since the last read that
are not held live, not asked about within ``retry_s`` (an id that is no member is not asked
again and again), the most recently wanted first; and which looked-up records are kept: the
``kept`` most recently wanted. Owner-capable peers still read everything: they need their
learners' standing and count (what an owner does is O(its learners) anyway).

Bounds, per non-owner peer and pass: one roster read (O(R) records for R owner-capable
members), at most ``per_read`` looked-up records, ``kept`` records held beyond the roster;
``wanted`` ids remembered at most ``max_wanted`` (a hostile pointer or requester can only push
out other wanted ids, never grow the state or the reads).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping

__all__ = ["MemberLookups"]


class MemberLookups:
    """Which non-roster members to look up by id next, and which looked-up ones to keep."""

    def __init__(
        self, *, per_read: int = 16, kept: int = 256, retry_s: float = 5.0, max_wanted: int = 1024
    ) -> None:
        if per_read < 1 or kept < per_read or retry_s < 0 or max_wanted < per_read:
            raise ValueError(
                "need per_read >= 1, kept >= per_read, retry_s >= 0 and max_wanted >= per_read; "
                f"got per_read={per_read}, kept={kept}, retry_s={retry_s}, max_wanted={max_wanted}"
            )
        self.per_read, self.kept, self.retry_s, self.max_wanted = (
            per_read,
            kept,
            retry_s,
            max_wanted,
        )
        # id -> when last wanted, oldest first (an ordered dict as an LRU)
        self._wanted: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._asked: dict[bytes, float] = {}  # id -> when last asked for (within retry_s)
        self.looked_up = 0  # ids asked for, in all

    def want(self, peer_id: bytes, now: float) -> None:
        """``peer_id``'s record is needed (a pointer named it, or it asked us for something)."""
        self._wanted[peer_id] = now
        self._wanted.move_to_end(peer_id)
        while len(self._wanted) > self.max_wanted:
            self._wanted.popitem(last=False)

    def due(self, live: Mapping[bytes, float], now: float) -> tuple[bytes, ...]:
        """The ids to ask for in this read (at most ``per_read``, most recently wanted first):
        wanted, with no record in ``live`` (id -> expiry) that outlives ``now``, and not asked
        for within ``retry_s``. Marks them asked."""
        for pid, at in list(self._asked.items()):
            if now - at >= self.retry_s:
                del self._asked[pid]
        out: list[bytes] = []
        for pid in reversed(self._wanted):
            if len(out) == self.per_read:
                break
            if live.get(pid, -1.0) > now or pid in self._asked:
                continue
            out.append(pid)
            self._asked[pid] = now
        self.looked_up += len(out)
        return tuple(out)

    def wanted_since(self, since: float) -> set[bytes]:
        """The ids wanted at or after ``since`` (those whose records are worth renewing)."""
        out: set[bytes] = set()
        for pid in reversed(self._wanted):  # most recently wanted first
            if self._wanted[pid] < since:
                break
            out.add(pid)
        return out

    def keep(self, held: Iterable[bytes]) -> set[bytes]:
        """Of the looked-up members ``held``, the ones to drop: all but the ``kept`` most
        recently wanted (an id never wanted, or no longer remembered as wanted, goes first)."""
        held = set(held)
        rank = {pid: i for i, pid in enumerate(reversed(self._wanted))}
        ordered = sorted(held, key=lambda pid: rank.get(pid, len(rank)))
        return set(ordered[self.kept :])

    def __len__(self) -> int:
        return len(self._wanted)
