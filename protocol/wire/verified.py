"""A bounded memory of Ed25519 signatures that verified: check the same signed bytes once.

Why: a node sees the same signed bytes more than once. A quorum read gets the same record
refresh from every responder it asks, and a record read again before it changed comes back
byte for byte; each Ed25519 verify costs ~140-180 us here (OpenSSL through ``cryptography``).

What it remembers: only successes, keyed by the public key, the full 64-byte signature and the
SHA-256 of exactly the bytes verified. A hit therefore means this very key signed these very
bytes with this very signature before and it verified; a changed byte, key or signature misses
and is verified in full (a SHA-256 collision would be needed to hit otherwise). Failures are
never remembered, so a bad signature costs a verify every time, as before. At most ``capacity``
entries (least recently used dropped first), ~250 bytes each (1 MB at 4,096). Time plays no
part: whatever the caller checks about *when* (expiry, skew, replay) it still checks each call.

One object per node (``VerifiedSignatures``), never a process-wide one: peers sharing a process
in a benchmark must each pay for their own checks, as they would on their own machines.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.errors import BadSignature, LocalProtocolError

__all__ = ["DEFAULT_CAPACITY", "VerifiedSignatures", "verify_ed25519"]

DEFAULT_CAPACITY = 4096


def verify_ed25519(public_key: bytes, signature: bytes, data: bytes, what: str) -> None:
    """Verify in full; ``BadSignature`` ("``what``: signature does not verify") unless it does
    (a malformed key or signature included)."""
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), data)
    except (InvalidSignature, ValueError):
        raise BadSignature(f"{what}: signature does not verify") from None


class VerifiedSignatures:
    """An LRU set of (public key, signature, SHA-256 of the data) that verified.

    ``verify`` is ``verify_ed25519`` that skips the Ed25519 work for a triple it has seen
    verify. ``verified`` and ``hits`` count full verifies that succeeded and skipped ones.
    """

    __slots__ = ("_seen", "capacity", "hits", "verified")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        """Raises ``LocalProtocolError`` for a capacity under 1."""
        if capacity < 1:
            raise LocalProtocolError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.hits = 0
        self.verified = 0
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def verify(self, public_key: bytes, signature: bytes, data: bytes, what: str) -> None:
        """As ``verify_ed25519``; a triple that verified before is not verified again."""
        entry = _entry(public_key, signature, data)
        if entry in self._seen:
            self._seen.move_to_end(entry)
            self.hits += 1
            return
        verify_ed25519(public_key, signature, data, what)  # raises: nothing is remembered
        self.verified += 1
        self._seen[entry] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


def _entry(public_key: bytes, signature: bytes, data: bytes) -> bytes:
    # lengths first, so no (key, signature) split of one byte string can pose as another
    key, sig = bytes(public_key), bytes(signature)
    head = len(key).to_bytes(2, "big") + len(sig).to_bytes(2, "big")
    return head + key + sig + hashlib.sha256(data).digest()
