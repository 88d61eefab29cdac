"""The signed swarm manifest: the recipe, the labs that may certify peers, admission, revocations.

Theory of operation. A swarm is founded by one Ed25519 key (the *founder*). The founder signs a
``SwarmManifest``: the swarm's name, the training recipe every peer must share, the *authorities*
(one public key per lab) that may certify peers, the admission mode and a revocation list. The
swarm id is a hash of the founder's key and the name, so a manifest fetched from any member can be
checked against the id alone; a manifest with a higher version, signed by the same founder, for
the same id and recipe, supersedes the one held (that is how revocations spread).

Formats. A manifest of format 1 (every swarm founded before 2026-12-06) is signed and written
exactly as then. Format 2 adds the SHA-256 of the swarm's validation set (``validation_sha256``,
the bytes validated publication evaluates on), so every owner checks the same data. Both new
values travel *inside the recipe table* (``manifest_format``, ``validation_sha256``): the recipe
is already signed, so an Atoll that reads only format 1 verifies the signature and then refuses
the manifest with its "the swarm's recipe has fields this Atoll does not know ...; upgrade Atoll"
(``node.dht.membership.config_from_manifest``); a reader of this module refuses a format above
``MANIFEST_FORMAT`` with "upgrade atoll". A format-1 manifest keeps its bytes and its id.
Format 3 adds ``recipe_sha256``, the SHA-256 of the swarm's recipe document
(``protocol.wire.recipe``: the model, tokenizer and data, each named by its own hash), carried
the same way; a peer fetches the recipe and its artifacts from members by those hashes.

An authority (a lab) certifies a peer with a ``Certificate`` (``protocol.wire.certificates``),
which every receiver checks against its own manifest; requests over HTTP carry the sender's
signature in a header (``protocol.wire.request_auth``). A peer's TLS certificate uses its Atoll
key, and the pin is the SHA-256 of its SubjectPublicKeyInfo (``tls_pin``), which an authority
computes from the public key alone.

Everything here is pure: text and bytes in, values or ``RemoteProtocolError`` out, ``now`` passed
in. Reading and writing the files is ``node/``'s job.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import msgpack

from protocol.errors import BadSignature, DecodeError, LocalProtocolError, NotAuthorized
from protocol.wire.toml_text import load_bounded_toml
from protocol.wire.verified import verify_ed25519

__all__ = [
    "ADMISSIONS",
    "KEY_BYTES",
    "SIG_BYTES",
    "MANIFEST_FORMAT",
    "MAX_MANIFEST_STEP",
    "Authority",
    "ManifestSigner",
    "SwarmManifest",
    "bare_origin",
    "check_format",
    "check_name",
    "hex_key",
    "parse_public_key",
    "swarm_id",
    "tls_pin",
    "verify_signature",
]

ADMISSIONS = ("open", "certified")
MANIFEST_DOMAIN = "atoll/swarm-manifest/v1"
KEY_BYTES, SIG_BYTES = 32, 64
# Caps on what a manifest may hold: refused before anything is verified.
MAX_MANIFEST_BYTES = 1 << 20
MAX_NAME = 64
MAX_LAB = 64
MAX_AUTHORITIES = 256
MAX_REVOKED = 65536
MAX_RECIPE_FIELDS = 64
# The newest manifest format this Atoll reads (see the module docstring), and the recipe-table
# keys that carry the format and the validation set's pin from format 2 on.
MANIFEST_FORMAT = 3
FORMAT_KEY, PIN_KEY, RECIPE_PIN_KEY = "manifest_format", "validation_sha256", "recipe_sha256"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_RECIPE_KEY = re.compile(r"[a-z][a-z0-9_]{0,39}")
_HEX_KEY = re.compile(f"[0-9a-fA-F]{{{2 * KEY_BYTES}}}")
# A member's address: scheme, host (a DNS name, an IPv4 address or a bracketed IPv6 one) and port,
# nothing else. A path, query, fragment or userinfo would make every peer that dials the member
# send its signed requests wherever the record says (a blind GET to any host and path).
_ORIGIN = re.compile(
    r"(https?)://([A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})"
)
# How far above our own manifest version a member's claim may be and still be fetched: a founder
# edits the manifest by hand (an authority added, a key revoked), a few versions a day at most,
# and a running member follows each one within a membership pass. A claim further up is a lie or
# a member far behind us can never prove (the founder reaches such a peer with
# ``atoll swarm publish``, and a restart fetches the newest from an initial peer).
MAX_MANIFEST_STEP = 16
# SubjectPublicKeyInfo DER of an Ed25519 key is this prefix and the 32 raw key bytes (RFC 8410).
_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


class ManifestSigner(Protocol):
    """What signing needs (``protocol.wire.signing.Signer`` fits)."""

    @property
    def public_key(self) -> bytes: ...

    def sign(self, data: bytes) -> bytes: ...


def bare_origin(url: str) -> str:
    """``url`` when it is a bare origin, ``http(s)://HOST:PORT`` with a port in 1-65535 and
    nothing after it; raises ``DecodeError`` saying what is wrong otherwise."""
    match = _ORIGIN.fullmatch(url) if isinstance(url, str) else None
    if match is None:
        raise DecodeError(
            f"address {str(url)[:80]!r} is not a bare origin: expected http(s)://HOST:PORT "
            "with no path, query, fragment or user name"
        )
    if not 1 <= int(match.group(3)) <= 65535:
        raise DecodeError(f"address {url[:80]!r}: port {match.group(3)} is not in 1-65535")
    return url


def swarm_id(founder: bytes, name: str) -> str:
    """The swarm's id: 32 hex digits of SHA-256 over the founder's key and the swarm's name."""
    return hashlib.sha256(b"atoll/swarm/" + bytes(founder) + name.encode()).hexdigest()[:32]


def tls_pin(public_key: bytes) -> bytes:
    """SHA-256 of the SubjectPublicKeyInfo of a peer's TLS key (its Ed25519 Atoll key)."""
    if len(public_key) != KEY_BYTES:
        raise LocalProtocolError(f"public key must be {KEY_BYTES} raw bytes, got {len(public_key)}")
    return hashlib.sha256(_ED25519_SPKI_PREFIX + bytes(public_key)).digest()


def verify_signature(public_key: bytes, signature: bytes, data: bytes, what: str) -> None:
    """Raise ``BadSignature`` ("``what``: signature does not verify") unless it does."""
    verify_ed25519(public_key, signature, data, what)


def hex_key(value: Any, what: str) -> bytes:
    """``value`` as the 32 bytes of an Ed25519 public key written in hex; ``DecodeError`` if not."""
    # hex digits only: bytes.fromhex skips whitespace, so "00\t00…" would be a shorter key
    if not isinstance(value, str) or not _HEX_KEY.fullmatch(value):
        raise DecodeError(f"{what} must be {2 * KEY_BYTES} hex digits (an Ed25519 public key)")
    return bytes.fromhex(value)


def parse_public_key(text: str) -> bytes:
    """A public key as ``atoll keygen`` prints it (64 hex digits). Raises ``DecodeError``."""
    return hex_key(text.strip().lower(), "public key")


def check_name(name: Any, what: str, limit: int) -> str:
    """``name`` if it is a name of at most ``limit`` characters (a swarm's, a lab's); ``DecodeError`` if not."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > limit:
        raise DecodeError(
            f"{what} must be 1-{limit} letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit; got {str(name)[:80]!r}"
        )
    return name


def check_format(value: int) -> int:
    """``value`` when this Atoll reads manifests of that format; ``DecodeError`` saying to
    upgrade when it is newer (``MANIFEST_FORMAT``), or saying what is wrong when it is not one."""
    if value > MANIFEST_FORMAT:
        raise DecodeError(
            f"the swarm's manifest is format {value}; this Atoll reads formats up to "
            f"{MANIFEST_FORMAT}: upgrade atoll"
        )
    if value < 1:
        raise DecodeError(f"manifest format must be 1 or more, got {value}")
    return value


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
    format: int = 1  # 2: carries ``validation_sha256``, 3: ``recipe_sha256`` (module docstring)
    validation_sha256: str = ""  # hex SHA-256 of the swarm's validation set ("": not pinned)
    recipe_sha256: str = ""  # hex SHA-256 of the recipe document (format 3; "": none)

    def __post_init__(self) -> None:
        check_name(self.name, "swarm name", MAX_NAME)
        check_format(self.format)
        if self.validation_sha256 and not _SHA256_HEX.fullmatch(self.validation_sha256):
            raise DecodeError(
                f"validation_sha256 must be 64 lower-case hex digits, got {self.validation_sha256[:80]!r}"
            )
        if self.validation_sha256 and self.format < 2:
            raise DecodeError("a manifest that pins its validation set is format 2 or above")
        if self.recipe_sha256 and not _SHA256_HEX.fullmatch(self.recipe_sha256):
            raise DecodeError(
                f"recipe_sha256 must be 64 lower-case hex digits, got {self.recipe_sha256[:80]!r}"
            )
        if self.recipe_sha256 and self.format < 3:
            raise DecodeError("a manifest that pins a recipe document is format 3 or above")
        if any(k in (FORMAT_KEY, PIN_KEY, RECIPE_PIN_KEY) for k, _ in self.recipe):
            raise DecodeError(
                f"{FORMAT_KEY}, {PIN_KEY} and {RECIPE_PIN_KEY} are the manifest's own fields, "
                "not recipe fields"
            )
        if len(self.founder) != KEY_BYTES:
            raise DecodeError(f"founder key must be {KEY_BYTES} bytes")
        if not 1 <= self.version < 2**63:
            raise DecodeError(f"manifest version must be in [1, 2^63), got {self.version}")
        if self.admission not in ADMISSIONS:
            raise DecodeError(f"admission must be open or certified, got {self.admission!r}")
        if not (math.isfinite(self.created) and self.created >= 0):
            raise DecodeError(f"created must be a finite unix time, got {self.created}")
        if len(self.recipe) > MAX_RECIPE_FIELDS:
            raise DecodeError(
                f"a recipe holds at most {MAX_RECIPE_FIELDS} fields, got {len(self.recipe)}"
            )
        for key, value in self.recipe:
            if not _RECIPE_KEY.fullmatch(key):
                raise DecodeError(f"recipe key {key[:48]!r} is not a lower-case identifier")
            if isinstance(value, float) and not math.isfinite(value):
                raise DecodeError(f"recipe value {key} must be finite")
            if isinstance(value, int) and not -(2**63) <= value < 2**63:  # TOML's range, msgpack's
                raise DecodeError(f"recipe value {key} must be a 64-bit integer")
            if not isinstance(value, (str, int, float, bool)) or (
                isinstance(value, str) and len(value) > 256
            ):
                raise DecodeError(
                    f"recipe value {key} must be a string (<= 256 chars), number or bool"
                )
        if list(self.recipe) != sorted(self.recipe, key=lambda kv: kv[0]) or len(
            dict(self.recipe)
        ) != len(self.recipe):
            raise DecodeError("recipe keys must be unique and sorted")
        if len(self.authorities) > MAX_AUTHORITIES:
            raise DecodeError(f"at most {MAX_AUTHORITIES} authorities, got {len(self.authorities)}")
        labs, keys = set(), set()
        for a in self.authorities:
            check_name(a.lab, "lab name", MAX_LAB)
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
        return bytes(
            msgpack.packb(
                [
                    MANIFEST_DOMAIN,
                    self.name,
                    self.founder,
                    self.version,
                    self.admission,
                    float(self.created),
                    [[k, v] for k, v in self.signed_recipe()],
                    [[a.lab, a.public_key] for a in self.authorities],
                    sorted(self.revoked),
                ],
                use_bin_type=True,
            )
        )

    def signed_recipe(self) -> tuple[tuple[str, str | int | float | bool], ...]:
        """The recipe table as signed and written: the recipe, and from format 2 on the format
        and the validation pin among its fields (sorted by name)."""
        if self.format == 1:
            return self.recipe
        extra: list[tuple[str, str | int | float | bool]] = [(FORMAT_KEY, self.format)]
        if self.validation_sha256:
            extra.append((PIN_KEY, self.validation_sha256))
        if self.recipe_sha256:
            extra.append((RECIPE_PIN_KEY, self.recipe_sha256))
        return tuple(sorted((*self.recipe, *extra), key=lambda kv: kv[0]))

    def signed(self, founder: ManifestSigner) -> SwarmManifest:
        """This manifest signed by ``founder``; raises ``LocalProtocolError`` for another key."""
        if founder.public_key != self.founder:
            raise LocalProtocolError(
                "this key is not the swarm's founder: only the founder's key "
                f"{self.founder.hex()} may sign its manifest"
            )
        unsigned = replace(self, signature=b"")
        return replace(unsigned, signature=founder.sign(unsigned.signing_bytes()))

    def verify(self, expected_id: str | None = None) -> None:
        """Raise ``BadSignature`` unless the founder signed exactly this manifest, and
        ``NotAuthorized`` when it is not the swarm ``expected_id``."""
        if expected_id is not None and self.swarm_id != expected_id:
            raise NotAuthorized(
                f"manifest is for swarm {self.swarm_id} ({self.name!r}), not {expected_id}"
            )
        if len(self.signature) != SIG_BYTES:
            raise BadSignature(
                "manifest is not signed by its founder (sign it with atoll swarm init / "
                "add-authority / revoke)"
            )
        verify_signature(
            self.founder, self.signature, self.signing_bytes(), f"manifest of swarm {self.name!r}"
        )

    def superseded_by(self, newer: SwarmManifest) -> bool:
        """Whether ``newer`` (already verified) replaces this manifest. Raises ``NotAuthorized``
        for a manifest of another swarm or one that changes the recipe; an older or equal version
        is not an error (returns False): manifests spread by gossip and arrive out of order."""
        if newer.swarm_id != self.swarm_id:
            raise NotAuthorized(f"manifest is for swarm {newer.swarm_id}, this is {self.swarm_id}")
        if newer.version <= self.version:
            return False
        if newer.recipe != self.recipe:
            changed = sorted(
                k
                for k in set(dict(newer.recipe)) | set(dict(self.recipe))
                if dict(newer.recipe).get(k) != dict(self.recipe).get(k)
            )
            raise NotAuthorized(
                f"manifest version {newer.version} changes the recipe ({', '.join(changed)}); "
                "a running swarm keeps its recipe: found a new swarm instead"
            )
        if (newer.format, newer.validation_sha256, newer.recipe_sha256) != (
            self.format,
            self.validation_sha256,
            self.recipe_sha256,
        ):
            raise NotAuthorized(
                f"manifest version {newer.version} changes the format, the validation set's "
                "pin or the recipe's; a running swarm keeps them: found a new swarm instead"
            )
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
        return replace(
            self,
            version=self.version + 1,
            signature=b"",
            authorities=(*others, Authority(lab, bytes(public_key))),
        )

    def with_revoked(self, public_key: bytes) -> SwarmManifest:
        return replace(
            self,
            version=self.version + 1,
            signature=b"",
            revoked=self.revoked | {bytes(public_key)},
        )

    # -- TOML -------------------------------------------------------------------------------------
    def to_toml_data(self) -> dict[str, Any]:
        """The manifest as TOML-ready data (``tomli_w.dumps`` writes it)."""
        data: dict[str, Any] = {
            "swarm": {
                "name": self.name,
                "id": self.swarm_id,
                "founder": self.founder.hex(),
                "version": self.version,
                "admission": self.admission,
                "created": float(self.created),
            },
            "recipe": dict(self.signed_recipe()),
            "authorities": [
                {"lab": a.lab, "public_key": a.public_key.hex()} for a in self.authorities
            ],
            "revoked": {"public_keys": sorted(k.hex() for k in self.revoked)},
        }
        if self.signature:
            data["signature"] = {"founder": self.signature.hex()}
        return data

    @classmethod
    def from_toml(cls, text: str | bytes) -> SwarmManifest:
        """Parse a manifest file's text; raises ``Oversize`` or ``DecodeError`` with what is wrong.
        The signature is not checked here: call ``verify``."""
        data = load_bounded_toml(text, limit=MAX_MANIFEST_BYTES, what="manifest")
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
        recipe = dict(recipe)
        fmt, pin = recipe.pop(FORMAT_KEY, 1), recipe.pop(PIN_KEY, "")
        recipe_pin = recipe.pop(RECIPE_PIN_KEY, "")
        if (
            not isinstance(fmt, int)
            or isinstance(fmt, bool)
            or (FORMAT_KEY in data["recipe"] and fmt < 2)
        ):
            raise DecodeError(
                f"recipe.{FORMAT_KEY} must be an integer >= 2 (format 1 is written without it)"
            )
        check_format(fmt)
        if not isinstance(pin, str):
            raise DecodeError(f"recipe.{PIN_KEY} must be a string of 64 hex digits")
        if not isinstance(recipe_pin, str):
            raise DecodeError(f"recipe.{RECIPE_PIN_KEY} must be a string of 64 hex digits")
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
            name=swarm["name"],
            founder=hex_key(swarm["founder"], "swarm.founder"),
            version=version,
            admission=swarm.get("admission", "open"),
            created=float(created),
            recipe=tuple(sorted(recipe.items())),
            authorities=tuple(
                Authority(a["lab"], hex_key(a["public_key"], f"authority {a.get('lab')!r} key"))
                for a in authorities
            ),
            revoked=frozenset(hex_key(k, "revoked key") for k in revoked),
            signature=sig,
            format=fmt,
            validation_sha256=pin,
            recipe_sha256=recipe_pin,
        )
        declared = swarm.get("id")
        if declared is not None and declared != manifest.swarm_id:
            raise DecodeError(
                f"swarm.id {str(declared)[:40]!r} does not match the founder and name "
                f"(expected {manifest.swarm_id})"
            )
        return manifest
