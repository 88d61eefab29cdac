"""Lab certificates: which key may take which roles in a swarm, and the checks a receiver makes.

An authority (one lab's key, listed in the swarm manifest) certifies a peer with a
``Certificate``: its signature over the swarm id, the peer's public key, the roles it may take
(``learner``, ``owner``), a validity period, the lab's name and the pin of the peer's TLS key
(``protocol.wire.membership.tls_pin``). Every receiver checks a certificate against its own
manifest (``check_certificate``): issuer among the authorities, same swarm, inside its validity
period, subject not revoked, role granted, signature. Cheap checks run first; the signature last.

Admission (``admit``): in a ``certified`` swarm every peer needs a certificate; in an ``open``
swarm anyone may learn, and only certified peers may own fragments.

Pure: text and bytes in, values or ``RemoteProtocolError`` out, ``now`` passed in.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import msgpack

from protocol.errors import DecodeError, LocalProtocolError, NotAuthorized, Oversize
from protocol.ids import peer_id_from_public_key
from protocol.wire.membership import (
    KEY_BYTES,
    MAX_LAB,
    SIG_BYTES,
    ManifestSigner,
    SwarmManifest,
    check_name,
    tls_pin,
    verify_signature,
)

__all__ = [
    "CERT_HEADER",
    "MAX_CERT_BYTES",
    "ROLES",
    "Certificate",
    "Role",
    "admit",
    "check_certificate",
]

Role = Literal["learner", "owner"]
ROLES: tuple[Role, ...] = ("learner", "owner")
CERT_DOMAIN = "atoll/certificate/v1"
CERT_HEADER = "Atoll-Certificate"
MAX_CERT_BYTES = 1024  # refused before anything is verified
_CERT_ARMOR = ("-----BEGIN ATOLL CERTIFICATE-----", "-----END ATOLL CERTIFICATE-----")


@dataclass(frozen=True, slots=True, kw_only=True)
class Certificate:
    """An authority's statement that ``subject`` may take ``roles`` in swarm ``swarm``."""

    swarm: str
    subject: bytes
    roles: tuple[Role, ...]
    lab: str
    not_before: float
    not_after: float
    tls_pin: bytes
    issuer: bytes
    signature: bytes = b""

    def __post_init__(self) -> None:
        if not (isinstance(self.swarm, str) and re.fullmatch(r"[0-9a-f]{32}", self.swarm)):
            raise DecodeError("certificate swarm must be a swarm id (32 hex digits)")
        if (
            len(self.subject) != KEY_BYTES
            or len(self.issuer) != KEY_BYTES
            or len(self.tls_pin) != 32
        ):
            raise DecodeError("certificate keys must be 32 bytes and its TLS pin a SHA-256")
        if (
            not self.roles
            or len(set(self.roles)) != len(self.roles)
            or any(r not in ROLES for r in self.roles)
        ):
            raise DecodeError(
                f"certificate roles must be a non-empty subset of {ROLES}, got {self.roles}"
            )
        check_name(self.lab, "lab name", MAX_LAB)
        if not (
            math.isfinite(self.not_before)
            and math.isfinite(self.not_after)
            and self.not_before < self.not_after
        ):
            raise DecodeError("certificate validity must be finite with not_before < not_after")

    @property
    def peer_id(self) -> bytes:
        return peer_id_from_public_key(self.subject)

    def signing_bytes(self) -> bytes:
        return bytes(
            msgpack.packb(
                [
                    CERT_DOMAIN,
                    self.swarm,
                    self.subject,
                    list(self.roles),
                    self.lab,
                    float(self.not_before),
                    float(self.not_after),
                    self.tls_pin,
                    self.issuer,
                ],
                use_bin_type=True,
            )
        )

    @classmethod
    def issue(
        cls,
        authority: ManifestSigner,
        *,
        manifest: SwarmManifest,
        subject: bytes,
        roles: Iterable[str],
        not_before: float,
        not_after: float,
    ) -> Certificate:
        """A certificate signed by ``authority``; raises ``LocalProtocolError`` when that key is
        not one of the manifest's authorities (its lab name comes from the manifest)."""
        lab = manifest.authority(authority.public_key)
        if lab is None:
            raise LocalProtocolError(
                f"key {authority.public_key.hex()} is not an authority of swarm "
                f"{manifest.name!r}; the founder adds it with atoll swarm add-authority"
            )
        roles_t = tuple(r for r in ROLES if r in set(roles))
        unknown = set(roles) - set(ROLES)
        if unknown or not roles_t:
            raise LocalProtocolError(
                f"roles must be a non-empty subset of learner,owner; got {sorted(set(roles))}"
            )
        cert = cls(
            swarm=manifest.swarm_id,
            subject=bytes(subject),
            roles=roles_t,
            lab=lab.lab,
            not_before=float(not_before),
            not_after=float(not_after),
            tls_pin=tls_pin(subject),
            issuer=authority.public_key,
        )
        return replace(cert, signature=authority.sign(cert.signing_bytes()))

    def encode(self) -> bytes:
        return bytes(
            msgpack.packb(
                [
                    self.swarm,
                    self.subject,
                    list(self.roles),
                    self.lab,
                    float(self.not_before),
                    float(self.not_after),
                    self.tls_pin,
                    self.issuer,
                    self.signature,
                ],
                use_bin_type=True,
            )
        )

    @classmethod
    def decode(cls, data: bytes) -> Certificate:
        """Raises ``Oversize`` or ``DecodeError``; the signature is checked by ``check_certificate``."""
        if len(data) > MAX_CERT_BYTES:
            raise Oversize(f"certificate of {len(data)} bytes exceeds {MAX_CERT_BYTES}")
        try:
            fields = msgpack.unpackb(
                bytes(data),
                raw=False,
                strict_map_key=True,
                max_str_len=128,
                max_bin_len=64,
                max_array_len=9,
                max_map_len=0,
            )
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise DecodeError(f"certificate does not decode: {exc}") from None
        if not isinstance(fields, list) or len(fields) != 9:
            raise DecodeError("certificate must be a 9-element array")
        swarm, subject, roles, lab, nb, na, pin, issuer, sig = fields
        if not (
            isinstance(subject, bytes)
            and isinstance(pin, bytes)
            and isinstance(issuer, bytes)
            and isinstance(sig, bytes)
            and len(sig) == SIG_BYTES
            and isinstance(roles, list)
            and all(isinstance(r, str) for r in roles)
            and isinstance(nb, float)
            and isinstance(na, float)
            and isinstance(lab, str)
            and isinstance(swarm, str)
        ):
            raise DecodeError("certificate has a field of the wrong type")
        return cls(
            swarm=swarm,
            subject=subject,
            roles=tuple(roles),
            lab=lab,
            not_before=nb,
            not_after=na,
            tls_pin=pin,
            issuer=issuer,
            signature=sig,
        )

    def to_text(self) -> str:
        """The certificate file's text: base64 between armor lines, and a readable summary."""
        body = base64.b64encode(self.encode()).decode()
        lines = [body[i : i + 64] for i in range(0, len(body), 64)]
        summary = (
            f"# atoll certificate: peer {self.subject.hex()} lab {self.lab} roles {','.join(self.roles)} "
            f"swarm {self.swarm}"
        )
        return "\n".join([summary, _CERT_ARMOR[0], *lines, _CERT_ARMOR[1], ""])

    @classmethod
    def from_text(cls, text: str) -> Certificate:
        if len(text) > 4 * MAX_CERT_BYTES:
            raise Oversize(f"certificate file of {len(text)} characters is too long")
        begin, end = text.find(_CERT_ARMOR[0]), text.find(_CERT_ARMOR[1])
        if begin < 0 or end < begin:
            raise DecodeError("not an Atoll certificate (no BEGIN/END ATOLL CERTIFICATE lines)")
        body = "".join(text[begin + len(_CERT_ARMOR[0]) : end].split())
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise DecodeError("certificate body is not base64") from None
        return cls.decode(raw)

    def to_header(self) -> str:
        return base64.b64encode(self.encode()).decode()

    @classmethod
    def from_header(cls, value: str) -> Certificate:
        if len(value) > 2 * MAX_CERT_BYTES:
            raise Oversize(f"{CERT_HEADER} header of {len(value)} characters is too long")
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise DecodeError(f"{CERT_HEADER} header is not base64") from None
        return cls.decode(raw)


def check_certificate(
    manifest: SwarmManifest,
    cert: Certificate,
    *,
    public_key: bytes,
    role: Role | None,
    now: float,
    signature_verified: bool = False,
) -> None:
    """Raise ``NotAuthorized`` (or ``BadSignature``) with the reason ``cert`` does not let the
    holder of ``public_key`` take ``role`` (None: any role) at ``now`` in ``manifest``'s swarm.

    ``signature_verified``: the caller verified this exact certificate's signature before (and
    remembers it by its bytes); the checks that change with time and manifest still run."""
    if cert.subject != public_key:
        raise NotAuthorized(
            f"certificate is for key {cert.subject.hex()[:16]}, not the sender's "
            f"{public_key.hex()[:16]}"
        )
    if cert.swarm != manifest.swarm_id:
        raise NotAuthorized(
            f"certificate is for swarm {cert.swarm}, this is {manifest.swarm_id} ({manifest.name})"
        )
    authority = manifest.authority(cert.issuer)
    if authority is None:
        raise NotAuthorized(f"issuer {cert.issuer.hex()[:16]} not an authority of this swarm")
    if authority.lab != cert.lab:
        raise NotAuthorized(
            f"certificate names lab {cert.lab!r}, its issuer is lab {authority.lab!r}"
        )
    if cert.subject in manifest.revoked:
        raise NotAuthorized(
            f"key {cert.subject.hex()[:16]} revoked (manifest version {manifest.version})"
        )
    if now >= cert.not_after:
        raise NotAuthorized(
            f"certificate expired {now - cert.not_after:.0f} s ago; ask lab {cert.lab} "
            "for a new one (atoll swarm certify)"
        )
    if now < cert.not_before:
        raise NotAuthorized(f"certificate not valid for another {cert.not_before - now:.0f} s")
    if role is not None and role not in cert.roles:
        raise NotAuthorized(f"certificate grants {','.join(cert.roles)}, not {role}")
    if not signature_verified:
        verify_signature(
            cert.issuer, cert.signature, cert.signing_bytes(), f"certificate from lab {cert.lab}"
        )


def admit(
    manifest: SwarmManifest,
    cert: Certificate | None,
    *,
    public_key: bytes,
    role: Role | None,
    now: float,
    signature_verified: bool = False,
) -> None:
    """Raise ``NotAuthorized`` unless the holder of ``public_key`` may take ``role`` (None: be
    served at all). Open swarms let anyone learn; owning always needs a certificate."""
    if cert is None:
        if manifest.admission == "certified":
            raise NotAuthorized(
                "no certificate: this swarm admits certified peers only "
                "(ask a lab's authority for one: atoll swarm certify)"
            )
        if role == "owner":
            raise NotAuthorized("owning a fragment needs a certificate with the owner role")
        return
    check_certificate(
        manifest,
        cert,
        public_key=public_key,
        role=role,
        now=now,
        signature_verified=signature_verified,
    )
