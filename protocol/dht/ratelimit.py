"""Token buckets: a rate and a burst, per peer or per address, with ``now`` passed in.

The DHT meters Store requests and the records its reads answer with them
(``protocol.dht.store_limits``), the routing table
its pings, and nodes the requests they serve (manifest posts, bootstrap lookups).
"""

from __future__ import annotations

from collections import OrderedDict

from protocol.errors import LocalProtocolError

__all__ = ["RateLimiter", "TokenBucket"]


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; starts full. A clock going back adds nothing."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate < 0 or burst <= 0:
            raise LocalProtocolError(f"need rate >= 0 and burst > 0, got {rate}, {burst}")
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self._last: float | None = None

    def allow(self, now: float, cost: float = 1.0) -> bool:
        """Spend ``cost`` tokens if there are enough; True if allowed."""
        if self._last is not None and now > self._last:
            self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
        if self._last is None or now > self._last:
            self._last = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def charge(self, now: float, cost: float) -> None:
        """Spend ``cost`` tokens whether they are there or not, down to ``-burst``: a cost known
        only once the work is done, which ``allow(now, 1)`` then refuses until it is paid back."""
        self.allow(now, 0.0)  # refill to now
        self.tokens = max(-self.burst, self.tokens - cost)

    def wait_s(self, now: float, cost: float = 1.0) -> float:
        """Seconds from ``now`` until ``cost`` tokens are there (0 now; inf if never)."""
        elapsed = max(0.0, now - self._last) if self._last is not None else 0.0
        missing = cost - min(self.burst, self.tokens + elapsed * self.rate)
        if missing <= 0:
            return 0.0
        return missing / self.rate if self.rate > 0 and cost <= self.burst else float("inf")


class RateLimiter:
    """One ``TokenBucket`` per peer, for at most ``max_peers`` peers (least recently used go).

    A peer forgotten this way comes back with a full bucket, so ``max_peers`` should exceed the
    number of peers that are active at once.
    """

    def __init__(self, rate: float, burst: float, max_peers: int = 10_000) -> None:
        if max_peers < 1:
            raise LocalProtocolError(f"max_peers must be >= 1, got {max_peers}")
        TokenBucket(rate, burst)  # validates
        self.rate, self.burst, self.max_peers = rate, burst, max_peers
        self._buckets: OrderedDict[bytes | str, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, peer: bytes | str, now: float, cost: float = 1.0) -> bool:
        """Whether ``peer`` may make a request costing ``cost`` now."""
        return self.bucket(peer).allow(now, cost)

    def bucket(self, peer: bytes | str) -> TokenBucket:
        """``peer``'s bucket (a full one for a peer not tracked), now the most recently used."""
        bucket = self._buckets.pop(peer, None) or TokenBucket(self.rate, self.burst)
        self._buckets[peer] = bucket
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return bucket
