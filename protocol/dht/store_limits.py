"""Rate limits on the DHT's requests: ``StoreLimits``, ``ReadLimits`` and the ``RateLimited``
error they raise.

``StoreLimits`` meters Store requests per source IP (counting records) and per signing key
(counting requests) against floods; ``ReadLimits`` the records FindValue answers carry per source
IP. Both use ``protocol.dht.ratelimit``'s token buckets and take ``now``.
"""

from __future__ import annotations

from protocol.dht.ratelimit import RateLimiter
from protocol.dht.record_store import source_key
from protocol.errors import RemoteProtocolError

__all__ = ["ReadLimits", "RateLimited", "StoreLimits"]


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


class ReadLimits:
    """A token bucket per source (the requester's IP, by ``source_key``) counting the records
    (whole ones and refreshes) that FindValue answers carry to it. Building and sealing an answer
    costs the responder ~12 us a record on its event loop (a read of a key's 1,000 records
    ~12 ms), against the asker's one signature (~0.1 ms): unmetered, a few dozen reads a second
    of a full key held one peer's loop. A read is refused before its answer is built once its
    source's bucket is spent (``admit``), and the records it carried are charged after it
    (``charge``: a bucket may go into debt by one answer). A member's reads are delta reads of
    the few records that changed; the rate leaves room for a local swarm's peers reading from
    one address."""

    def __init__(
        self,
        *,
        source_rate: float = 5_000.0,
        source_burst: float = 20_000.0,
        max_tracked: int = 10_000,
    ) -> None:
        self.per_source = RateLimiter(source_rate, source_burst, max_tracked)

    def admit(self, *, source: str, now: float) -> None:
        """Raise ``RateLimited`` (429, penalty 0.1) when ``source`` has no record left to read."""
        src = source_key(source)
        bucket = self.per_source.bucket(src)
        if bucket.wait_s(now) > 0:
            raise RateLimited(
                f"records read by {src} over {bucket.rate:g}/s after a burst of {bucket.burst:g}; "
                f"retry in {bucket.wait_s(now):.1f} s",
                penalty=0.1,
            )

    def charge(self, *, source: str, records: int, now: float) -> None:
        """Charge the ``records`` an answer to ``source`` carries."""
        self.per_source.bucket(source_key(source)).charge(now, float(records))
