"""TLS for certified swarms: each peer's self-signed certificate, and clients that pin it.

A peer's TLS key is its Atoll (Ed25519) key, so the pin an authority writes into the peer's
Atoll certificate (``protocol.wire.membership.tls_pin``: SHA-256 of the SubjectPublicKeyInfo)
follows from the public key alone and survives a regenerated TLS certificate. The certificate
itself is made at start with ``cryptography`` (self-signed; its validity dates are fixed, since
trust comes from the pin, not from a CA or a date).

Clients pin per origin, each origin to the key of the one member that holds that address
(``node.dht.membership``: a record naming an address another member holds never re-pins it, and
a pin goes when its member leaves). A connection whose TLS key does not hash to the pin fails
before a request byte is sent (``PinnedKey`` raises ``PinMismatch``); the transport tells the
node, which routes around the member it dialled there. Pins are set from the first read of the
members, before state sync. An address with no pin (an initial peer given on the command line)
is reached over TLS without a pin: every Atoll message is signed end to end, so such a peer can
deny service but not impersonate a member.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import ssl
import tempfile
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from protocol.wire.signing import Signer

__all__ = ["PinnedKey", "PinMismatch", "client_context", "origin", "server_context", "spki_pin"]


class PinMismatch(aiohttp.ServerFingerprintMismatch):
    """The server's TLS key is not the one its Atoll certificate pins."""

    def __str__(self) -> str:
        return (
            f"TLS key of {self.host}:{self.port} does not match the pin in its Atoll certificate "
            f"(expected {self.expected.hex()[:16]}, got {self.got.hex()[:16] or 'none'})"
        )


@functools.lru_cache(maxsize=4096)  # asked per request sent and per member a read brings
def origin(url: str) -> str:
    """``scheme://host:port`` of ``url`` (the key of the pin table)."""
    parts = urlsplit(url)
    port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{port}"  # an IPv6 address in brackets


def spki_pin(cert_der: bytes) -> bytes:
    """SHA-256 of a DER certificate's SubjectPublicKeyInfo."""
    cert = x509.load_der_x509_certificate(cert_der)
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


def server_context(signer: Signer) -> ssl.SSLContext:
    """A TLS 1.3 server context whose certificate is self-signed with the peer's Atoll key."""
    key = signer.private_key()
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"atoll-{signer.peer_id.hex()[:16]}")]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(signer.peer_id[:16], "big") >> 1)
        .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC))
        .sign(key, None)
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # load_cert_chain reads files only: write both to a private directory and remove it at once
    with tempfile.TemporaryDirectory(prefix="atoll-tls-") as tmp:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def client_context() -> ssl.SSLContext:
    """TLS 1.3 without CA checks: peers are authenticated by pins and signatures, not CAs."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class PinnedKey(aiohttp.Fingerprint):
    """aiohttp checks a ``Fingerprint`` right after the handshake, before sending the request;
    this one compares the SubjectPublicKeyInfo hash instead of the whole certificate's.
    ``on_mismatch(expected, got)`` is told of a mismatch before ``PinMismatch`` is raised, on
    every path that connects (requests and downloads alike), so the node can route around the
    member it dialled: the key that answered is not that member's."""

    def __init__(
        self, fingerprint: bytes, on_mismatch: Callable[[bytes, bytes], None] | None = None
    ) -> None:
        super().__init__(fingerprint)
        self.on_mismatch = on_mismatch

    def check(self, transport: object) -> None:
        get = getattr(transport, "get_extra_info", None)
        sslobj = get("ssl_object") if get else None
        der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
        got = spki_pin(der) if der else b""
        if got != self.fingerprint:
            host, port, *_ = (get("peername") if get else None) or ("?", 0)
            if self.on_mismatch is not None:
                self.on_mismatch(self.fingerprint, got)
            raise PinMismatch(self.fingerprint, got, host, port)
