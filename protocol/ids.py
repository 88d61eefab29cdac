"""Peer identities, XOR distance and rendezvous scores.

A peer id is the SHA-256 of the peer's raw Ed25519 public key (32 bytes). The DHT measures
closeness by XOR distance between ids; fragment ownership ranks peers by a rendezvous (highest
random weight) score of ``(swarm, fragment, peer)``, so every peer computes the same owners from
the same member list without talking.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

from protocol.errors import LocalProtocolError

__all__ = [
    "ID_BYTES",
    "key_id",
    "peer_id_from_public_key",
    "rendezvous_rank",
    "rendezvous_score",
    "xor_distance",
]

ID_BYTES = 32


def peer_id_from_public_key(public_key: bytes) -> bytes:
    """The 32-byte peer id of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise LocalProtocolError(f"public key must be 32 raw bytes, got {len(public_key)}")
    return hashlib.sha256(b"atoll/peer/" + public_key).digest()


def key_id(key: bytes | str) -> bytes:
    """The 32-byte DHT id of an arbitrary key (a swarm name, a record key)."""
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(b"atoll/key/" + raw).digest()


def xor_distance(a: bytes, b: bytes) -> int:
    """Kademlia's XOR metric between two ids of equal length."""
    if len(a) != len(b):
        raise LocalProtocolError(f"ids differ in length: {len(a)} vs {len(b)}")
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")


@functools.lru_cache(maxsize=1 << 16)
def rendezvous_score(swarm: str, fragment: int, peer_id: bytes) -> int:
    """Highest-random-weight score of ``peer_id`` for ``fragment`` of ``swarm``."""
    h = hashlib.sha256(f"atoll/owner/{swarm}/{fragment}/".encode() + peer_id).digest()
    return int.from_bytes(h[:16], "big")


def rendezvous_rank(swarm: str, fragment: int, peers: Iterable[bytes], r: int) -> Sequence[bytes]:
    """The ``r`` best-scoring peers for ``fragment``, best first (fewer if fewer peers)."""
    if r < 1:
        raise LocalProtocolError(f"replica count r must be >= 1, got {r}")
    ranked = sorted(set(peers), key=lambda p: rendezvous_score(swarm, fragment, p), reverse=True)
    return ranked[:r]
