"""Request authentication: the ``Atoll-Auth`` header, a key's signature over one request.

Requests over HTTP carry the sender's key and certificate in two headers: the key signs the swarm
id, method, path and a timestamp, so a server can refuse a stranger before it reads a body or
serves a byte, and a captured header is worthless after ``MAX_SKEW_S`` or for another swarm,
route or method. TLS keeps headers from eavesdroppers.

Pure: text in, values or ``RemoteProtocolError`` out, ``now`` passed in.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass

import msgpack

from protocol.errors import DecodeError, NotAuthorized, Oversize
from protocol.wire.membership import (
    SIG_BYTES,
    ManifestSigner,
    hex_key,
    verify_signature,
)

__all__ = ["AUTH_HEADER", "MAX_SKEW_S", "RequestAuth"]

AUTH_DOMAIN = "atoll/request-auth/v1"
AUTH_HEADER = "Atoll-Auth"
MAX_SKEW_S = 60.0  # a request's signed timestamp may be this far from the server's clock


@dataclass(frozen=True, slots=True)
class RequestAuth:
    """The ``Atoll-Auth`` header: ``v1 <public key hex> <unix time> <signature base64>``."""

    public_key: bytes
    timestamp: float
    signature: bytes

    @staticmethod
    def signing_bytes(swarm: str, method: str, target: str, timestamp: float) -> bytes:
        return bytes(msgpack.packb([AUTH_DOMAIN, swarm, method.upper(), target, float(timestamp)],
                                   use_bin_type=True))

    @classmethod
    def make(cls, signer: ManifestSigner, *, swarm: str, method: str, target: str, now: float) -> str:
        """The header value for a request of ``method`` to ``target`` (path and query)."""
        ts = round(now, 3)
        sig = signer.sign(cls.signing_bytes(swarm, method, target, ts))
        return f"v1 {signer.public_key.hex()} {ts!r} {base64.b64encode(sig).decode()}"

    @classmethod
    def parse(cls, value: str) -> RequestAuth:
        if len(value) > 256:
            raise Oversize(f"{AUTH_HEADER} header of {len(value)} characters is too long")
        parts = value.split(" ")
        if len(parts) != 4 or parts[0] != "v1":
            raise DecodeError(f"{AUTH_HEADER} must be 'v1 <key hex> <unix time> <signature base64>'")
        key = hex_key(parts[1], f"{AUTH_HEADER} key")
        try:
            ts = float(parts[2]) if len(parts[2]) <= 24 else math.nan
            sig = base64.b64decode(parts[3], validate=True)
        except (ValueError, binascii.Error):
            raise DecodeError(f"{AUTH_HEADER}: bad time or signature encoding") from None
        if not math.isfinite(ts) or len(sig) != SIG_BYTES:
            raise DecodeError(f"{AUTH_HEADER}: time must be finite and the signature {SIG_BYTES} bytes")
        return cls(key, ts, sig)

    def verify(self, *, swarm: str, method: str, target: str, now: float) -> None:
        """Raise ``NotAuthorized`` for a stale or future timestamp, ``BadSignature`` for a bad one."""
        if abs(now - self.timestamp) > MAX_SKEW_S:
            raise NotAuthorized(f"{AUTH_HEADER} is dated {self.timestamp - now:+.0f} s from this node's clock "
                                f"(at most {MAX_SKEW_S:.0f} s apart): check the sender's clock")
        verify_signature(self.public_key, self.signature, self.signing_bytes(swarm, method, target, self.timestamp),
                f"{AUTH_HEADER} of {self.public_key.hex()[:16]}")
