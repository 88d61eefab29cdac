"""Who may join a swarm and in which role: the signed swarm manifest, lab certificates, checks.

Theory of operation. A swarm is founded by one Ed25519 key (the *founder*). The founder signs a
``SwarmManifest``: the swarm's name, the training recipe every peer must share, the *authorities*
(one public key per lab) that may certify peers, the admission mode and a revocation list. The
swarm id is a hash of the founder's key and the name, so a manifest fetched from any member can be
checked against the id alone; a manifest with a higher version, signed by the same founder, for
the same id and recipe, supersedes the one held (that is how revocations spread).

An authority certifies a peer with a ``Certificate``: its signature over the swarm id, the peer's
public key, the roles it may take (``learner``, ``owner``), a validity period, the lab's name and
the pin of the peer's TLS key. Every receiver checks a certificate against its own manifest
(``check_certificate``): issuer among the authorities, same swarm, inside its validity period,
subject not revoked, role granted, signature. Cheap checks run first; the signature last.

Admission (``admit``): in a ``certified`` swarm every peer needs a certificate; in an ``open``
swarm anyone may learn, and only certified peers may own fragments.

Requests over HTTP carry the sender's key and certificate in two headers (``RequestAuth``): the
key signs the swarm id, method, path and a timestamp, so a server can refuse a stranger before it
reads a body or serves a byte, and a captured header is worthless after ``MAX_SKEW_S`` or for
another swarm, route or method. TLS keeps headers from eavesdroppers; the peer's TLS certificate
uses its Atoll key, and the pin is the SHA-256 of its SubjectPublicKeyInfo (``tls_pin``), which an
authority computes from the public key alone.

Everything here is pure: text and bytes in, values or ``RemoteProtocolError`` out, ``now`` passed
in. Reading and writing the files is ``node/``'s job.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.errors import BadSignature, DecodeError, LocalProtocolError, NotAuthorized, Oversize
from protocol.ids import peer_id_from_public_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ADMISSIONS",
    "AUTH_HEADER",
    "CERT_HEADER",
    "MAX_SKEW_S",
    "ROLES",
    "Authority",
    "Certificate",
    "ManifestSigner",
    "RequestAuth",
    "SwarmManifest",
    "admit",
    "check_certificate",
    "swarm_id",
    "tls_pin",
]

Role = Literal["learner", "owner"]
ROLES: tuple[Role, ...] = ("learner", "owner")
ADMISSIONS = ("open", "certified")
MANIFEST_DOMAIN = "atoll/swarm-manifest/v1"
CERT_DOMAIN = "atoll/certificate/v1"
AUTH_DOMAIN = "atoll/request-auth/v1"
AUTH_HEADER = "Atoll-Auth"
CERT_HEADER = "Atoll-Certificate"
MAX_SKEW_S = 60.0  # a request's signed timestamp may be this far from the server's clock
KEY_BYTES, SIG_BYTES = 32, 64
# Caps on what a manifest or certificate may hold: refused before anything is verified.
MAX_MANIFEST_BYTES = 1 << 20
MAX_CERT_BYTES = 1024
MAX_NAME = 64
MAX_LAB = 64
MAX_AUTHORITIES = 256
MAX_REVOKED = 65536
MAX_RECIPE_FIELDS = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_RECIPE_KEY = re.compile(r"[a-z][a-z0-9_]{0,39}")
_HEX_KEY = re.compile(f"[0-9a-fA-F]{{{2 * KEY_BYTES}}}")
_CERT_ARMOR = ("-----BEGIN ATOLL CERTIFICATE-----", "-----END ATOLL CERTIFICATE-----")
# SubjectPublicKeyInfo DER of an Ed25519 key is this prefix and the 32 raw key bytes (RFC 8410).
_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


class ManifestSigner(Protocol):
    """What signing needs (``protocol.wire.signing.Signer`` fits)."""

    @property
    def public_key(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


def swarm_id(founder: bytes, name: str) -> str:
    """The swarm's id: 32 hex digits of SHA-256 over the founder's key and the swarm's name."""
    return hashlib.sha256(b"atoll/swarm/" + bytes(founder) + name.encode()).hexdigest()[:32]


def tls_pin(public_key: bytes) -> bytes:
    """SHA-256 of the SubjectPublicKeyInfo of a peer's TLS key (its Ed25519 Atoll key)."""
    if len(public_key) != KEY_BYTES:
        raise LocalProtocolError(f"public key must be {KEY_BYTES} raw bytes, got {len(public_key)}")
    return hashlib.sha256(_ED25519_SPKI_PREFIX + bytes(public_key)).digest()


def _verify(public_key: bytes, signature: bytes, data: bytes, what: str) -> None:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        raise BadSignature(f"{what}: signature does not verify") from None


def _hex_key(value: Any, what: str) -> bytes:
    # hex digits only: bytes.fromhex skips whitespace, so "00\t00…" would be a shorter key
    if not isinstance(value, str) or not _HEX_KEY.fullmatch(value):
        raise DecodeError(f"{what} must be {2 * KEY_BYTES} hex digits (an Ed25519 public key)")
    return bytes.fromhex(value)


def parse_public_key(text: str) -> bytes:
    """A public key as ``atoll keygen`` prints it (64 hex digits). Raises ``DecodeError``."""
    return _hex_key(text.strip().lower(), "public key")


def _check_name(name: Any, what: str, limit: int) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > limit:
        raise DecodeError(f"{what} must be 1-{limit} letters, digits, '.', '_' or '-', "
                          f"starting with a letter or digit; got {str(name)[:80]!r}")
    return name


# --- the manifest ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Authority:
    """A lab that may certify peers: its name and its Ed25519 public key."""

    lab: str
    public_key: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmManifest:
    """The founder-signed description of a swarm (see the module docstring)."""

    name: str
    founder: bytes
    version: int = 1
    admission: str = "open"
    created: float = 0.0  # unix seconds: no owner can have merged anything before this
    recipe: tuple[tuple[str, str | int | float | bool], ...] = ()
    authorities: tuple[Authority, ...] = ()
    revoked: frozenset[bytes] = field(default_factory=frozenset)
    signature: bytes = b""

    def __post_init__(self) -> None:
        _check_name(self.name, "swarm name", MAX_NAME)
        if len(self.founder) != KEY_BYTES:
            raise DecodeError(f"founder key must be {KEY_BYTES} bytes")
        if not 1 <= self.version < 2**63:
            raise DecodeError(f"manifest version must be in [1, 2^63), got {self.version}")
        if self.admission not in ADMISSIONS:
            raise DecodeError(f"admission must be open or certified, got {self.admission!r}")
        if not (math.isfinite(self.created) and self.created >= 0):
            raise DecodeError(f"created must be a finite unix time, got {self.created}")
        if len(self.recipe) > MAX_RECIPE_FIELDS:
            raise DecodeError(f"a recipe holds at most {MAX_RECIPE_FIELDS} fields, got {len(self.recipe)}")
        for key, value in self.recipe:
            if not _RECIPE_KEY.fullmatch(key):
                raise DecodeError(f"recipe key {key[:48]!r} is not a lower-case identifier")
            if isinstance(value, float) and not math.isfinite(value):
                raise DecodeError(f"recipe value {key} must be finite")
            if isinstance(value, int) and not -(2**63) <= value < 2**63:  # TOML's range, msgpack's
                raise DecodeError(f"recipe value {key} must be a 64-bit integer")
            if not isinstance(value, (str, int, float, bool)) or (isinstance(value, str) and len(value) > 256):
                raise DecodeError(f"recipe value {key} must be a string (<= 256 chars), number or bool")
        if list(self.recipe) != sorted(self.recipe, key=lambda kv: kv[0]) or len(dict(self.recipe)) != len(self.recipe):
            raise DecodeError("recipe keys must be unique and sorted")
        if len(self.authorities) > MAX_AUTHORITIES:
            raise DecodeError(f"at most {MAX_AUTHORITIES} authorities, got {len(self.authorities)}")
        labs, keys = set(), set()
        for a in self.authorities:
            _check_name(a.lab, "lab name", MAX_LAB)
            if len(a.public_key) != KEY_BYTES:
                raise DecodeError(f"authority {a.lab}: key must be {KEY_BYTES} bytes")
            if a.lab in labs or a.public_key in keys:
                raise DecodeError(f"authority {a.lab}: each lab and each key may appear once")
            labs.add(a.lab)
            keys.add(a.public_key)
        if len(self.revoked) > MAX_REVOKED or any(len(k) != KEY_BYTES for k in self.revoked):
            raise DecodeError(f"revoked: at most {MAX_REVOKED} keys of {KEY_BYTES} bytes each")

    # -- identity and signature -----------------------------------------------------------------
    @property
    def swarm_id(self) -> str:
        return swarm_id(self.founder, self.name)

    def signing_bytes(self) -> bytes:
        return bytes(msgpack.packb([
            MANIFEST_DOMAIN, self.name, self.founder, self.version, self.admission, float(self.created),
            [[k, v] for k, v in self.recipe],
            [[a.lab, a.public_key] for a in self.authorities],
            sorted(self.revoked),
        ], use_bin_type=True))

    def signed(self, founder: ManifestSigner) -> SwarmManifest:
        """This manifest signed by ``founder``; raises ``LocalProtocolError`` for another key."""
        if founder.public_key != self.founder:
            raise LocalProtocolError("this key is not the swarm's founder: only the founder's key "
                                     f"{self.founder.hex()} may sign its manifest")
        unsigned = replace(self, signature=b"")
        return replace(unsigned, signature=founder.sign(unsigned.signing_bytes()))

    def verify(self, expected_id: str | None = None) -> None:
        """Raise ``BadSignature`` unless the founder signed exactly this manifest, and
        ``NotAuthorized`` when it is not the swarm ``expected_id``."""
        if expected_id is not None and self.swarm_id != expected_id:
            raise NotAuthorized(f"manifest is for swarm {self.swarm_id} ({self.name!r}), not {expected_id}")
        if len(self.signature) != SIG_BYTES:
            raise BadSignature("manifest is not signed by its founder (sign it with atoll swarm init / "
                               "add-authority / revoke)")
        _verify(self.founder, self.signature, self.signing_bytes(), f"manifest of swarm {self.name!r}")

    def superseded_by(self, newer: SwarmManifest) -> bool:
        """Whether ``newer`` (already verified) replaces this manifest. Raises ``NotAuthorized``
        for a manifest of another swarm or one that changes the recipe; an older or equal version
        is not an error (returns False): manifests spread by gossip and arrive out of order."""
        if newer.swarm_id != self.swarm_id:
            raise NotAuthorized(f"manifest is for swarm {newer.swarm_id}, this is {self.swarm_id}")
        if newer.version <= self.version:
            return False
        if newer.recipe != self.recipe:
            changed = sorted(k for k in set(dict(newer.recipe)) | set(dict(self.recipe))
                             if dict(newer.recipe).get(k) != dict(self.recipe).get(k))
            raise NotAuthorized(f"manifest version {newer.version} changes the recipe ({', '.join(changed)}); "
                                "a running swarm keeps its recipe: found a new swarm instead")
        if newer.created != self.created:
            raise NotAuthorized("a newer manifest must keep the swarm's creation time")
        return True

    # -- queries --------------------------------------------------------------------------------
    def authority(self, public_key: bytes) -> Authority | None:
        for a in self.authorities:
            if a.public_key == public_key:
                return a
        return None

    @property
    def recipe_dict(self) -> dict[str, str | int | float | bool]:
        return dict(self.recipe)

    # -- edits (each returns an unsigned manifest one version up) ---------------------------------
    def with_authority(self, lab: str, public_key: bytes) -> SwarmManifest:
        others = tuple(a for a in self.authorities if a.lab != lab and a.public_key != public_key)
        return replace(self, version=self.version + 1, signature=b"",
                       authorities=(*others, Authority(lab, bytes(public_key))))

    def with_revoked(self, public_key: bytes) -> SwarmManifest:
        return replace(self, version=self.version + 1, signature=b"",
                       revoked=self.revoked | {bytes(public_key)})

    # -- TOML -------------------------------------------------------------------------------------
    def to_toml_data(self) -> dict[str, Any]:
        """The manifest as TOML-ready data (``tomli_w.dumps`` writes it)."""
        data: dict[str, Any] = {
            "swarm": {"name": self.name, "id": self.swarm_id, "founder": self.founder.hex(),
                      "version": self.version, "admission": self.admission, "created": float(self.created)},
            "recipe": dict(self.recipe),
            "authorities": [{"lab": a.lab, "public_key": a.public_key.hex()} for a in self.authorities],
            "revoked": {"public_keys": sorted(k.hex() for k in self.revoked)},
        }
        if self.signature:
            data["signature"] = {"founder": self.signature.hex()}
        return data

    @classmethod
    def from_toml(cls, text: str | bytes) -> SwarmManifest:
        """Parse a manifest file's text; raises ``Oversize`` or ``DecodeError`` with what is wrong.
        The signature is not checked here: call ``verify``."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise Oversize(f"manifest of {len(text)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            raw = text.decode() if isinstance(text, bytes) else text
            data = tomllib.loads(raw)
        # ValueError: UnicodeDecodeError, TOMLDecodeError, and int() of an integer of 4300+ digits;
        # RecursionError: arrays or inline tables nested ~1000 deep
        except (ValueError, RecursionError) as exc:
            raise DecodeError(f"manifest is not valid TOML: {exc}") from None
        try:
            return cls._from_data(data)
        except (KeyError, TypeError, AttributeError, OverflowError) as exc:  # float(10**400)
            raise DecodeError(f"manifest is missing a field or has a wrong type: {exc!r}") from None

    @classmethod
    def _from_data(cls, data: Mapping[str, Any]) -> SwarmManifest:
        swarm = data["swarm"]
        version, created = swarm.get("version", 1), swarm.get("created", 0.0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise DecodeError("swarm.version must be an integer")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise DecodeError("swarm.created must be a number (unix seconds)")
        recipe = data.get("recipe", {})
        if not isinstance(recipe, dict):
            raise DecodeError("[recipe] must be a table")
        authorities = data.get("authorities", [])
        if not isinstance(authorities, list) or len(authorities) > MAX_AUTHORITIES:
            raise DecodeError(f"[[authorities]] must be a list of at most {MAX_AUTHORITIES} tables")
        revoked = data.get("revoked", {}).get("public_keys", [])
        if not isinstance(revoked, list) or len(revoked) > MAX_REVOKED:
            raise DecodeError(f"revoked.public_keys must be a list of at most {MAX_REVOKED} keys")
        signature = data.get("signature", {}).get("founder", "")
        try:
            sig = bytes.fromhex(signature) if isinstance(signature, str) else None
        except ValueError:
            sig = None
        if sig is None:
            raise DecodeError("signature.founder must be hex")
        manifest = cls(
            name=swarm["name"], founder=_hex_key(swarm["founder"], "swarm.founder"), version=version,
            admission=swarm.get("admission", "open"), created=float(created),
            recipe=tuple(sorted(recipe.items())),
            authorities=tuple(Authority(a["lab"], _hex_key(a["public_key"], f"authority {a.get('lab')!r} key"))
                              for a in authorities),
            revoked=frozenset(_hex_key(k, "revoked key") for k in revoked),
            signature=sig,
        )
        declared = swarm.get("id")
        if declared is not None and declared != manifest.swarm_id:
            raise DecodeError(f"swarm.id {str(declared)[:40]!r} does not match the founder and name "
                              f"(expected {manifest.swarm_id})")
        return manifest


# --- certificates ------------------------------------------------------------------------------
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
        if len(self.subject) != KEY_BYTES or len(self.issuer) != KEY_BYTES or len(self.tls_pin) != 32:
            raise DecodeError("certificate keys must be 32 bytes and its TLS pin a SHA-256")
        if not self.roles or len(set(self.roles)) != len(self.roles) or any(r not in ROLES for r in self.roles):
            raise DecodeError(f"certificate roles must be a non-empty subset of {ROLES}, got {self.roles}")
        _check_name(self.lab, "lab name", MAX_LAB)
        if not (math.isfinite(self.not_before) and math.isfinite(self.not_after)
                and self.not_before < self.not_after):
            raise DecodeError("certificate validity must be finite with not_before < not_after")

    @property
    def peer_id(self) -> bytes:
        return peer_id_from_public_key(self.subject)

    def signing_bytes(self) -> bytes:
        return bytes(msgpack.packb([CERT_DOMAIN, self.swarm, self.subject, list(self.roles), self.lab,
                                    float(self.not_before), float(self.not_after), self.tls_pin, self.issuer],
                                   use_bin_type=True))

    @classmethod
    def issue(cls, authority: ManifestSigner, *, manifest: SwarmManifest, subject: bytes,
              roles: Iterable[str], not_before: float, not_after: float) -> Certificate:
        """A certificate signed by ``authority``; raises ``LocalProtocolError`` when that key is
        not one of the manifest's authorities (its lab name comes from the manifest)."""
        lab = manifest.authority(authority.public_key)
        if lab is None:
            raise LocalProtocolError(f"key {authority.public_key.hex()} is not an authority of swarm "
                                     f"{manifest.name!r}; the founder adds it with atoll swarm add-authority")
        roles_t = tuple(r for r in ROLES if r in set(roles))
        unknown = set(roles) - set(ROLES)
        if unknown or not roles_t:
            raise LocalProtocolError(f"roles must be a non-empty subset of learner,owner; got {sorted(set(roles))}")
        cert = cls(swarm=manifest.swarm_id, subject=bytes(subject), roles=roles_t, lab=lab.lab,
                   not_before=float(not_before), not_after=float(not_after), tls_pin=tls_pin(subject),
                   issuer=authority.public_key)
        return replace(cert, signature=authority.sign(cert.signing_bytes()))

    def encode(self) -> bytes:
        return bytes(msgpack.packb([self.swarm, self.subject, list(self.roles), self.lab, float(self.not_before),
                                    float(self.not_after), self.tls_pin, self.issuer, self.signature],
                                   use_bin_type=True))

    @classmethod
    def decode(cls, data: bytes) -> Certificate:
        """Raises ``Oversize`` or ``DecodeError``; the signature is checked by ``check_certificate``."""
        if len(data) > MAX_CERT_BYTES:
            raise Oversize(f"certificate of {len(data)} bytes exceeds {MAX_CERT_BYTES}")
        try:
            fields = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_str_len=128,
                                     max_bin_len=64, max_array_len=9, max_map_len=0)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise DecodeError(f"certificate does not decode: {exc}") from None
        if not isinstance(fields, list) or len(fields) != 9:
            raise DecodeError("certificate must be a 9-element array")
        swarm, subject, roles, lab, nb, na, pin, issuer, sig = fields
        if not (isinstance(subject, bytes) and isinstance(pin, bytes) and isinstance(issuer, bytes)
                and isinstance(sig, bytes) and len(sig) == SIG_BYTES and isinstance(roles, list)
                and all(isinstance(r, str) for r in roles) and isinstance(nb, float) and isinstance(na, float)
                and isinstance(lab, str) and isinstance(swarm, str)):
            raise DecodeError("certificate has a field of the wrong type")
        return cls(swarm=swarm, subject=subject, roles=tuple(roles), lab=lab, not_before=nb,
                   not_after=na, tls_pin=pin, issuer=issuer, signature=sig)

    def to_text(self) -> str:
        """The certificate file's text: base64 between armor lines, and a readable summary."""
        body = base64.b64encode(self.encode()).decode()
        lines = [body[i:i + 64] for i in range(0, len(body), 64)]
        summary = (f"# atoll certificate: peer {self.subject.hex()} lab {self.lab} roles {','.join(self.roles)} "
                   f"swarm {self.swarm}")
        return "\n".join([summary, _CERT_ARMOR[0], *lines, _CERT_ARMOR[1], ""])

    @classmethod
    def from_text(cls, text: str) -> Certificate:
        if len(text) > 4 * MAX_CERT_BYTES:
            raise Oversize(f"certificate file of {len(text)} characters is too long")
        begin, end = text.find(_CERT_ARMOR[0]), text.find(_CERT_ARMOR[1])
        if begin < 0 or end < begin:
            raise DecodeError("not an Atoll certificate (no BEGIN/END ATOLL CERTIFICATE lines)")
        body = "".join(text[begin + len(_CERT_ARMOR[0]):end].split())
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


def check_certificate(manifest: SwarmManifest, cert: Certificate, *, public_key: bytes,
                      role: Role | None, now: float, signature_verified: bool = False) -> None:
    """Raise ``NotAuthorized`` (or ``BadSignature``) with the reason ``cert`` does not let the
    holder of ``public_key`` take ``role`` (None: any role) at ``now`` in ``manifest``'s swarm.

    ``signature_verified``: the caller verified this exact certificate's signature before (and
    remembers it by its bytes); the checks that change with time and manifest still run."""
    if cert.subject != public_key:
        raise NotAuthorized(f"certificate is for key {cert.subject.hex()[:16]}, not the sender's "
                            f"{public_key.hex()[:16]}")
    if cert.swarm != manifest.swarm_id:
        raise NotAuthorized(f"certificate is for swarm {cert.swarm}, this is {manifest.swarm_id} ({manifest.name})")
    authority = manifest.authority(cert.issuer)
    if authority is None:
        raise NotAuthorized(f"issuer {cert.issuer.hex()[:16]} not an authority of this swarm")
    if authority.lab != cert.lab:
        raise NotAuthorized(f"certificate names lab {cert.lab!r}, its issuer is lab {authority.lab!r}")
    if cert.subject in manifest.revoked:
        raise NotAuthorized(f"key {cert.subject.hex()[:16]} revoked (manifest version {manifest.version})")
    if now >= cert.not_after:
        raise NotAuthorized(f"certificate expired {now - cert.not_after:.0f} s ago; ask lab {cert.lab} "
                            "for a new one (atoll swarm certify)")
    if now < cert.not_before:
        raise NotAuthorized(f"certificate not valid for another {cert.not_before - now:.0f} s")
    if role is not None and role not in cert.roles:
        raise NotAuthorized(f"certificate grants {','.join(cert.roles)}, not {role}")
    if not signature_verified:
            _verify(cert.issuer, cert.signature, cert.signing_bytes(), f"certificate from lab {cert.lab}")


def admit(manifest: SwarmManifest, cert: Certificate | None, *, public_key: bytes, role: Role | None,
          now: float, signature_verified: bool = False) -> None:
    """Raise ``NotAuthorized`` unless the holder of ``public_key`` may take ``role`` (None: be
    served at all). Open swarms let anyone learn; owning always needs a certificate."""
    if cert is None:
        if manifest.admission == "certified":
            raise NotAuthorized("no certificate: this swarm admits certified peers only "
                                "(ask a lab's authority for one: atoll swarm certify)")
        if role == "owner":
            raise NotAuthorized("owning a fragment needs a certificate with the owner role")
        return
    check_certificate(manifest, cert, public_key=public_key, role=role, now=now,
                      signature_verified=signature_verified)


# --- request authentication -----------------------------------------------------------------------
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
        key = _hex_key(parts[1], f"{AUTH_HEADER} key")
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
        _verify(self.public_key, self.signature, self.signing_bytes(swarm, method, target, self.timestamp),
                f"{AUTH_HEADER} of {self.public_key.hex()[:16]}")
