"""Signed, expiring DHT records: the ``SignedRecord`` wire struct, what its signature covers,
``sign_record`` and ``verify_record``.

Theory of operation. Kademlia (Maymounkov & Mazières, IPTPS 2002, section 2.3) stores
``(key, value)`` pairs on the ``k`` peers nearest the key and lets them expire unless the
publisher republishes them. Atoll follows hivemind in giving each key many *subkeys*, one per
writer: the swarm's member list is one key whose subkeys are the members' peer ids. A subkey is
owned by the Ed25519 key that signs it (``subkey == peer_id_from_public_key(public_key)``), so
no peer can overwrite another's entry, and the newest expiry wins per ``(key, subkey)``: a writer
refreshes its entry by signing a later expiry, and a replayed old copy cannot roll it back.

The signature covers a domain-separated msgpack array ``["atoll/dht/record/v1", key, subkey,
value, expires_at]`` (bin types, ``expires_at`` as a float64), never the record's wire form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgpack

from protocol.errors import DecodeError, NotAuthorized, Oversize, Stale
from protocol.ids import ID_BYTES, peer_id_from_public_key
from protocol.wire.messages import CAPS, WireStruct, register_struct
from protocol.wire.verified import VerifiedSignatures, verify_ed25519

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "DOMAIN",
    "RECORD_REFRESH_STRUCT_CODE",
    "RECORD_STRUCT_CODE",
    "RecordRefresh",
    "RecordSigner",
    "SignedRecord",
    "record_signing_bytes",
    "sign_record",
    "verify_record",
]

DOMAIN = "atoll/dht/record/v1"
DEFAULT_MAX_VALUE_BYTES = CAPS.max_bytes  # the wire's cap on inline bytes
RECORD_STRUCT_CODE = 32  # struct code space; mirrors the DHT's message codes 32-63
RECORD_REFRESH_STRUCT_CODE = 33


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


@register_struct(RECORD_REFRESH_STRUCT_CODE)
@dataclass(frozen=True, slots=True, kw_only=True)
class RecordRefresh(WireStruct):
    """A newer expiry of a record whose value the reader already holds: the publisher's
    signature over the same signed bytes as a ``SignedRecord`` of that value and this expiry
    (``refreshed`` rebuilds the record; ``verify_record`` then checks it as any other). About
    110 bytes on the wire instead of the whole record: what a delta read sends for a record that
    was only republished (``protocol.dht.delta_reads``)."""

    subkey: bytes
    expires_at: float
    signature: bytes

    def _check(self) -> None:
        for name, size in (("subkey", ID_BYTES), ("signature", 64)):
            n = len(getattr(self, name))
            if n != size:
                raise DecodeError(f"RecordRefresh.{name} must be {size} bytes, got {n}")

    @classmethod
    def of(cls, rec: SignedRecord) -> RecordRefresh:
        """The refresh that carries ``rec``'s expiry and signature (not its value)."""
        return cls(subkey=rec.subkey, expires_at=rec.expires_at, signature=rec.signature)

    def refreshed(self, held: SignedRecord) -> SignedRecord:
        """``held`` (same key and subkey) with this expiry and signature: still to be verified
        (``verify_record``), which fails unless the publisher signed ``held``'s very value with
        this expiry. Raises ``DecodeError`` when ``held`` is another subkey's record."""
        if held.subkey != self.subkey:
            raise DecodeError(
                f"a refresh for subkey {self.subkey.hex()[:16]} applied to "
                f"{held.subkey.hex()[:16]}'s record"
            )
        return SignedRecord(
            key=held.key,
            subkey=held.subkey,
            value=held.value,
            expires_at=self.expires_at,
            public_key=held.public_key,
            signature=self.signature,
        )


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
    rec: SignedRecord,
    *,
    now: float,
    max_ttl: float,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    verified: VerifiedSignatures | None = None,
) -> None:
    """Accept ``rec`` or raise why not, cheapest check first. With ``verified`` (the node's
    memory of signatures that verified) a signature this node checked before over the same
    bytes is not verified again; every other check is made on every call.

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
    what = f"record for subkey {rec.subkey.hex()[:16]}"
    check = verify_ed25519 if verified is None else verified.verify
    check(rec.public_key, rec.signature, rec.signing_bytes(), what)
