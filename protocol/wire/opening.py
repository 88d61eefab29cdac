"""The receiving side of signed envelopes: parse and verify a sealed message (``open_sealed``,
``verify_sealed``, or in steps with ``split_sealed``, ``Envelope.admit`` and ``Admitted.decode``).

The receiver checks, in this order: the envelope (small, capped), its signature over the
exact bytes received (``BadSignature``), the message size against the cap (``Oversize``), the
recipient when it expects one (``NotAuthorized``: a request captured on its way to node A and
replayed to node B names A) and the received length (``DecodeError``), the content hash
(``BadSignature``), then timestamp skew and nonce reuse (``Replay``, see ``protocol.wire.replay``)
and only then decodes the body. A forged packet can therefore neither poison the replay window
nor make the receiver parse its body; with ``SealedReader`` (``protocol.wire.sealed_reader``) it
cannot even make it allocate the body buffer. ``Envelope.admit`` and ``Admitted.decode`` split
the last step, so that a node can run the decode of a large body in a worker thread while the
replay window stays on its loop.

``verify_sealed`` skips the replay window on purpose: an owner's sealed ``FragmentState`` is
cached and re-served verbatim by replicas for as long as it is the newest version, so the same
bytes legitimately arrive many times and long after their timestamp. Freshness comes from the
version number inside the message instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.errors import BadSignature, DecodeError, NotAuthorized, Oversize
from protocol.ids import ID_BYTES, peer_id_from_public_key
from protocol.wire.codec import Buffer, byte_view, decode
from protocol.wire.messages import Message
from protocol.wire.replay import ReplayWindow
from protocol.wire.sealing import (
    DIGEST_BYTES,
    DOMAIN,
    ENVELOPE_VERSION,
    LENGTH_PREFIX,
    MAX_ENVELOPE,
    NONCE_BYTES,
    SIGNATURE_BYTES,
    Digests,
    message_digests,
)
from protocol.wire.signer import KEY_BYTES

__all__ = [
    "Admitted",
    "Envelope",
    "Opened",
    "envelope_length",
    "open_envelope",
    "open_sealed",
    "split_sealed",
    "verify_sealed",
]


@dataclass(frozen=True, slots=True)
class Opened:
    """A verified, decoded message and who sent it when, to whom (empty: a broadcast)."""

    public_key: bytes
    peer_id: bytes
    timestamp: float
    nonce: bytes
    message: Message
    recipient: bytes = b""
    blobs_digest: bytes | None = None  # the verified body's ``Digests.blobs`` (see ``sealing``)


def _short(peer_id: bytes) -> str:
    return peer_id.hex()[:16]


@dataclass(frozen=True, slots=True)
class Envelope:
    """An envelope whose signature has been verified; the body is still to be checked."""

    public_key: bytes
    timestamp: float
    nonce: bytes
    digest: bytes
    size: int
    recipient: bytes = b""

    @property
    def peer_id(self) -> bytes:
        """The sender's peer id (from the verified public key)."""
        return peer_id_from_public_key(self.public_key)

    def check_recipient(self, expected: bytes | None, *, broadcast_ok: bool = False) -> None:
        """Refuse a message sealed for another node than ``expected`` (None: no check), and a
        broadcast unless ``broadcast_ok``. Raises NotAuthorized with the reason."""
        if expected is None or self.recipient == expected:
            return
        if not self.recipient:
            if broadcast_ok:
                return
            raise NotAuthorized(
                "message names no recipient (a broadcast); one sent here must name this node "
                f"{_short(expected)}"
            )
        raise NotAuthorized(
            f"message sealed for peer {_short(self.recipient)}, not for this node "
            f"{_short(expected)}: replayed from elsewhere?"
        )

    def admit(
        self,
        body: Buffer,
        *,
        now: float,
        replay: ReplayWindow,
        expected_recipient: bytes | None = None,
        digests: Digests | None = None,
    ) -> Admitted:
        """Check ``body`` against this envelope (length, content hash), its recipient, then skew
        and replay; the decode is left to ``Admitted.decode``. ``digests`` are the body's
        ``message_digests`` when the caller has computed them already (e.g. in a worker thread).

        Raises DecodeError (wrong length), NotAuthorized (another recipient), BadSignature
        (content hash mismatch) or Replay.
        """
        mv = _body_view(self, body)
        self.check_recipient(expected_recipient)
        digests = self._check_digest(mv, digests)
        replay.accept(self.public_key, self.nonce, self.timestamp, now=now)
        return Admitted(self, mv, digests.blobs)

    def _check_digest(self, mv: memoryview, digests: Digests | None) -> Digests:
        if digests is None:
            digests = message_digests(mv)
        if digests.message != self.digest:
            raise BadSignature("content hash mismatch")
        return digests

    def open_body(
        self,
        body: Buffer,
        *,
        now: float,
        replay: ReplayWindow,
        expected_recipient: bytes | None = None,
    ) -> Opened:
        """``admit`` then ``decode``: raises as both."""
        admitted = self.admit(body, now=now, replay=replay, expected_recipient=expected_recipient)
        return admitted.decode()

    def verify_body(self, body: Buffer) -> Opened:
        """Like ``open_body`` without the replay window nor a recipient (see ``verify_sealed``)."""
        mv = _body_view(self, body)
        return Admitted(self, mv, self._check_digest(mv, None).blobs).decode()


@dataclass(frozen=True, slots=True)
class Admitted:
    """A body that passed its envelope's checks and the replay window, not decoded yet.

    ``decode`` touches no shared state: it may run in a worker thread.
    """

    envelope: Envelope
    body: memoryview
    blobs_digest: bytes | None = None

    def decode(self) -> Opened:
        """The decoded message; raises DecodeError or Oversize (see ``codec.decode``)."""
        env = self.envelope
        message = decode(self.body, max_size=env.size)
        return Opened(
            env.public_key,
            env.peer_id,
            env.timestamp,
            env.nonce,
            message,
            env.recipient,
            self.blobs_digest,
        )


def _body_view(env: Envelope, body: Buffer) -> memoryview:
    mv = byte_view(body)
    if mv.nbytes != env.size:
        raise DecodeError(f"message is {mv.nbytes} bytes, its envelope says {env.size}")
    return mv


def envelope_length(head: Buffer) -> int:
    """The envelope length from the first 4 bytes of a sealed message.

    Raises DecodeError if fewer than 4 bytes, Oversize if over ``MAX_ENVELOPE``.
    """
    mv = byte_view(head)
    if mv.nbytes < LENGTH_PREFIX.size:
        raise DecodeError(f"truncated: {mv.nbytes} bytes is shorter than the envelope prefix")
    (n,) = LENGTH_PREFIX.unpack_from(mv)
    if n > MAX_ENVELOPE:
        raise Oversize(f"envelope of {n} bytes exceeds the cap of {MAX_ENVELOPE}")
    return int(n)


def _unpack_small(data: Buffer, n: int) -> tuple[Any, ...]:
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=False,
            max_bin_len=MAX_ENVELOPE,
            max_str_len=0,
            max_array_len=8,
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        raise DecodeError(f"malformed envelope: {type(e).__name__}: {e}") from e
    if type(raw) is not tuple or len(raw) != n:
        raise DecodeError(f"envelope part is not an array of {n}")
    return raw


def _check_field(ok: bool, what: str) -> None:
    if not ok:
        raise DecodeError(f"bad envelope field: {what}")


def open_envelope(envelope: Buffer, *, max_size: int) -> Envelope:
    """Parse an envelope and verify its signature; nothing of the body is looked at.

    Raises Oversize (envelope over ``MAX_ENVELOPE``, or declared message size over
    ``max_size``), DecodeError (malformed) or BadSignature.
    """
    if byte_view(envelope).nbytes > MAX_ENVELOPE:
        raise Oversize(f"envelope exceeds the cap of {MAX_ENVELOPE} bytes")
    signed, signature = _unpack_small(envelope, 2)
    _check_field(type(signed) is bytes and type(signature) is bytes, "not [bin, bin]")
    version, key, ts, nonce, digest, size, recipient = _unpack_small(signed, 7)
    _check_field(type(version) is int and version == ENVELOPE_VERSION, f"version {version!r}")
    _check_field(type(key) is bytes and len(key) == KEY_BYTES, "public key")
    _check_field(type(ts) is float and math.isfinite(ts), "timestamp")
    _check_field(type(nonce) is bytes and len(nonce) == NONCE_BYTES, "nonce")
    _check_field(type(digest) is bytes and len(digest) == DIGEST_BYTES, "digest")
    _check_field(type(size) is int and size >= 0, "size")
    _check_field(type(recipient) is bytes and len(recipient) in (0, ID_BYTES), "recipient")
    _check_field(len(signature) == SIGNATURE_BYTES, "signature length")
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, DOMAIN + signed)
    except (InvalidSignature, ValueError) as e:
        raise BadSignature("envelope signature does not verify") from e
    if size > max_size:
        raise Oversize(f"message of {size} bytes exceeds the cap of {max_size}")
    return Envelope(
        public_key=key, timestamp=ts, nonce=nonce, digest=digest, size=size, recipient=recipient
    )


def _split(wire: Buffer, max_size: int) -> tuple[Envelope, memoryview]:
    mv = byte_view(wire)
    if mv.nbytes > LENGTH_PREFIX.size + MAX_ENVELOPE + max_size:
        raise Oversize(f"sealed message of {mv.nbytes} bytes exceeds the cap of {max_size}")
    end = LENGTH_PREFIX.size + envelope_length(mv)
    if mv.nbytes < end:
        raise DecodeError(f"truncated: envelope needs {end} bytes, have {mv.nbytes}")
    env = open_envelope(mv[LENGTH_PREFIX.size : end], max_size=max_size)
    return env, mv[end:]


def split_sealed(
    wire: Buffer, *, max_size: int, expected_recipient: bytes | None = None
) -> tuple[Envelope, memoryview]:
    """The verified envelope of a sealed message and its body, not yet hashed nor decoded: a
    receiver can decide from ``Envelope.peer_id`` whether the sender may ask this at all, and
    refuse a message sealed for another node (``expected_recipient``, see
    ``Envelope.check_recipient``), before the body costs it a hash, a decode or a place in its
    replay window.

    Raises Oversize, DecodeError, BadSignature or NotAuthorized.
    """
    env, body = _split(wire, max_size)
    env.check_recipient(expected_recipient)
    return env, body


def open_sealed(
    wire: Buffer,
    *,
    now: float,
    replay: ReplayWindow,
    max_size: int,
    expected_recipient: bytes | None = None,
) -> Opened:
    """Verify, recipient- and replay-check and decode a whole sealed message (see the module
    docstring).

    Raises Oversize, DecodeError, BadSignature, NotAuthorized or Replay.
    """
    env, body = split_sealed(wire, max_size=max_size, expected_recipient=expected_recipient)
    return env.open_body(body, now=now, replay=replay)


def verify_sealed(wire: Buffer, *, max_size: int) -> Opened:
    """Verify signature and content hash and decode, without the replay window: for cached
    owner-signed states re-served verbatim by other peers. Raises as ``open_sealed``, less
    Replay."""
    env, body = _split(wire, max_size)
    return env.verify_body(body)
