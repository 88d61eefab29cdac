"""The files that say who a peer is and which swarm it belongs to: keys, manifests, certificates.

A private key is an Ed25519 key in PEM (PKCS8, unencrypted), created with mode 0600 and refused
when group or others may read it (like ssh). A swarm manifest is TOML and is verified against its
founder's signature whenever it is read; a certificate is the armored text of
``Certificate.to_text`` and is only decoded here (``check_certificate`` judges it against a
manifest). Manifests and certificates are written atomically (a temp file, then ``os.replace``).

Every failure is an ``IdentityError`` whose message is one line that names the file and says what
to do. Private key bytes are never logged, printed or put in a message.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import tomli_w
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from node.state.atomic import write_atomic
from protocol.errors import BadSignature, RemoteProtocolError
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest, parse_public_key
from protocol.wire.signing import Signer

__all__ = [
    "IdentityError",
    "generate_key",
    "load_certificate",
    "load_key",
    "load_manifest",
    "public_key_from_arg",
    "save_certificate",
    "save_key",
    "save_manifest",
]

_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")


class IdentityError(ValueError):
    """A key, manifest or certificate file that cannot be used; the message says what to do."""


# --- private keys ----------------------------------------------------------------------------
def generate_key() -> Signer:
    """A fresh Ed25519 key from the operating system's randomness."""
    return Signer(os.urandom(32))


def _pem(signer: Signer) -> bytes:
    key: Ed25519PrivateKey = signer.private_key()
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())


def save_key(signer: Signer, path: Path | str, *, force: bool = False) -> None:
    """Write ``signer``'s private key to ``path`` as PEM, mode 0600 from the moment it exists.

    Raises ``IdentityError`` if ``path`` exists (unless ``force``) or cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if force:
            write_atomic(path, _pem(signer), mode=0o600)
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_pem(signer))
    except FileExistsError:
        raise IdentityError(
            f"{path} already exists; pass --force to overwrite it (the key in it is lost)"
        ) from None
    except OSError as exc:
        raise IdentityError(f"cannot write key {path}: {exc.strerror or exc}") from None


def load_key(path: Path | str) -> Signer:
    """The signer whose private key is in ``path``.

    Raises ``IdentityError`` if the file is missing, open to group or others, or not an
    unencrypted PEM Ed25519 private key."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        raise IdentityError(f"no key at {path}; make one with atoll keygen --out {path}") from None
    except OSError as exc:
        raise IdentityError(f"cannot read key {path}: {exc.strerror}") from None
    if mode & 0o077:
        how = "readable" if mode & 0o044 else "writable"
        raise IdentityError(
            f"key file {path} is {how} by others (mode {mode:04o}); run chmod 600 {path}"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read key {path}: {exc.strerror}") from None
    try:
        key = load_pem_private_key(data, password=None)
    except TypeError:
        raise IdentityError(
            f"{path}: the key is encrypted; Atoll reads unencrypted PEM keys "
            "(make one with atoll keygen --out PATH)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise IdentityError(
            f"{path} is not a PEM private key; make one with atoll keygen --out PATH"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(
            f"{path} holds a {type(key).__name__.removeprefix('_')} key, not Ed25519; "
            "make one with atoll keygen --out PATH"
        )
    return Signer(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))


def public_key_from_arg(text: str) -> bytes:
    """A public key given on the command line: 64 hex digits as ``atoll keygen`` prints them, or
    the path of a private key file (its public key is used). Raises ``IdentityError``."""
    if _HEX_KEY.fullmatch(text.strip()):
        return parse_public_key(text)
    if Path(text).is_file():
        return load_key(text).public_key
    raise IdentityError(
        f"{text[:80]!r} is neither a public key (64 hex digits, as atoll keygen prints) "
        "nor a key file"
    )


# --- manifests -------------------------------------------------------------------------------
def save_manifest(manifest: SwarmManifest, path: Path | str) -> None:
    """Write ``manifest`` as TOML, atomically. Raises ``IdentityError`` if it cannot be written."""
    _write_text(Path(path), tomli_w.dumps(manifest.to_toml_data()), "manifest")


def load_manifest(path: Path | str, *, expected_id: str | None = None) -> SwarmManifest:
    """The manifest in ``path``, its founder's signature verified (and its id, if given).

    Raises ``IdentityError``: missing file, not a manifest, signature that does not verify,
    another swarm's manifest."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise IdentityError(
            f"no manifest at {path}; the founder makes one with "
            f"atoll swarm init --name NAME --founder KEY --out {path}"
        ) from None
    except OSError as exc:
        raise IdentityError(f"cannot read manifest {path}: {exc.strerror}") from None
    try:
        manifest = SwarmManifest.from_toml(text)
    except RemoteProtocolError as exc:
        raise IdentityError(f"{path}: {exc.reason}") from None
    try:
        manifest.verify(expected_id)
    except BadSignature as exc:
        if not manifest.signature:
            raise IdentityError(f"{path}: {exc.reason}") from None
        raise IdentityError(
            f"{path}: manifest signature does not verify: it was edited after signing, "
            "or not signed by its founder"
        ) from None
    except RemoteProtocolError as exc:
        raise IdentityError(f"{path}: {exc.reason}") from None
    return manifest


# --- certificates ----------------------------------------------------------------------------
def save_certificate(cert: Certificate, path: Path | str) -> None:
    """Write ``cert`` as armored text, atomically. Raises ``IdentityError``."""
    _write_text(Path(path), cert.to_text(), "certificate")


def load_certificate(path: Path | str) -> Certificate:
    """The certificate in ``path``, decoded but not checked (callers use ``check_certificate``).

    Raises ``IdentityError`` if missing or not an Atoll certificate."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise IdentityError(
            f"no certificate at {path}; ask a lab's authority for one "
            f"(atoll swarm certify --manifest MANIFEST --authority KEY --peer PUBKEY "
            f"--roles learner,owner --out {path})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise IdentityError(
            f"cannot read certificate {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    try:
        return Certificate.from_text(text)
    except RemoteProtocolError as exc:
        raise IdentityError(f"{path}: {exc.reason}") from None


# --- writing ---------------------------------------------------------------------------------
def _write_text(path: Path, text: str, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode(), mode=0o644)
    except OSError as exc:
        raise IdentityError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
