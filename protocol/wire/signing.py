"""Signed envelopes around encoded messages, addressed to one recipient or broadcast.

Theory of operation. A sealed message on the wire is::

    envelope length (u32 BE) | envelope | message bytes (exactly as ``codec.encode`` made them)

The envelope signs the sender's public key, a timestamp, a nonce, the recipient (empty: a
broadcast) and the BLAKE3 digest and size of the message bytes. The receiver verifies the
envelope's signature over the exact bytes received before it hashes, replay-checks or decodes
the body. This module is the import point; the code lives beside it:

- ``signer``: ``Signer``, a peer's Ed25519 key.
- ``sealing``: the format (fields, constants, ``message_digest``) and ``seal`` -> ``Sealed``.
- ``opening``: the receiver's checks, in order, and why ``verify_sealed`` skips the replay
  window: ``open_envelope``, ``split_sealed``, ``open_sealed``, ``verify_sealed``, ``Envelope``,
  ``Admitted``, ``Opened``.
- ``sealed_reader``: ``SealedReader``, the same checks chunk by chunk, body buffer allocated
  only once the envelope has verified.
- ``replay``: ``ReplayWindow``, timestamp skew and nonce reuse.

Time (``now``) and nonces are arguments: this module reads no clock and draws no randomness.
"""

from __future__ import annotations

from protocol.wire.opening import (
    Admitted,
    Envelope,
    Opened,
    envelope_length,
    open_envelope,
    open_sealed,
    split_sealed,
    verify_sealed,
)
from protocol.wire.replay import ReplaySizes, ReplayWindow
from protocol.wire.sealed_reader import SealedReader
from protocol.wire.sealing import (
    DIGEST_BYTES,
    DOMAIN,
    ENVELOPE_VERSION,
    MAX_ENVELOPE,
    NONCE_BYTES,
    SIGNATURE_BYTES,
    Digests,
    Sealed,
    digest_parts,
    message_digest,
    message_digests,
    seal,
)
from protocol.wire.signer import KEY_BYTES, Signer

__all__ = [
    "DIGEST_BYTES",
    "DOMAIN",
    "ENVELOPE_VERSION",
    "KEY_BYTES",
    "MAX_ENVELOPE",
    "NONCE_BYTES",
    "SIGNATURE_BYTES",
    "Admitted",
    "Digests",
    "Envelope",
    "Opened",
    "ReplaySizes",
    "ReplayWindow",
    "Sealed",
    "SealedReader",
    "Signer",
    "digest_parts",
    "envelope_length",
    "message_digest",
    "message_digests",
    "open_envelope",
    "open_sealed",
    "seal",
    "split_sealed",
    "verify_sealed",
]
