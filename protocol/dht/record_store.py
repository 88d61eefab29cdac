"""The record store: what others asked us to hold, within caps, and who makes room for whom.

``RecordStore`` holds what others asked us to store, within a total byte cap (each record's
value plus ``RECORD_OVERHEAD_BYTES``), a cap on subkeys per key, on value size and on
time-to-live. Records that fail verification or do not fit raise a ``RemoteProtocolError``
subclass (the node answers 4xx or lists the reason, and counts it); a valid record that is not
newer than the one held is a normal outcome, returned as ``PutResult(stored=False, reason)``.
Republishing is the node's job: it re-signs its own records with a later expiry and stores them
again on the ``k`` nearest peers (the paper's hourly republish); the store never re-signs.

Room policy: fair share first, expiry second. Each record is charged to the *source* that last
stored it (the requester's IP, an IPv6 /64: ``source_key``, which is
``protocol.dht.netgroups.sender_key``; "" for the node's own). When a
record from source ``s`` does not fit (the key is full, or the store's bytes are), the store
looks at the source that holds the most (subkeys of that key, or bytes of the store):

- if it holds strictly more than ``s`` would after storing, its record that expires first is
  evicted, whatever its expiry;
- otherwise ``s`` itself is the heaviest: its own record that expires first is evicted, but only
  if it expires strictly before the newcomer; else the newcomer is refused (``Oversize``).

So a record is never pushed out by a source that holds less than its own, and a source at its
share can only trade its own records for longer-lived ones. A flood from one IP, however many
signing keys it uses and however long-lived its records, ends up evicting its own records: an
honest member's one small record under the swarm key survives until it expires. Evicting by
expiry alone would not do: the flood would sign 24 h records and push out every member's 20 s
one. Taking over a key needs as many IPs as it has subkeys, and evictions already made stand
when a newcomer is finally refused (they only ever took from heavier sources).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.dht.netgroups import sender_key
from protocol.dht.signed_record import (
    DEFAULT_MAX_VALUE_BYTES,
    RecordRefresh,
    SignedRecord,
    verify_record,
)
from protocol.errors import LocalProtocolError, Oversize, Stale
from protocol.wire.verified import VerifiedSignatures

__all__ = ["RECORD_OVERHEAD_BYTES", "PutResult", "RecordStore", "source_key"]

# What one held record costs besides its value: the record object and its six fields, its
# entries in the store's dicts and heaps. Measured with tracemalloc (tests/protocol/
# test_store_caps.py checks the figure stays an upper bound); the byte cap counts this.
RECORD_OVERHEAD_BYTES = 1024


@dataclass(frozen=True, slots=True)
class PutResult:
    """A valid record was stored (``evicted`` others to make room), or not because the held copy
    is as new or newer."""

    stored: bool
    reason: str
    evicted: int = 0


source_key = sender_key  # who a request came from, for fair shares and rate limits


_Item = tuple[float, int, bytes, bytes]  # (expires_at, seq, key, subkey): stale once seq differs


@dataclass(slots=True)
class _Held:
    record: SignedRecord
    source: str
    size: int
    seq: int


@dataclass(slots=True)
class _Source:
    nbytes: int = 0
    count: int = 0
    queue: list[_Item] = field(default_factory=list)  # its records, earliest expiry first (lazy)


class RecordStore:
    """Records others asked us to hold, within caps. See the module docstring for the policy."""

    def __init__(
        self,
        *,
        max_bytes: int = 64 << 20,
        max_subkeys_per_key: int = 1_000,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_ttl_s: float = 24 * 3600.0,
        verified: VerifiedSignatures | None = None,
    ) -> None:
        """``verified``: the node's memory of signatures that verified (none: verify each)."""
        if min(max_subkeys_per_key, max_value_bytes) < 1 or max_ttl_s <= 0:
            raise LocalProtocolError("record store caps must be positive")
        if max_bytes < max_value_bytes + RECORD_OVERHEAD_BYTES:
            raise LocalProtocolError(f"max_bytes {max_bytes} cannot hold one largest record")
        self.max_bytes = max_bytes
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_value_bytes = max_value_bytes
        self.max_ttl_s = max_ttl_s
        self.verified = verified
        self.counts: Counter[str] = Counter()  # evictions and refusals for lack of room, by cap
        self._data: dict[bytes, dict[bytes, _Held]] = {}
        self._sources: dict[str, _Source] = {}
        self._heavy: list[tuple[int, str]] = []  # (-bytes, source): valid while bytes match
        self._expiry: list[_Item] = []  # every record, earliest expiry first (lazy)
        self._count = self._bytes = self._seq = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held: each record's value plus ``RECORD_OVERHEAD_BYTES``."""
        return self._bytes

    def held_by(self, source: str) -> int:
        """Bytes held for records last stored from ``source`` (an address; see ``source_key``)."""
        held = self._sources.get(source_key(source))
        return 0 if held is None else held.nbytes

    def keys(self) -> list[bytes]:
        return list(self._data)

    def put(self, rec: SignedRecord, now: float, source: str = "") -> PutResult:
        """Verify and store ``rec``, sent from ``source`` (the requester's IP; "" for our own),
        if it is newer than the copy held, evicting others by the module's policy if needed.

        Raises what ``verify_record`` raises, and ``Oversize`` (penalty 0) when there is no room
        for it that the policy allows.
        """
        verify_record(
            rec,
            now=now,
            max_ttl=self.max_ttl_s,
            max_value_bytes=self.max_value_bytes,
            verified=self.verified,
        )
        self.prune(now)
        held = self._data.get(rec.key, {}).get(rec.subkey)
        if held is not None and held.record.expires_at >= rec.expires_at:
            return PutResult(
                False, f"held copy expires at {held.record.expires_at:.0f} >= {rec.expires_at:.0f}"
            )
        if held is not None:
            self._remove(rec.key, rec.subkey)
        src = source_key(source)
        try:
            evicted = self._make_room(rec, src, len(rec.value) + RECORD_OVERHEAD_BYTES)
        except Oversize:
            if held is not None:
                self._insert(held.record, held.source)
            raise
        self._insert(rec, src)
        done = f"replaced copy expiring at {held.record.expires_at:.0f}" if held else "stored"
        subs = len(self._data[rec.key])
        return PutResult(
            True,
            f"{done}; key holds {subs}/{self.max_subkeys_per_key} subkeys, store "
            f"{self._bytes}/{self.max_bytes} bytes" + (f", {evicted} evicted" if evicted else ""),
            evicted,
        )

    def refresh(
        self, key: bytes, refresh: RecordRefresh, now: float, source: str = ""
    ) -> PutResult:
        """``put`` the held record of ``(key, refresh.subkey)`` with the refresh's expiry and
        signature (a republication of the same value). Raises ``Stale`` (penalty 0: the record
        expired here, or never came) when none is held, and what ``put`` raises: a refresh
        signed over another value fails as a ``BadSignature``."""
        self.prune(now)
        held = self._data.get(key, {}).get(refresh.subkey)
        if held is None:
            raise Stale(
                f"no record of subkey {refresh.subkey.hex()[:16]} held to refresh: store it",
                penalty=0.0,
            )
        return self.put(refresh.refreshed(held.record), now, source)

    def get(self, key: bytes, now: float) -> list[SignedRecord]:
        """Unexpired records under ``key``, ordered by subkey; drops expired ones."""
        self.prune(now)
        subs = self._data.get(key, {})
        return [subs[s].record for s in sorted(subs)]

    def prune(self, now: float) -> int:
        """Drop every expired record; returns how many. Costs only what it drops."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            item = heapq.heappop(self._expiry)
            if self._live(item):
                self._remove(item[2], item[3])
                dropped += 1
        return dropped

    # ── room ────────────────────────────────────────────────────────────────────────────────

    def _make_room(self, rec: SignedRecord, src: str, size: int) -> int:
        """Evict what the policy allows until ``rec`` fits; how many. Raises ``Oversize``."""
        evicted = 0
        subs = self._data.get(rec.key, {})
        if len(subs) >= self.max_subkeys_per_key:
            victim = self._key_victim(subs, src, rec.expires_at)
            if victim is None:
                self.counts["refused: key full"] += 1
                raise Oversize(
                    f"key full: {len(subs)}/{self.max_subkeys_per_key} subkeys, none held by a "
                    f"source with more of them than {src!r} or expiring before this record",
                    penalty=0.0,
                )
            self._remove(rec.key, victim)
            self.counts["evicted: key full"] += 1
            evicted += 1
        while self._bytes + size > self.max_bytes:
            held = self._byte_victim(src, size, rec.expires_at)
            if held is None:
                self.counts["refused: store full"] += 1
                raise Oversize(
                    f"record store full: {self._bytes}/{self.max_bytes} bytes, none held by a "
                    f"source with more bytes than {src!r} or expiring before this record",
                    penalty=0.0,
                )
            self._remove(held.record.key, held.record.subkey)
            self.counts["evicted: store full"] += 1
            evicted += 1
        return evicted

    def _key_victim(self, subs: dict[bytes, _Held], src: str, expires_at: float) -> bytes | None:
        """The subkey to evict from a full key for a record from ``src``, or None."""
        counts = Counter(h.source for h in subs.values())
        heavy, n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        owner = heavy if n > counts[src] + 1 else src
        mine = [h for h in subs.values() if h.source == owner]
        if not mine:
            return None
        victim = min(mine, key=lambda h: (h.record.expires_at, h.seq))
        if owner == src and victim.record.expires_at >= expires_at:
            return None
        return victim.record.subkey

    def _byte_victim(self, src: str, size: int, expires_at: float) -> _Held | None:
        """The record to evict from a full store for a record from ``src``, or None."""
        heavy = self._heaviest()
        mine = self._sources[src].nbytes if src in self._sources else 0
        owner = heavy if heavy is not None and self._sources[heavy].nbytes > mine + size else src
        victim = self._earliest(owner)
        if victim is None or (owner == src and victim.record.expires_at >= expires_at):
            return None
        return victim

    def _heaviest(self) -> str | None:
        while self._heavy:
            neg, name = self._heavy[0]
            held = self._sources.get(name)
            if held is not None and held.nbytes == -neg:
                return name
            heapq.heappop(self._heavy)
        return None

    def _earliest(self, name: str) -> _Held | None:
        queue = self._sources[name].queue if name in self._sources else []
        while queue:
            _, seq, key, subkey = queue[0]
            held = self._data.get(key, {}).get(subkey)
            if held is not None and held.seq == seq:
                return held
            heapq.heappop(queue)
        return None

    # ── bookkeeping ─────────────────────────────────────────────────────────────────────────

    def _live(self, item: _Item) -> bool:
        held = self._data.get(item[2], {}).get(item[3])
        return held is not None and held.seq == item[1]

    def _insert(self, rec: SignedRecord, src: str) -> None:
        self._seq += 1
        size = len(rec.value) + RECORD_OVERHEAD_BYTES
        self._data.setdefault(rec.key, {})[rec.subkey] = _Held(rec, src, size, self._seq)
        item = (rec.expires_at, self._seq, rec.key, rec.subkey)
        source = self._sources.setdefault(src, _Source())
        _push(self._expiry, item, self._count, self._live)
        _push(source.queue, item, source.count, self._live)
        self._charge(src, source, size, 1)

    def _remove(self, key: bytes, subkey: bytes) -> None:
        subs = self._data[key]
        held = subs.pop(subkey)
        if not subs:
            del self._data[key]
        self._charge(held.source, self._sources[held.source], -held.size, -1)

    def _charge(self, name: str, source: _Source, size: int, count: int) -> None:
        source.nbytes += size
        source.count += count
        self._bytes += size
        self._count += count
        if source.count == 0:
            del self._sources[name]
            return
        heapq.heappush(self._heavy, (-source.nbytes, name))
        if len(self._heavy) > 2 * len(self._sources) + 64:
            self._heavy = [(-s.nbytes, n) for n, s in self._sources.items()]
            heapq.heapify(self._heavy)


def _push(heap: list[_Item], item: _Item, live_count: int, live: Callable[[_Item], bool]) -> None:
    """Push ``item``; drop stale entries once they outnumber the live ones."""
    heapq.heappush(heap, item)
    if len(heap) > 2 * live_count + 64:
        heap[:] = [i for i in heap if live(i)]
        heapq.heapify(heap)
