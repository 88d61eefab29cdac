"""Rate limits on STORE: ``StoreLimits`` and the ``RateLimited`` error it raises.

``StoreLimits`` meters Store requests per source IP (counting records) and per signing key
(counting requests) against floods, with ``protocol.dht.ratelimit``'s token buckets; it takes
``now``.
"""

from __future__ import annotations

from protocol.dht.ratelimit import RateLimiter
from protocol.dht.record_store import source_key
from protocol.errors import RemoteProtocolError

__all__ = ["RateLimited", "StoreLimits"]


class RateLimited(RemoteProtocolError):
    """A peer sent Store requests (or records) faster than its token bucket allows."""

    status = 429


class StoreLimits:
    """Token buckets on STORE: per source (the requester's IP, by ``source_key``) counting
    records, and per signing key counting requests. A fresh key per request escapes the second,
    not the first. Both forget their least recently used entries beyond ``max_tracked``."""

    def __init__(
        self,
        *,
        source_rate: float = 100.0,
        source_burst: float = 1000.0,
        key_rate: float = 10.0,
        key_burst: float = 50.0,
        max_tracked: int = 10_000,
    ) -> None:
        self.per_source = RateLimiter(source_rate, source_burst, max_tracked)
        self.per_key = RateLimiter(key_rate, key_burst, max_tracked)

    def admit(self, *, source: str, signer: bytes, records: int, now: float) -> None:
        """Charge one Store of ``records`` records from ``source`` signed by ``signer``.

        Raises ``RateLimited`` (429, penalty 0.1) when either budget is spent. A request larger
        than the source's burst costs the whole burst, so it can still pass when full.
        """
        src, lim = source_key(source), self.per_source
        if not lim.allow(src, now, cost=min(float(records), lim.burst)):
            raise RateLimited(
                f"Store records from {src} over {lim.rate:g}/s after a burst of {lim.burst:g}",
                penalty=0.1,
            )
        if not self.per_key.allow(signer, now):
            raise RateLimited(
                f"Store rate over {self.per_key.rate:g}/s, burst {self.per_key.burst:.0f}",
                penalty=0.1,
            )
