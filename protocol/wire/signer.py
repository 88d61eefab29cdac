"""A peer's Ed25519 signing key (``Signer``): it signs envelopes, membership records and the
peer's TLS certificate, and its public key names the peer (``protocol.ids``)."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from protocol.errors import LocalProtocolError
from protocol.ids import peer_id_from_public_key

__all__ = ["KEY_BYTES", "Signer"]

KEY_BYTES = 32


class Signer:
    """An Ed25519 private key (raw 32 bytes) that signs for one peer."""

    __slots__ = ("_key", "peer_id", "public_key")

    def __init__(self, private_bytes: bytes) -> None:
        """Raises LocalProtocolError unless ``private_bytes`` is 32 raw bytes."""
        if len(private_bytes) != KEY_BYTES:
            raise LocalProtocolError(f"private key must be 32 raw bytes, got {len(private_bytes)}")
        self._key = Ed25519PrivateKey.from_private_bytes(bytes(private_bytes))
        self.public_key = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.peer_id = peer_id_from_public_key(self.public_key)

    @classmethod
    def from_seed(cls, seed: bytes) -> Signer:
        """A signer from a 32-byte seed (an Ed25519 private key is its seed)."""
        return cls(seed)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        return self._key.sign(data)

    def private_key(self) -> Ed25519PrivateKey:
        """The key itself, for the peer's TLS certificate and for writing the key file."""
        return self._key

    def __repr__(self) -> str:
        return f"Signer(peer_id={self.peer_id.hex()[:16]}…)"
