"""The replay window: per-sender memory of recent envelopes, bounded in total, that no sender
can fill on another sender's behalf.

Theory of operation. A signed envelope carries ``(public_key, timestamp, nonce)``. A receiver
accepts it once: the timestamp must lie within ``max_skew_s`` of ``now`` (either way), and the
``(key, nonce)`` pair must not have been seen. Pairs older than ``now - max_skew_s`` fail the
skew check anyway and are forgotten (``prune``). What is left to design is what to forget
*early*, when a flood fills the memory within the window, without ever accepting a message
twice and without letting one sender's flood refuse another sender's messages: that policy is
``ReplayWindow``'s docstring. Measured (``tests/protocol/test_replay.py``; a flood of
messages from fresh keys dated 59 s ahead): 100,000 of them fill the default window, take
~35 MiB with the keys and nonces themselves, and leave an honest member's next message
accepted; 400,000 saturate every table at ~60 MiB.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from protocol.errors import LocalProtocolError, Replay

__all__ = ["ReplaySizes", "ReplayWindow"]


@dataclass(frozen=True, slots=True)
class ReplaySizes:
    """What a ``ReplayWindow`` holds: the bounded counts its memory is made of."""

    pairs: int  # (key, nonce) pairs remembered exactly; <= capacity
    live_keys: int  # keys with at least one such pair; <= capacity
    dormant_keys: int  # floors of keys with none left; <= max_dormant
    buckets: int  # shared floors (fixed)


class ReplayWindow:
    """Remembers who sent what within the clock-skew window, each sender on its own.

    Policy, for when a flood fills memory within the window:

    1. **Exact memory, oldest first.** Up to ``capacity`` pairs are remembered exactly. When
       full, the pair with the *oldest timestamp* (from whichever key) is forgotten, and that
       pair's own key's **floor** rises to its timestamp: that key's messages dated at or below
       its floor are refused from then on. A key's floor only ever takes a timestamp that key
       itself signed, so a flood — from any number of keys, dated as far ahead as the skew
       allows — can cost an honest key only the exact memory of its own older messages: its next
       message is dated later and passes. (Oldest first also keeps a future-dated flood's own
       pairs the longest.) The one cost to an honest key: two of its messages sealed at t1 < t2
       and delivered in the order t2, t1 *while* a flood forces t2 out of memory refuse t1 as
       below its floor; callers retry.
    2. **Dormant floors.** A key whose last exactly-remembered pair was forgotten early keeps its
       floor in a dormant table of up to ``max_dormant`` keys (dropped once the floor leaves the
       window); its next message makes it live again from that floor.
    3. **Shared buckets, last.** Only when the dormant table overflows within one window (an
       attacker signing more than ``capacity + max_dormant`` messages from fresh keys in about
       ``2 * max_skew_s`` seconds) is its oldest floor folded into one of ``buckets`` shared
       floors, picked by a hash of the key keyed with ``salt`` (give each node a secret salt, so
       nobody can grind keys into a chosen bucket). A key with no state here at all — no
       remembered pair, no dormant floor — starts from its bucket's floor. So a live or dormant
       key is never touched by another key's state; a key silent for the whole window can be
       refused only after that overflow, only if its bucket was hit, and only until the flood's
       timestamps (at most ``max_skew_s`` ahead of the flood) pass.

    Besides, the pruned pairs' newest timestamp is the window-wide ``floor``: at most our own
    ``now - max_skew_s``, so no sender can raise it; it keeps a clock that steps back from
    re-accepting what was pruned.

    Memory: at most ``capacity`` pairs and as many live keys, ``max_dormant`` dormant floors and
    ``buckets`` floats (``sizes`` reports the counts): ~350 B a pair with its key and nonce,
    ~170 B a dormant key, 8 B a bucket.
    """

    def __init__(
        self,
        max_skew_s: float = 60.0,
        capacity: int = 100_000,
        *,
        max_dormant: int | None = None,
        buckets: int = 1 << 16,
        salt: bytes = b"",
    ) -> None:
        """``max_dormant`` defaults to ``capacity // 4``. Raises LocalProtocolError on a
        non-positive skew, capacity or bucket count, a negative ``max_dormant`` or a salt longer
        than 64 bytes."""
        dormant = capacity // 4 if max_dormant is None else max_dormant
        if not max_skew_s > 0 or capacity < 1 or dormant < 0 or buckets < 1 or len(salt) > 64:
            raise LocalProtocolError(
                "need max_skew_s > 0, capacity >= 1, max_dormant >= 0, "
                "buckets >= 1 and a salt of at most 64 bytes"
            )
        self.max_skew_s, self.capacity, self.max_dormant = max_skew_s, capacity, dormant
        self.floor = -math.inf  # newest pruned timestamp (see the class docstring)
        self._salt = bytes(salt)
        self._seen: set[tuple[bytes, bytes]] = set()
        self._heap: list[tuple[float, bytes, bytes]] = []  # (timestamp, key, nonce), oldest first
        self._live: dict[bytes, int] = {}  # key -> pairs remembered
        self._floors: dict[bytes, float] = {}  # live keys' own floors (those that have one)
        self._dormant: OrderedDict[bytes, float] = OrderedDict()  # key -> floor, oldest first
        self._buckets = array("d", [-math.inf]) * buckets

    def __len__(self) -> int:
        """Pairs remembered exactly."""
        return len(self._seen)

    def sizes(self) -> ReplaySizes:
        return ReplaySizes(len(self._seen), len(self._live), len(self._dormant), len(self._buckets))

    def accept(self, public_key: bytes, nonce: bytes, timestamp: float, *, now: float) -> None:
        """Record a message, or raise Replay if it is a repeat, too far from ``now`` in either
        direction (clock skew), or at or below its key's floor."""
        skew = timestamp - now
        if not abs(skew) <= self.max_skew_s:
            raise Replay(
                f"timestamp {skew:+.1f} s from now exceeds the clock skew limit of "
                f"{self.max_skew_s} s"
            )
        self.prune(now)
        key, nonce = bytes(public_key), bytes(nonce)
        floor = self.floor_of(key)
        if timestamp <= floor:
            raise Replay(
                f"timestamp {timestamp} at or below this key's replay floor {floor} "
                "(its older messages were forgotten)"
            )
        if (key, nonce) in self._seen:
            raise Replay("nonce already seen from this key")
        if len(self._seen) >= self.capacity:
            self._forget_oldest(now)
        self._enter(key, now)
        self._live[key] += 1
        self._seen.add((key, nonce))
        heapq.heappush(self._heap, (timestamp, key, nonce))

    def floor_of(self, public_key: bytes) -> float:
        """The timestamp at or below which ``public_key``'s messages are refused."""
        key = bytes(public_key)
        if key in self._live:
            own = self._floors.get(key, -math.inf)
        elif key in self._dormant:
            own = self._dormant[key]
        else:
            own = self._buckets[self._bucket(key)]
        return max(own, self.floor)

    def prune(self, now: float) -> None:
        """Forget pairs and floors older than ``now - max_skew_s``."""
        cutoff = now - self.max_skew_s
        while self._heap and self._heap[0][0] < cutoff:
            timestamp, key, nonce = heapq.heappop(self._heap)
            self._seen.discard((key, nonce))
            self.floor = max(self.floor, timestamp)
            self._release(key, cutoff)
        while self._dormant and next(iter(self._dormant.values())) < cutoff:
            self._dormant.popitem(last=False)

    # ── internals ────────────────────────────────────────────────────────────────────────────
    def _forget_oldest(self, now: float) -> None:
        """Policy 1: the oldest pair goes; its own key's floor rises to its timestamp."""
        timestamp, key, nonce = heapq.heappop(self._heap)
        self._seen.discard((key, nonce))
        self._floors[key] = max(self._floors.get(key, -math.inf), timestamp)
        self._release(key, now - self.max_skew_s)

    def _release(self, key: bytes, cutoff: float) -> None:
        """One pair of ``key`` is gone; with its last, its floor (if still in the window) goes
        dormant (policy 2), and an overflowing dormant table folds into a bucket (policy 3)."""
        self._live[key] -= 1
        if self._live[key]:
            return
        del self._live[key]
        floor = self._floors.pop(key, -math.inf)
        if floor < cutoff:
            return
        self._dormant[key] = floor
        if len(self._dormant) > self.max_dormant:
            old, old_floor = self._dormant.popitem(last=False)
            if old_floor >= cutoff:
                b = self._bucket(old)
                self._buckets[b] = max(self._buckets[b], old_floor)

    def _enter(self, key: bytes, now: float) -> None:
        """Make ``key`` live, starting from its dormant or bucket floor."""
        if key in self._live:
            return
        floor = self._dormant.pop(key, None)
        if floor is None:
            floor = self._buckets[self._bucket(key)]
        if floor >= now - self.max_skew_s:
            self._floors[key] = floor
        self._live[key] = 0

    def _bucket(self, key: bytes) -> int:
        digest = hashlib.blake2b(key, digest_size=8, key=self._salt).digest()
        return int.from_bytes(digest, "big") % len(self._buckets)
