"""Signed, expiring DHT records (key -> subkey -> value) and a store with caps and rate limits.

Theory of operation. Kademlia (Maymounkov & Mazières, IPTPS 2002, section 2.3) stores
``(key, value)`` pairs on the ``k`` peers nearest the key and lets them expire unless the
publisher republishes them. Atoll follows hivemind in giving each key many *subkeys*, one per
writer: the swarm's member list is one key whose subkeys are the members' peer ids. A subkey is
owned by the Ed25519 key that signs it (``subkey == peer_id_from_public_key(public_key)``), so
no peer can overwrite another's entry, and the newest expiry wins per ``(key, subkey)``: a writer
refreshes its entry by signing a later expiry, and a replayed old copy cannot roll it back.

The signature covers a domain-separated msgpack array ``["atoll/dht/record/v1", key, subkey,
value, expires_at]`` (bin types, ``expires_at`` as a float64), never the record's wire form.

``RecordStore`` holds what others asked us to store, within a total byte cap (each record's
value plus ``RECORD_OVERHEAD_BYTES``), a cap on subkeys per key, on value size and on
time-to-live. Records that fail verification or do not fit raise a ``RemoteProtocolError``
subclass (the node answers 4xx or lists the reason, and counts it); a valid record that is not
newer than the one held is a normal outcome, returned as ``PutResult(stored=False, reason)``.
Republishing is the node's job: it re-signs its own records with a later expiry and stores them
again on the ``k`` nearest peers (the paper's hourly republish); the store never re-signs.

Room policy: fair share first, expiry second. Each record is charged to the *source* that last
stored it (the requester's IP, an IPv6 /64, ``source_key``; "" for the node's own). When a
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

Delta reads. A reader that already holds records under a key names them in its FIND_VALUE as
``known_tag``s (the first ``KNOWN_TAG_ID_BYTES`` of the subkey and the expiry it holds);
``unknown_to`` is what a responder then sends: only records newer than the reader's, plus a count
of the records it held and left out, so "I hold the value, you have it already" costs a few bytes
instead of every member's record. A reader can only make itself miss records by naming tags;
a publisher cannot make anyone miss another's record without a 128-bit prefix collision on
the other's peer id.

``StoreLimits`` meters Store requests per source IP (counting records) and per signing key
(counting requests) against floods, with ``protocol.dht.ratelimit``'s token buckets; it takes
``now``.
"""

from __future__ import annotations

import heapq
import ipaddress
import math
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.dht.ratelimit import RateLimiter
from protocol.errors import (
    BadSignature,
    DecodeError,
    LocalProtocolError,
    NotAuthorized,
    Oversize,
    RemoteProtocolError,
    Stale,
)
from protocol.ids import ID_BYTES, peer_id_from_public_key
from protocol.wire.messages import CAPS, WireStruct, register_struct

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "KNOWN_TAG_BYTES",
    "KNOWN_TAG_ID_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "RECORD_STRUCT_CODE",
    "PutResult",
    "RateLimited",
    "RecordSigner",
    "RecordStore",
    "SignedRecord",
    "StoreLimits",
    "known_tag",
    "known_tags",
    "record_signing_bytes",
    "sign_record",
    "unknown_to",
    "verify_record",
    "source_key",
]

DOMAIN = "atoll/dht/record/v1"
DEFAULT_MAX_VALUE_BYTES = CAPS.max_bytes  # the wire's cap on inline bytes
RECORD_STRUCT_CODE = 32  # struct code space; mirrors the DHT's message codes 32-63
KNOWN_TAG_ID_BYTES = 16  # of the subkey: a forged match needs a 128-bit prefix collision
KNOWN_TAG_BYTES = KNOWN_TAG_ID_BYTES + 8  # ... then the expiry held, as a little-endian float64
_EXPIRY = struct.Struct("<d")


class RecordSigner(Protocol):
    """What ``sign_record`` needs of a signer (``protocol.wire.signing.Signer`` fits)."""

    @property
    def public_key(self) -> bytes: ...

    @property
    def peer_id(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


@register_struct(RECORD_STRUCT_CODE)
@dataclass(frozen=True, slots=True, kw_only=True)
class SignedRecord(WireStruct):
    """``value`` under ``(key, subkey)`` until ``expires_at``, signed by ``public_key``.

    A wire struct (code ``RECORD_STRUCT_CODE``). Checks shape only, raising ``DecodeError``;
    ``verify_record`` checks meaning. ``value`` is inline bytes, so at most ``CAPS.max_bytes``.
    """

    key: bytes
    subkey: bytes
    value: bytes
    expires_at: float
    public_key: bytes
    signature: bytes

    def _check(self) -> None:
        sizes = (("key", ID_BYTES), ("subkey", ID_BYTES), ("public_key", 32), ("signature", 64))
        for name, size in sizes:
            n = len(getattr(self, name))
            if n != size:
                raise DecodeError(f"SignedRecord.{name} must be {size} bytes, got {n}")

    def signing_bytes(self) -> bytes:
        return record_signing_bytes(self.key, self.subkey, self.value, self.expires_at)


def record_signing_bytes(key: bytes, subkey: bytes, value: bytes, expires_at: float) -> bytes:
    """The exact bytes a record's signature covers."""
    packed = msgpack.packb([DOMAIN, key, subkey, value, float(expires_at)], use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def sign_record(signer: RecordSigner, key: bytes, value: bytes, expires_at: float) -> SignedRecord:
    """A record of ``value`` under ``key``, in the signer's own subkey (its peer id)."""
    subkey = signer.peer_id
    sig = signer.sign(record_signing_bytes(key, subkey, value, expires_at))
    return SignedRecord(
        key=key,
        subkey=subkey,
        value=value,
        expires_at=expires_at,
        public_key=signer.public_key,
        signature=sig,
    )


def verify_record(
    rec: SignedRecord, *, now: float, max_ttl: float, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
) -> None:
    """Accept ``rec`` or raise why not, cheapest check first.

    Raises ``Oversize`` (value over ``max_value_bytes``, or expiry beyond ``now + max_ttl``),
    ``Stale`` (expired), ``NotAuthorized`` (subkey not the signer's peer id), ``BadSignature``.
    """
    if len(rec.value) > max_value_bytes:
        raise Oversize(f"record value of {len(rec.value)} bytes exceeds {max_value_bytes}")
    if rec.expires_at - now > max_ttl:
        raise Oversize(f"record ttl {rec.expires_at - now:.0f}s exceeds max {max_ttl:.0f}s")
    if rec.expires_at <= now:
        raise Stale(f"record expired {now - rec.expires_at:.1f}s ago", penalty=0.1)
    if rec.subkey != peer_id_from_public_key(rec.public_key):
        raise NotAuthorized(f"subkey {rec.subkey.hex()[:16]} signed by someone else")
    try:
        Ed25519PublicKey.from_public_bytes(rec.public_key).verify(
            rec.signature, rec.signing_bytes()
        )
    except InvalidSignature:
        raise BadSignature(
            f"record signature does not verify for subkey {rec.subkey.hex()[:16]}"
        ) from None


# ── store ───────────────────────────────────────────────────────────────────────────────────

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


def source_key(address: str) -> str:
    """Who a request came from, for rate limits and fair shares: an IPv4 address, or the /64 of
    an IPv6 one (one host commonly holds a whole /64); anything else as given, cut to 64 chars."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


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
    ) -> None:
        if min(max_subkeys_per_key, max_value_bytes) < 1 or max_ttl_s <= 0:
            raise LocalProtocolError("record store caps must be positive")
        if max_bytes < max_value_bytes + RECORD_OVERHEAD_BYTES:
            raise LocalProtocolError(f"max_bytes {max_bytes} cannot hold one largest record")
        self.max_bytes = max_bytes
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_value_bytes = max_value_bytes
        self.max_ttl_s = max_ttl_s
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
        verify_record(rec, now=now, max_ttl=self.max_ttl_s, max_value_bytes=self.max_value_bytes)
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


# ── rate limiting ───────────────────────────────────────────────────────────────────────────


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


# ── delta reads ─────────────────────────────────────────────────────────────────────────────


def known_tag(rec: SignedRecord) -> bytes:
    """What a reader that holds ``rec`` names in a FIND_VALUE so responders leave it out."""
    return rec.subkey[:KNOWN_TAG_ID_BYTES] + _EXPIRY.pack(rec.expires_at)


def known_tags(records: Iterable[SignedRecord]) -> tuple[bytes, ...]:
    """``known_tag`` of each record, one per subkey prefix (the newest expiry), in subkey order."""
    newest: dict[bytes, SignedRecord] = {}
    for rec in records:
        prefix = rec.subkey[:KNOWN_TAG_ID_BYTES]
        held = newest.get(prefix)
        if held is None or rec.expires_at > held.expires_at:
            newest[prefix] = rec
    return tuple(known_tag(newest[p]) for p in sorted(newest))


def unknown_to(records: Sequence[SignedRecord], tags: Iterable[bytes]) -> tuple[list[SignedRecord], int]:
    """The records a reader that sent ``tags`` does not hold yet, and how many were left out.

    A record is left out when the reader names its subkey prefix with an expiry at or after the
    record's: the reader holds it or a newer one. Tags are shaped by ``FindValue``'s checks;
    a malformed one here is a ``DecodeError``.
    """
    held: dict[bytes, float] = {}
    for tag in tags:
        if len(tag) != KNOWN_TAG_BYTES:
            raise DecodeError(f"a known-record tag is {KNOWN_TAG_BYTES} bytes, got {len(tag)}")
        (expiry,) = _EXPIRY.unpack_from(tag, KNOWN_TAG_ID_BYTES)
        prefix = tag[:KNOWN_TAG_ID_BYTES]
        if math.isfinite(expiry) and expiry > held.get(prefix, -math.inf):
            held[prefix] = expiry
    if not held:
        return list(records), 0
    out = [r for r in records if r.expires_at > held.get(r.subkey[:KNOWN_TAG_ID_BYTES], -math.inf)]
    return out, len(records) - len(out)
