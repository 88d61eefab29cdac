"""Finding the holders a version pointer names, now (``HolderLookup``).

A pointer names holders by peer id; the learner takes their addresses from its own view of the
members (never from the pointer). A peer that reads the bounded view (``Membership.sees_all``
False: the roster, and other members by id as they are wanted) lacks most learners, so before
this a pointed holder it did not hold was skipped (``Presence.member_url`` only marks it
wanted, looked up at the next membership pass, 2-6 s later), and the fetch fell back to the
owner, whose upload budget is a few learners per version: at 96-128 peers most versions did
not reach 99 % of the learners within a minute (docs/scale_peers.md). Now the fetch looks the
pointed ids up at once, one lookup by id (``FindValue.only``) for all it was pointed at.

The same lookup serves a holder's requesters: a signer its view lacks (a learner pointed at it,
mostly) is looked up before the holder decides, so that it is served and pointed at as a member,
counted against the holder's fanout, not served as anonymous (``VersionServer``).

An id the membership loop is looking up already is not asked for again (``MemberLookups`` asks
for an id once per ``LOOKUP_RETRY_S``): the find waits for that lookup, at most
``SHARED_WAIT_S``, and reads its answer (``Membership.in_flight``).

Bounds: one lookup in flight per peer (a caller that waited for another's finds its ids looked
up with it, or asks for what is still missing); ``MemberLookups`` asks for an id at most every
``LOOKUP_RETRY_S`` and for at most ``LOOKUPS_PER_READ`` ids a lookup, and keeps
``LOOKED_UP_KEPT`` records; a pointer names at most ``MAX_POINTERS`` ids and a fetch follows at
most ``HOLDERS_TRIED`` holders, each looked up once. A peer that reads every member looks
nothing up: an id its view lacks is no live member.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from node.dht.membership import Membership

__all__ = ["SHARED_WAIT_S", "HolderLookup"]

log = logging.getLogger("atoll.peer")

# The longest a find waits for a lookup of the same ids already in flight (one DHT request by id)
SHARED_WAIT_S = 3.0


class HolderLookup:
    """Looks up, by id and at once, the pointed holders a bounded view does not hold."""

    def __init__(self, membership: Callable[[], Membership | None]) -> None:
        """``membership()``: the peer's membership once it serves (None before)."""
        self._membership = membership
        self._lock = asyncio.Lock()
        self.lookups = 0  # lookups made
        self.failed = 0  # lookups that raised (the DHT unreachable, a responder's bad reply)
        self.shared = 0  # finds that waited for a lookup of their ids already in flight

    async def find(self, peer_ids: Sequence[bytes]) -> None:
        """Look up those of ``peer_ids`` the view lacks, into the view. Raises nothing: an id
        not found (or a lookup that failed) stays unknown, and its holder is skipped."""
        ms = self._membership()
        if ms is None or ms.sees_all:
            return
        missing = [pid for pid in peer_ids if pid not in ms.members]
        for pid in missing:
            ms.want(pid)
        if not missing:
            return
        async with self._lock:
            if all(pid in ms.members for pid in missing):
                return  # found by the lookup we waited for
            self.lookups += 1
            try:
                await ms.look_up()  # asks for the ids not asked for lately
                async with asyncio.timeout(SHARED_WAIT_S):
                    self.shared += await ms.in_flight(
                        [pid for pid in missing if pid not in ms.members]
                    )
            except TimeoutError:
                log.debug("a lookup in flight for %d pointed holders took too long", len(missing))
            except Exception as exc:  # a lookup is best effort: the fetch asks the owner instead
                self.failed += 1
                log.debug("looking up %d pointed holders failed: %r", len(missing), exc)
