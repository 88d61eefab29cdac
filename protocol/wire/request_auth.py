"""Request authentication: the ``Atoll-Auth`` header, a key's signature over one request.

Requests over HTTP carry the sender's key and certificate in two headers: the key signs the swarm
id, method, path, a timestamp, the peer id of the node it means to reach and a random nonce, so
a server can refuse a stranger before it reads a body or serves a byte. A captured header is
worthless after ``MAX_SKEW_S``, for another swarm, route or method, at any node but the one it
names (the server refuses a header naming another peer id), and at that node too once it has
been used (``ReplayCache``: the server remembers each accepted (key, nonce) until its timestamp
leaves the skew window). TLS keeps headers from eavesdroppers.

A client names the recipient whenever it knows it (from the member records, for owners,
holders and replicas). On first contact (an initial peer given as a bare URL, ``atoll status``)
it does not, and the header names none ("-"): a server takes such a header only on the routes
that are safe to reach before knowing whom (``unbound_ok`` in ``node.wire.admission``: the
manifest, the member listing, the dial-back and status, and the DHT and RPC routes, whose signed
bodies name their recipient themselves); anywhere else it is a 401 with the reason.

Version 1 headers (no recipient, no nonce) are refused with a 401 that says to upgrade, never
taken silently.

Outside certified swarms a client leaves both headers off the routes whose bodies are sealed
envelopes (``sealed_route``: the DHT's and RPC's POSTs): the envelope signs the sender's key,
the time, a nonce and the recipient, and the route verifies it (its replay window included)
before it decodes the body, so the header added a second signature and ~630 bytes a request
(with a certificate) and nothing a key minted for the purpose could not pass. Such a request is
an anonymous one to admission, which open and development swarms serve (older peers did too),
and the route checks the envelope's signer as before. A certified swarm keeps both headers: its
admission refuses a request without a certificate before reading a byte of its body.

Pure: text in, values or ``RemoteProtocolError`` out, ``now`` and the nonce passed in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections import Counter, deque
from dataclasses import dataclass

import msgpack

from protocol.errors import DecodeError, NotAuthorized, Oversize, RemoteProtocolError
from protocol.wire.membership import (
    SIG_BYTES,
    ManifestSigner,
    hex_key,
    verify_signature,
)

__all__ = [
    "AUTH_HEADER",
    "MAX_SKEW_S",
    "NONCE_BYTES",
    "AuthRefused",
    "ReplayCache",
    "RequestAuth",
    "sealed_route",
]

AUTH_DOMAIN = "atoll/request-auth/v2"
AUTH_HEADER = "Atoll-Auth"
MAX_SKEW_S = 60.0  # a request's signed timestamp may be this far from the server's clock
NONCE_BYTES = 16
MAX_HEADER_CHARS = 384  # "v2", key, time, recipient, nonce and signature: ~270 characters
NO_RECIPIENT = "-"


def sealed_route(method: str, path: str) -> bool:
    """Whether a request of ``method`` to ``path`` carries a sealed envelope that its route
    verifies before decoding (``POST /v1/rpc``, ``POST /v1/dht`` and ``/v1/dht/<name>``): outside
    certified swarms it needs no ``Atoll-Auth`` (see the module docstring)."""
    if method.upper() != "POST":
        return False
    return (
        path == "/v1/rpc"
        or path == "/v1/dht"
        or (path.startswith("/v1/dht/") and "/" not in path[len("/v1/dht/") :])
    )


class AuthRefused(RemoteProtocolError):
    """An ``Atoll-Auth`` header that is well formed but not good here: an old version, meant for
    another node, naming no node on a route that needs one, or used before (a replay)."""

    status = 401


@dataclass(frozen=True, slots=True)
class RequestAuth:
    """The ``Atoll-Auth`` header:
    ``v2 <public key hex> <unix time> <recipient peer id hex, or -> <nonce hex> <signature base64>``."""

    public_key: bytes
    timestamp: float
    recipient: bytes  # b"": the sender did not know whom it reached (first contact)
    nonce: bytes
    signature: bytes

    @staticmethod
    def signing_bytes(
        swarm: str, method: str, target: str, timestamp: float, recipient: bytes, nonce: bytes
    ) -> bytes:
        return bytes(
            msgpack.packb(
                [AUTH_DOMAIN, swarm, method.upper(), target, float(timestamp), recipient, nonce],
                use_bin_type=True,
            )
        )

    @classmethod
    def make(
        cls,
        signer: ManifestSigner,
        *,
        swarm: str,
        method: str,
        target: str,
        now: float,
        recipient: bytes | None,
        nonce: bytes,
    ) -> str:
        """The header value for a request of ``method`` to ``target`` (path and query) at the node
        ``recipient`` (its peer id; None when not known yet). ``nonce``: ``NONCE_BYTES`` random
        bytes, fresh for every request."""
        if len(nonce) != NONCE_BYTES or (recipient is not None and len(recipient) != 32):
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes and a recipient a 32-byte peer id")
        ts = round(now, 3)
        to = recipient or b""
        sig = signer.sign(cls.signing_bytes(swarm, method, target, ts, to, nonce))
        return (
            f"v2 {signer.public_key.hex()} {ts!r} {to.hex() or NO_RECIPIENT} {nonce.hex()} "
            f"{base64.b64encode(sig).decode()}"
        )

    @classmethod
    def parse(cls, value: str) -> RequestAuth:
        """Raises ``Oversize``/``DecodeError`` for a malformed header, ``AuthRefused`` (401) for a
        version 1 header."""
        if len(value) > MAX_HEADER_CHARS:
            raise Oversize(f"{AUTH_HEADER} header of {len(value)} characters is too long")
        parts = value.split(" ")
        if parts[0] == "v1":
            raise AuthRefused(
                f"{AUTH_HEADER} v1 is no longer accepted: it names neither the node it is for nor a "
                "nonce, so a captured one could be replayed; upgrade atoll (this node takes v2)"
            )
        if len(parts) != 6 or parts[0] != "v2":
            raise DecodeError(
                f"{AUTH_HEADER} must be 'v2 <key hex> <unix time> <recipient peer id hex or -> "
                "<nonce hex> <signature base64>'"
            )
        key = hex_key(parts[1], f"{AUTH_HEADER} key")
        recipient = (
            b"" if parts[3] == NO_RECIPIENT else hex_key(parts[3], f"{AUTH_HEADER} recipient")
        )
        try:
            ts = float(parts[2]) if len(parts[2]) <= 24 else math.nan
            nonce = (
                bytes.fromhex(parts[4])
                if len(parts[4]) == 2 * NONCE_BYTES and parts[4].isalnum()
                else b""
            )
            sig = base64.b64decode(parts[5], validate=True)
        except (ValueError, binascii.Error):
            raise DecodeError(f"{AUTH_HEADER}: bad time, nonce or signature encoding") from None
        if not math.isfinite(ts) or len(sig) != SIG_BYTES or len(nonce) != NONCE_BYTES:
            raise DecodeError(
                f"{AUTH_HEADER}: time must be finite, the nonce {NONCE_BYTES} bytes in hex and the "
                f"signature {SIG_BYTES} bytes"
            )
        return cls(key, ts, recipient, nonce, sig)

    def verify(
        self,
        *,
        swarm: str,
        method: str,
        target: str,
        now: float,
        recipient: bytes,
        unbound_ok: bool = False,
    ) -> None:
        """Check the header for a request to this node (peer id ``recipient``). Raises
        ``NotAuthorized`` for a stale or future timestamp, ``AuthRefused`` for a header naming
        another node (or none, unless ``unbound_ok``: a route reachable on first contact),
        ``BadSignature`` for a bad signature. Replays are ``ReplayCache``'s to catch."""
        if abs(now - self.timestamp) > MAX_SKEW_S:
            raise NotAuthorized(
                f"{AUTH_HEADER} is dated {self.timestamp - now:+.0f} s from this node's clock "
                f"(at most {MAX_SKEW_S:.0f} s apart): check the sender's clock"
            )
        if self.recipient and self.recipient != recipient:
            raise AuthRefused(
                f"{AUTH_HEADER} names peer {self.recipient.hex()[:16]}, not this node "
                f"({recipient.hex()[:16]}): a header is good only at the node it was signed for"
            )
        if not unbound_ok:
            self.check_bound(recipient)
        verify_signature(
            self.public_key,
            self.signature,
            self.signing_bytes(swarm, method, target, self.timestamp, self.recipient, self.nonce),
            f"{AUTH_HEADER} of {self.public_key.hex()[:16]}",
        )

    def check_bound(self, recipient: bytes) -> None:
        """``AuthRefused`` for a header that names no recipient, on a route that needs one (a
        server may check this after the certificate, so a stranger learns why it is refused)."""
        if not self.recipient:
            raise AuthRefused(
                f"{AUTH_HEADER} names no recipient, which only the routes reachable on first contact "
                f"accept: sign for this node's peer id ({recipient.hex()[:16]}…, in its member record)"
            )

    @property
    def expires_at(self) -> float:
        """When a server stops taking this header whatever it remembers (its skew window ends)."""
        return self.timestamp + MAX_SKEW_S


class ReplayCache:
    """The (key, nonce) of every header accepted in the last skew window, so each is taken once.

    An entry is kept until its header's timestamp leaves the skew window (after that the clock
    check refuses it anyway), so memory follows the request rate over ``2 * MAX_SKEW_S`` at most.
    It is also capped at ``max_entries``: past it, the oldest entry of the *source* (the sender's
    address) holding the most entries is dropped, so a flood of signed requests from one address
    (keys cost nothing in open swarms) evicts only its own entries, never another address's.
    Only headers whose signature verified are added, so a stranger cannot fill it with guesses.
    """

    def __init__(self, max_entries: int = 65536) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, not {max_entries}")
        self.max_entries = max_entries
        self._expiry: dict[bytes, tuple[float, str]] = {}  # entry -> (expires at, source)
        self._order: deque[bytes] = deque()  # entries, oldest first (expiry in arrival order)
        self._by_source: dict[str, deque[bytes]] = {}
        self._counts: Counter[str] = Counter()
        self.replays = 0  # headers refused as seen before
        self.evicted = 0  # entries dropped before expiry (cap reached)

    def __len__(self) -> int:
        return len(self._expiry)

    @staticmethod
    def _entry(auth: RequestAuth) -> bytes:
        return hashlib.blake2b(auth.public_key + auth.nonce, digest_size=16).digest()

    def admit(self, auth: RequestAuth, source: str, now: float) -> None:
        """Remember ``auth`` (verified) from ``source``; ``AuthRefused`` if it was taken before."""
        self._expire(now)
        entry = self._entry(auth)
        if entry in self._expiry:
            self.replays += 1
            raise AuthRefused(
                f"{AUTH_HEADER} of {auth.public_key.hex()[:16]} was used before (nonce "
                f"{auth.nonce.hex()[:8]}…): each header is taken once; sign every request afresh"
            )
        while len(self._expiry) >= self.max_entries:
            self._evict_heaviest()
        self._expiry[entry] = (auth.expires_at, source)
        self._order.append(entry)
        self._by_source.setdefault(source, deque()).append(entry)
        self._counts[source] += 1

    def _expire(self, now: float) -> None:
        while self._order:
            entry = self._order[0]
            held = self._expiry.get(entry)
            if held is not None and held[0] > now:
                return
            self._order.popleft()
            if held is not None:
                self._forget(entry, held[1])

    def _forget(self, entry: bytes, source: str) -> None:
        """Drop ``entry``, the oldest of ``source`` (expiry and eviction both go oldest first)."""
        del self._expiry[entry]
        queue = self._by_source[source]
        queue.popleft()
        self._counts[source] -= 1
        if not queue:
            del self._by_source[source]
            del self._counts[source]

    def _evict_heaviest(self) -> None:
        source, _ = self._counts.most_common(1)[0]
        entry = self._by_source[source][0]
        self._forget(entry, source)  # its place in _order goes when it reaches the front
        self.evicted += 1
