"""Keeping our member record young (``RecordRenewal``): what to store next, when, and how old the
newest record a node of the DHT holds is: the owners' lease (``Handoffs`` refuses to publish a
version once it is older than the record's TTL less a margin).

Why a schedule of its own (issue 52, docs/scale_peers.md "An owner fenced under load"): a store
waits for its slowest target (a refresh refused, then the whole record: two request timeouts) and
for the lookup of the nearest nodes, and the lease used to be taken only once the whole store had
returned. One slow target on a starved box made each store take ~10 s, so the record's age seen
by the owner reached ``2 × 10`` s between renewals, past ``ttl − LEASE_MARGIN_S`` = 18 s, while
every other member still held a fresh copy: a live owner fenced itself. Now

- the lease runs from the first node that takes the record (``DHTClient.store``'s ``on_held``),
  measured from before the record was signed: what readers see expire is no younger;
- a store starts every ``renew_s`` (``ttl / 3``, at most ``REPUBLISH_S``) whether or not the
  last one has returned (at most ``MAX_IN_FLIGHT`` at once, each cut at ``2 × renew_s``), so a
  slow target delays no renewal. Bound: with a first node answering within ``a`` seconds and the
  loop running ``lag`` seconds late, the lease's age stays under ``renew_s + RECORD_CHECK_S + a +
  lag``: 6.7 + 0.5 + a + lag s against 18 s at the default 20 s TTL, so a loop lag of ~8 s with
  a 3 s answer does not fence a live owner. A peer that truly cannot store (partitioned, hung)
  still sees its lease age past ``ttl − LEASE_MARGIN_S`` before anybody drops its record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable

from node.dht.membership import MemberRecord

__all__ = [
    "MAX_IN_FLIGHT",
    "REPUBLISH_S",
    "STEP_NEWS_S",
    "RecordRenewal",
    "next_record",
]

REPUBLISH_S = 6.0  # the longest gap between two stores of our record (ttl / 3 when shorter)
MAX_IN_FLIGHT = 2  # stores of our record running at once (a slow one does not hold the next)
# A new step alone changes our record's value at most this often: a republication with the
# value unchanged reaches readers as a refresh (expiry and signature, ~110 bytes) instead of the
# whole record (docs/scale_peers.md); the step is read for a joiner's schedule and the status page.
STEP_NEWS_S = 60.0

# stores ``record``, calling its argument as each node takes it; returns how many did
Publish = Callable[[MemberRecord, Callable[[], None]], Awaitable[int]]


class RecordRenewal:
    """Which record to store next and when, and the lease: ``stored_at``, the monotonic time from
    before the newest record that a node took was signed (None: none yet)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a member record's ttl must be positive; got {ttl_s}")
        self.renew_s = min(REPUBLISH_S, ttl_s / 3)
        self.clock = clock
        self.stored_at: float | None = None
        self.in_flight = 0
        self.cut_short = 0  # stores cut at their deadline (2 × renew_s)
        self._started_at = -math.inf  # when the last store began
        self._attempted: MemberRecord | None = None  # what the last store began with
        self._published: MemberRecord | None = None  # what a node last took
        self._step_news_at = -math.inf  # when the step last went into a stored record

    def due(self, current: MemberRecord) -> MemberRecord | None:
        """The record to store now (``current``, or it with the step last stored: ``next_record``),
        or None: nothing changed and the last store began under ``renew_s`` ago, or
        ``MAX_IN_FLIGHT`` stores are running."""
        now = self.clock()
        if self.in_flight >= MAX_IN_FLIGHT:
            return None
        base = self._attempted if self._attempted is not None else self._published
        record, changed = next_record(current, base, now - self._step_news_at)
        if not changed and now - self._started_at < self.renew_s:
            return None
        return record

    async def store(self, record: MemberRecord, publish: Publish) -> bool:
        """Store ``record`` with ``publish``, cut at ``2 × renew_s``; whether a node took it. The
        lease moves to this store's start as soon as the first node takes it. Raises what
        ``publish`` raises but the deadline (counted in ``cut_short``)."""
        started = self._started_at = self.clock()
        self._attempted, self.in_flight = record, self.in_flight + 1
        taken = False

        def held() -> None:
            nonlocal taken
            taken = True
            if self.stored_at is None or started > self.stored_at:
                self.stored_at = started

        try:
            async with asyncio.timeout(2 * self.renew_s):
                await publish(record, held)
        except TimeoutError:  # the nodes that answered by now hold it; the next store has begun
            self.cut_short += 1
        finally:
            self.in_flight -= 1
            self._settled(record, started, taken)
        return taken

    def _settled(self, record: MemberRecord, started: float, taken: bool) -> None:
        """Note what a finished store means for the next: taken, it is the record published; not,
        it is due again at the next check (unless a later store has begun)."""
        if taken:
            if self._published is None or record.step != self._published.step:
                self._step_news_at = self.clock()
            self._published = record
        elif self._attempted is record and self._started_at == started:
            self._attempted, self._started_at = self._published, -math.inf


def next_record(
    current: MemberRecord, published: MemberRecord | None, since_step_news_s: float
) -> tuple[MemberRecord, bool]:
    """What to publish next, and whether it is news to publish at once: a change of role,
    address, reachability or manifest is (``current``), and so is a step that doubled (0 to the
    first step included); another new step is not, and goes into the record only once
    ``STEP_NEWS_S`` passed since the step last did, so that the republications in between keep
    the value (readers get them as refreshes)."""
    if published is None:
        return current, True
    if dataclasses.replace(current, step=published.step) != published:
        return current, True
    if current.step > 0 and current.step >= 2 * published.step:
        # a first step, or the step doubled: O(log steps) pieces of news a run, so a joiner
        # early in a swarm's run does not read steps a minute old (its schedule starts from them)
        return current, True
    if since_step_news_s >= STEP_NEWS_S:
        return current, False
    return published, False
