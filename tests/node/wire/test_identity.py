"""Key, manifest and certificate files: modes, round trips, and one clear line per mistake."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import tomli_w
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    NoEncryption,
    PrivateFormat,
)

from node.wire.identity import (
    IdentityError,
    generate_key,
    load_certificate,
    load_key,
    load_manifest,
    public_key_from_arg,
    save_certificate,
    save_key,
    save_manifest,
)
from protocol.wire.certificates import Certificate, check_certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _manifest(founder: Signer, *authorities: tuple[str, Signer]) -> SwarmManifest:
    m = SwarmManifest(
        name="two-labs",
        founder=founder.public_key,
        admission="certified",
        created=1000.0,
        recipe=(("fragments", 4), ("model", "tiny")),
    )
    for lab, key in authorities:
        m = m.with_authority(lab, key.public_key)
    return m.signed(founder)


# --- keys ------------------------------------------------------------------------------------
def test_key_round_trip_is_pem_pkcs8_mode_0600(tmp_path: Path) -> None:
    signer = generate_key()
    path = tmp_path / "keys" / "peer.pem"
    save_key(signer, path)
    assert _mode(path) == 0o600
    text = path.read_text()
    assert text.startswith("-----BEGIN PRIVATE KEY-----")
    loaded = load_key(path)
    assert loaded.public_key == signer.public_key and loaded.peer_id == signer.peer_id
    assert generate_key().public_key != signer.public_key


def test_save_key_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    first, second = generate_key(), generate_key()
    save_key(first, path)
    with pytest.raises(IdentityError, match="already exists; pass --force"):
        save_key(second, path)
    assert load_key(path).public_key == first.public_key
    os.chmod(path, 0o644)
    save_key(second, path, force=True)
    assert _mode(path) == 0o600
    assert load_key(path).public_key == second.public_key
    assert [p.name for p in tmp_path.iterdir()] == ["k.pem"]  # no temp file left behind


def test_missing_key_says_how_to_make_one(tmp_path: Path) -> None:
    path = tmp_path / "nope.pem"
    with pytest.raises(IdentityError) as exc:
        load_key(path)
    assert str(exc.value) == f"no key at {path}; make one with atoll keygen --out {path}"


def test_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    save_key(generate_key(), path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError) as exc:
        load_key(path)
    assert (
        str(exc.value) == f"key file {path} is readable by others (mode 0644); run chmod 600 {path}"
    )
    os.chmod(path, 0o620)
    with pytest.raises(IdentityError, match="writable by others"):
        load_key(path)


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"hello\n", "is not a PEM private key"),
        (b"", "is not a PEM private key"),
        ("ec", "not Ed25519"),
        ("encrypted", "encrypted"),
    ],
)
def test_bad_key_files_are_refused_in_one_line(
    tmp_path: Path, content: bytes | str, reason: str
) -> None:
    if content == "ec":
        data = generate_private_key(SECP256R1()).private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
        )
    elif content == "encrypted":
        data = generate_key()._key.private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, BestAvailableEncryption(b"pw")
        )
    else:
        assert isinstance(content, bytes)
        data = content
    path = tmp_path / "k.pem"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    with pytest.raises(IdentityError, match=reason) as exc:
        load_key(path)
    assert "\n" not in str(exc.value)


def test_error_messages_never_hold_the_private_key(tmp_path: Path) -> None:
    signer = generate_key()
    path = tmp_path / "k.pem"
    save_key(signer, path)
    secret = path.read_text()
    os.chmod(path, 0o640)
    with pytest.raises(IdentityError) as exc:
        load_key(path)
    body = "".join(secret.splitlines()[1:-1])
    assert body not in str(exc.value) and body not in repr(signer)


def test_public_key_from_hex_or_key_file(tmp_path: Path) -> None:
    signer = generate_key()
    path = tmp_path / "k.pem"
    save_key(signer, path)
    assert public_key_from_arg(signer.public_key.hex()) == signer.public_key
    assert public_key_from_arg(signer.public_key.hex().upper()) == signer.public_key
    assert public_key_from_arg(str(path)) == signer.public_key
    for bad in ("abc", "zz" * 32, str(tmp_path / "missing.pem")):
        with pytest.raises(IdentityError, match="neither a public key"):
            public_key_from_arg(bad)


# --- manifests -------------------------------------------------------------------------------
def test_manifest_round_trip_and_atomic_write(tmp_path: Path) -> None:
    founder, lab = generate_key(), generate_key()
    m = _manifest(founder, ("labA", lab))
    path = tmp_path / "swarm.toml"
    save_manifest(m, path)
    assert load_manifest(path) == m
    assert load_manifest(path, expected_id=m.swarm_id) == m
    newer = m.with_revoked(generate_key().public_key).signed(founder)
    save_manifest(newer, path)
    assert load_manifest(path).version == m.version + 1
    assert [p.name for p in tmp_path.iterdir()] == ["swarm.toml"]


def test_manifest_edited_after_signing_does_not_load(tmp_path: Path) -> None:
    founder = generate_key()
    path = tmp_path / "swarm.toml"
    save_manifest(_manifest(founder), path)
    path.write_text(path.read_text().replace("fragments = 4", "fragments = 8"))
    with pytest.raises(IdentityError) as exc:
        load_manifest(path)
    assert str(exc.value) == (
        f"{path}: manifest signature does not verify: it was edited after signing, "
        "or not signed by its founder"
    )


def test_manifest_signed_by_another_key_does_not_load(tmp_path: Path) -> None:
    founder, mallory = generate_key(), generate_key()
    good = _manifest(founder)
    forged = good.to_toml_data()
    forged["signature"]["founder"] = mallory.sign(good.signing_bytes()).hex()
    path = tmp_path / "swarm.toml"
    path.write_text(tomli_w.dumps(forged))
    with pytest.raises(IdentityError, match="signature does not verify"):
        load_manifest(path)


@pytest.mark.parametrize(
    "text, reason",
    [
        (None, "no manifest at"),
        ("[swarm\nname = 1", "not valid TOML"),
        ("[swarm]\nname = 'x'\n", "missing a field"),
    ],
)
def test_manifest_file_mistakes(tmp_path: Path, text: str | None, reason: str) -> None:
    path = tmp_path / "swarm.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(IdentityError, match=reason) as exc:
        load_manifest(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_unsigned_manifest_and_wrong_swarm_id(tmp_path: Path) -> None:
    founder = generate_key()
    path = tmp_path / "swarm.toml"
    unsigned = SwarmManifest(name="s", founder=founder.public_key)
    path.write_text(tomli_w.dumps(unsigned.to_toml_data()))
    with pytest.raises(IdentityError, match="not signed by its founder"):
        load_manifest(path)
    save_manifest(unsigned.signed(founder), path)
    with pytest.raises(IdentityError, match="not 0+$"):
        load_manifest(path, expected_id="0" * 32)


# --- certificates ----------------------------------------------------------------------------
def test_certificate_round_trip(tmp_path: Path) -> None:
    founder, authority, peer = generate_key(), generate_key(), generate_key()
    m = _manifest(founder, ("labA", authority))
    cert = Certificate.issue(
        authority,
        manifest=m,
        subject=peer.public_key,
        roles=["learner"],
        not_before=0.0,
        not_after=100.0,
    )
    path = tmp_path / "peer.cert"
    save_certificate(cert, path)
    loaded = load_certificate(path)
    assert loaded == cert
    check_certificate(m, loaded, public_key=peer.public_key, role="learner", now=50.0)


def test_certificate_file_mistakes(tmp_path: Path) -> None:
    path = tmp_path / "peer.cert"
    with pytest.raises(IdentityError, match="no certificate at .*atoll swarm certify"):
        load_certificate(path)
    path.write_text("not a certificate\n")
    with pytest.raises(IdentityError, match="not an Atoll certificate"):
        load_certificate(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(IdentityError, match="cannot read certificate"):
        load_certificate(path)
