"""The sending side of signed envelopes: the envelope format's constants, the message digest it
signs, and ``seal``, which wraps encoded message bytes into a ``Sealed`` message.

A sealed message on the wire is::

    envelope length (u32 BE) | envelope | message bytes (exactly as ``codec.encode`` made them)

The envelope is msgpack ``[signed, signature]`` where ``signed`` is msgpack ``[version,
public_key, timestamp, nonce, message digest, message size, recipient]`` and ``signature`` is
Ed25519 over ``DOMAIN + signed``. ``recipient`` is the peer id of the one node the message is
meant for, or empty for a broadcast (an owner's ``FragmentState``, re-served by anyone).

The message digest is BLAKE3 (256 bits) over the message's two parts, each hashed on its own::

    BLAKE3(FRAMED | BLAKE3(head) | BLAKE3(blob 0 | blob 1 | ...))

where the head is the frame prefix and header and the blobs are the tensor bytes end to end
(the zero padding between them is checked by the decoder, not hashed). The blobs' digest of a
``FragmentState`` is its ``content_hash``, and of an fp32 state its flat digest: an owner
that has hashed a version's bytes once seals it (and hands it to a replica) without hashing
them again, and a receiver checks such a field against the digest it computed anyway. A body
that is not a well-framed message is digested whole (``BLAKE3(RAW | body)``) and refused by
the decoder after the signature check, as before. Every byte of a fragment is hashed once by
its sender and once by each receiver: BLAKE3 does that 1.5-3.5x faster than SHA-256 on one
core (2.1-4.5 vs 1.3-1.4 GB/s on this project's 2-core machines, AVX2, no AVX-512), and the
signer hashes the parts streaming, so a 400 MB tensor is never copied to be signed.
``message_digests`` is the one place the digest is computed. The receiving side is
``protocol.wire.opening``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import blake3
import msgpack

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.ids import ID_BYTES
from protocol.wire.codec import Buffer, Encoded, byte_view, chunk_views
from protocol.wire.decoding import frame_parts
from protocol.wire.signer import Signer

__all__ = [
    "DIGEST_BYTES",
    "DOMAIN",
    "ENVELOPE_VERSION",
    "LENGTH_PREFIX",
    "MAX_ENVELOPE",
    "NONCE_BYTES",
    "SIGNATURE_BYTES",
    "Digests",
    "Sealed",
    "digest_parts",
    "message_digest",
    "message_digests",
    "seal",
]

ENVELOPE_VERSION = 5  # 2: the recipient joined the signed fields; 3: the message digest is BLAKE3; 4: so are state digests; 5: head and blobs digested apart
NONCE_BYTES = 16
SIGNATURE_BYTES = 64
DIGEST_BYTES = 32
MAX_ENVELOPE = 512
DOMAIN = b"atoll/envelope/v1\x00"
LENGTH_PREFIX = struct.Struct(">I")  # the envelope length before the envelope
FRAMED = b"atoll/message/framed\x00"
RAW = b"atoll/message/raw\x00"


@dataclass(frozen=True, slots=True)
class Digests:
    """A message's digest (what an envelope signs) and, for a well-framed message, the digest
    of its blobs end to end (None for a body digested whole)."""

    message: bytes
    blobs: bytes | None


def message_digests(data: Buffer) -> Digests:
    """The digests of the message bytes ``data`` (see the module docstring)."""
    mv = byte_view(data)
    try:
        head, blobs = frame_parts(mv)
    except RemoteProtocolError:
        raw = blake3.blake3(RAW)
        raw.update(mv)
        return Digests(raw.digest(), None)
    blobs_digest = digest_parts(blobs)
    return Digests(_framed(head, blobs_digest), blobs_digest)


def message_digest(data: Buffer) -> bytes:
    """The digest an envelope signs for the message bytes ``data`` (32 bytes)."""
    return message_digests(data).message


def digest_parts(parts: Sequence[Buffer]) -> bytes:
    """BLAKE3 (32 bytes) of the concatenation of ``parts``, without concatenating them."""
    h = blake3.blake3()
    for part in parts:
        h.update(part)
    return h.digest()


def _framed(head: Buffer, blobs_digest: bytes) -> bytes:
    return blake3.blake3(FRAMED + blake3.blake3(head).digest() + blobs_digest).digest()


def _encoded_digest(encoded: Encoded, blobs_digest: bytes | None) -> bytes:
    if encoded.blobs is None:  # parts made by hand (tests, fuzzing): digested as a receiver would
        return message_digest(b"".join(encoded.parts))
    if blobs_digest is None:
        blobs_digest = digest_parts(encoded.blobs)
    return _framed(encoded.parts[0], blobs_digest)


@dataclass(frozen=True, slots=True)
class Sealed:
    """A signed message ready to send: ``envelope`` bytes plus the message's parts, and the
    message's digest that the envelope signs (the receiver's ``Envelope.digest`` once verified):
    the same message bytes always have the same digest, whoever seals them and when."""

    envelope: bytes
    message: Encoded
    digest: bytes = b""

    @property
    def size(self) -> int:
        return LENGTH_PREFIX.size + len(self.envelope) + self.message.size

    @property
    def parts(self) -> list[memoryview]:
        return [
            memoryview(LENGTH_PREFIX.pack(len(self.envelope)) + self.envelope),
            *self.message.parts,
        ]

    def iter_chunks(self, chunk_size: int = 1 << 20) -> Iterator[memoryview]:
        """The whole wire form in chunks of at most ``chunk_size`` (big blobs not copied)."""
        return chunk_views(self.parts, chunk_size)

    def tobytes(self) -> bytes:
        """The whole wire form as bytes (a copy; for small messages, caches and tests)."""
        return b"".join(self.parts)


def seal(
    encoded: Encoded,
    signer: Signer,
    *,
    now: float,
    nonce: bytes,
    recipient: bytes = b"",
    blobs_digest: bytes | None = None,
) -> Sealed:
    """Sign ``encoded`` as sent by ``signer`` at time ``now`` with a fresh 16-byte ``nonce``, for
    the peer id ``recipient`` (empty: a broadcast, such as a state anyone may re-serve).
    ``blobs_digest``: ``digest_parts`` of the message's blobs when the caller has computed it
    already (a version's ``content_hash``): they are not hashed again. A wrong one seals a
    digest no receiver computes, so the message is refused as tampered with.

    Raises LocalProtocolError on a bad nonce, recipient or ``blobs_digest``, or a non-finite ``now``.
    """
    if len(nonce) != NONCE_BYTES:
        raise LocalProtocolError(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    if len(recipient) not in (0, ID_BYTES):
        raise LocalProtocolError(
            f"recipient must be empty or a {ID_BYTES}-byte peer id, got {len(recipient)}"
        )
    if blobs_digest is not None and (len(blobs_digest) != DIGEST_BYTES or encoded.blobs is None):
        raise LocalProtocolError("blobs_digest must be 32 bytes, for a message made by encode")
    if not math.isfinite(now):
        raise LocalProtocolError(f"timestamp {now} is not finite")
    digest = _encoded_digest(encoded, blobs_digest)
    fields = [
        ENVELOPE_VERSION,
        signer.public_key,
        float(now),
        bytes(nonce),
        digest,
        encoded.size,
        bytes(recipient),
    ]
    signed = msgpack.packb(fields, use_bin_type=True)
    envelope = msgpack.packb([signed, signer.sign(DOMAIN + signed)], use_bin_type=True)
    return Sealed(envelope=envelope, message=encoded, digest=digest)
