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

``RecordStore`` holds what others asked us to store, within caps on keys, subkeys per key, value
size and time-to-live. Records that fail verification or do not fit raise a
``RemoteProtocolError`` subclass (the node answers 4xx and counts it); a valid record that is not
newer than the one held is a normal outcome, returned as ``PutResult(stored=False, reason)``.
Republishing is the node's job: it re-signs its own records with a later expiry and stores them
again on the ``k`` nearest peers (the paper's hourly republish); the store never re-signs.

``TokenBucket`` and ``RateLimiter`` meter requests per peer against STORE floods; both take
``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.errors import (
    BadSignature,
    DecodeError,
    LocalProtocolError,
    NotAuthorized,
    Oversize,
    Stale,
)
from protocol.ids import ID_BYTES, peer_id_from_public_key
from protocol.wire.messages import CAPS, WireStruct, register_struct

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "RECORD_STRUCT_CODE",
    "PutResult",
    "RateLimiter",
    "RecordSigner",
    "RecordStore",
    "SignedRecord",
    "TokenBucket",
    "record_signing_bytes",
    "sign_record",
    "verify_record",
]

DOMAIN = "atoll/dht/record/v1"
DEFAULT_MAX_VALUE_BYTES = CAPS.max_bytes  # the wire's cap on inline bytes
RECORD_STRUCT_CODE = 32  # struct code space; mirrors the DHT's message codes 32-63


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


@dataclass(frozen=True, slots=True)
class PutResult:
    """A valid record was stored, or not because the held copy is as new or newer."""

    stored: bool
    reason: str


class RecordStore:
    """Records others asked us to hold, within caps. See the module docstring."""

    def __init__(
        self,
        *,
        max_keys: int = 10_000,
        max_subkeys_per_key: int = 1_000,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_ttl_s: float = 24 * 3600.0,
    ) -> None:
        if min(max_keys, max_subkeys_per_key, max_value_bytes) < 1 or max_ttl_s <= 0:
            raise LocalProtocolError("record store caps must be positive")
        self.max_keys = max_keys
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_value_bytes = max_value_bytes
        self.max_ttl_s = max_ttl_s
        self._data: dict[bytes, dict[bytes, SignedRecord]] = {}

    def __len__(self) -> int:
        return sum(len(subs) for subs in self._data.values())

    def keys(self) -> list[bytes]:
        return list(self._data)

    def put(self, rec: SignedRecord, now: float) -> PutResult:
        """Verify and store ``rec`` if it is newer than the copy held.

        Raises what ``verify_record`` raises, and ``Oversize`` (penalty 0) when the store or the
        key's subkeys are full even after dropping expired records.
        """
        verify_record(rec, now=now, max_ttl=self.max_ttl_s, max_value_bytes=self.max_value_bytes)
        held = self._data.get(rec.key, {}).get(rec.subkey)
        if held is not None and held.expires_at > now:
            if held.expires_at >= rec.expires_at:
                return PutResult(
                    False, f"held copy expires at {held.expires_at:.0f} >= {rec.expires_at:.0f}"
                )
            self._data[rec.key][rec.subkey] = rec
            return PutResult(True, f"replaced copy expiring at {held.expires_at:.0f}")
        subs = self._room_for(rec.key, now)
        subs[rec.subkey] = rec
        return PutResult(True, f"stored; key holds {len(subs)}/{self.max_subkeys_per_key} subkeys")

    def get(self, key: bytes, now: float) -> list[SignedRecord]:
        """Unexpired records under ``key``, ordered by subkey; drops expired ones."""
        self._prune_key(key, now)
        subs = self._data.get(key, {})
        return [subs[s] for s in sorted(subs)]

    def prune(self, now: float) -> int:
        """Drop every expired record; returns how many."""
        return sum(self._prune_key(key, now) for key in list(self._data))

    def _prune_key(self, key: bytes, now: float) -> int:
        subs = self._data.get(key)
        if subs is None:
            return 0
        dead = [s for s, r in subs.items() if r.expires_at <= now]
        for s in dead:
            del subs[s]
        if not subs:
            del self._data[key]
        return len(dead)

    def _room_for(self, key: bytes, now: float) -> dict[bytes, SignedRecord]:
        """The subkey dict of ``key`` with room for one more, or raise ``Oversize``."""
        self._prune_key(key, now)
        if key not in self._data:
            if len(self._data) >= self.max_keys:
                self.prune(now)
            if len(self._data) >= self.max_keys:
                raise Oversize(
                    f"record store full: {len(self._data)}/{self.max_keys} keys", penalty=0.0
                )
            self._data[key] = {}
        subs = self._data[key]
        if len(subs) >= self.max_subkeys_per_key:
            raise Oversize(f"key full: {len(subs)}/{self.max_subkeys_per_key} subkeys", penalty=0.0)
        return subs


# ── rate limiting ───────────────────────────────────────────────────────────────────────────


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
        bucket = self._buckets.pop(peer, None) or TokenBucket(self.rate, self.burst)
        self._buckets[peer] = bucket
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return bucket.allow(now, cost)
