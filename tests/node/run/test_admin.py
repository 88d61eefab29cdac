"""``atoll keygen`` and ``atoll swarm ...`` run in-process: the two-lab walk, and every mistake
is one line on stderr with a non-zero exit."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from node.cli import main
from node.dht.membership import RECIPE_FIELDS
from node.wire.identity import load_certificate, load_key, load_manifest
from protocol.errors import NotAuthorized
from protocol.wire.certificates import check_certificate
from protocol.wire.membership import SwarmManifest


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    return out


def fails(capsys: pytest.CaptureFixture[str], *argv: str | Path, code: int = 1) -> str:
    """Run a command that must fail: exit ``code``, nothing on stdout, one ``atoll <cmd>:`` line."""
    got, out, err = run(capsys, *argv)
    assert got == code, (got, out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll "), err
    assert "Traceback" not in err
    return lines[0]


def keygen(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    info = json.loads(ok(capsys, "keygen", "--out", path, "--json"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key(path).peer_id.hex() == info["peer_id"]
    return str(info["public_key"])


@pytest.fixture
def keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Keys for the founder, two labs' authorities and three peers: name -> public key hex."""
    return {
        name: keygen(capsys, tmp_path / f"{name}.pem")
        for name in ("founder", "auth_a", "auth_b", "peer", "peer2", "stranger")
    }


def init(capsys: pytest.CaptureFixture[str], tmp_path: Path, *extra: str) -> str:
    out = ok(
        capsys,
        "swarm",
        "init",
        "--name",
        "two-labs",
        "--founder",
        tmp_path / "founder.pem",
        "--admission",
        "certified",
        "--model",
        "tiny",
        "--out",
        tmp_path / "swarm.toml",
        *extra,
    )
    return out.splitlines()[0]


# --- keygen ------------------------------------------------------------------------------------
def test_keygen_prints_public_key_and_peer_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ok(capsys, "keygen", "--out", tmp_path / "k.pem")
    signer = load_key(tmp_path / "k.pem")
    assert out.splitlines() == [
        f"public_key {signer.public_key.hex()}",
        f"peer_id {signer.peer_id.hex()}",
    ]
    assert "PRIVATE" not in out
    line = fails(capsys, "keygen", "--out", tmp_path / "k.pem")
    assert line.startswith("atoll keygen: ") and "--force" in line
    ok(capsys, "keygen", "--out", tmp_path / "k.pem", "--force")
    assert load_key(tmp_path / "k.pem").public_key != signer.public_key


# --- the walk ----------------------------------------------------------------------------------
def test_two_lab_walk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, str]
) -> None:
    manifest_path, cert_path = tmp_path / "swarm.toml", tmp_path / "peer.cert"
    sid = init(capsys, tmp_path)
    m = load_manifest(manifest_path, expected_id=sid)
    assert (m.version, m.admission, m.authorities, m.revoked) == (1, "certified", (), frozenset())
    assert set(m.recipe_dict) == set(RECIPE_FIELDS)
    assert m.recipe_dict["model"] == "tiny"
    assert m.recipe_dict["max_tokens_per_step"] == 16 * 64  # resolved: batch size x tiny's context
    assert abs(m.created - time.time()) < 60

    out = ok(
        capsys,
        "swarm",
        "add-authority",
        manifest_path,
        "--founder",
        tmp_path / "founder.pem",
        "--lab",
        "labA",
        "--key",
        keys["auth_a"],
    )
    assert "version 2" in out
    ok(
        capsys,
        "swarm",
        "add-authority",
        manifest_path,
        "--founder",
        tmp_path / "founder.pem",
        "--lab",
        "labB",
        "--key",
        tmp_path / "auth_b.pem",
    )  # a key file stands for its public key
    m = load_manifest(manifest_path, expected_id=sid)
    assert m.version == 3 and [(a.lab, a.public_key.hex()) for a in m.authorities] == [
        ("labA", keys["auth_a"]),
        ("labB", keys["auth_b"]),
    ]

    out = ok(
        capsys,
        "swarm",
        "certify",
        "--manifest",
        manifest_path,
        "--authority",
        tmp_path / "auth_a.pem",
        "--peer",
        keys["peer"],
        "--roles",
        "learner,owner",
        "--days",
        "0.0001",
        "--out",
        cert_path,
    )
    assert "lab labA" in out and "roles learner,owner" in out and "valid until" in out
    cert = load_certificate(cert_path)
    peer_key = bytes.fromhex(keys["peer"])
    now = time.time()
    assert cert.not_before <= now - 59 and abs(cert.not_after - (now + 8.64)) < 5
    check_certificate(m, cert, public_key=peer_key, role="owner", now=now)
    with pytest.raises(NotAuthorized, match="expired"):
        check_certificate(m, cert, public_key=peer_key, role="owner", now=now + 10)

    out = ok(
        capsys,
        "swarm",
        "revoke",
        manifest_path,
        "--founder",
        tmp_path / "founder.pem",
        "--peer",
        keys["peer"],
    )
    assert "version 4" in out
    revoked = load_manifest(manifest_path, expected_id=sid)
    assert revoked.version == 4 and peer_key in revoked.revoked and m.superseded_by(revoked)
    with pytest.raises(NotAuthorized, match="revoked"):
        check_certificate(revoked, cert, public_key=peer_key, role="learner", now=now)
    out = ok(
        capsys,
        "swarm",
        "revoke",
        manifest_path,
        "--founder",
        tmp_path / "founder.pem",
        "--peer",
        keys["peer"],
    )
    assert "already revoked" in out and load_manifest(manifest_path).version == 4

    shown = json.loads(ok(capsys, "swarm", "show", manifest_path, "--json"))
    assert shown["id"] == sid and shown["version"] == 4 and shown["revoked"] == [keys["peer"]]
    assert [a["lab"] for a in shown["authorities"]] == ["labA", "labB"]
    text = ok(capsys, "swarm", "show", manifest_path)
    assert sid in text and "authority labB" in text and f"revoked {keys['peer']}" in text


def test_recipe_flags_are_the_recipe_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, str]
) -> None:
    init(
        capsys,
        tmp_path,
        "--fragments",
        "8",
        "--max-tokens-per-step",
        "500",
        "--outer-momentum",
        "0.9",
    )
    recipe = load_manifest(tmp_path / "swarm.toml").recipe_dict
    assert (recipe["fragments"], recipe["max_tokens_per_step"], recipe["outer_momentum"]) == (
        8,
        500,
        0.9,
    )
    # the learners' schedule is in the recipe too (atoll join follows it unless told otherwise)
    init(capsys, tmp_path, "--steps", "100000", "--lr", "0.002", "--force")
    recipe = load_manifest(tmp_path / "swarm.toml").recipe_dict
    assert (recipe["steps"], recipe["lr"], recipe["warmup_steps"]) == (100000, 0.002, 50)
    # fields outside the recipe are not flags of swarm init
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "swarm",
                "init",
                "--name",
                "x",
                "--founder",
                str(tmp_path / "founder.pem"),
                "--out",
                str(tmp_path / "x.toml"),
                "--threads",
                "1",
            ]
        )
    assert exc.value.code == 2 and "unrecognized arguments: --threads" in capsys.readouterr().err


# --- mistakes ----------------------------------------------------------------------------------
def test_init_pins_the_validation_set_in_a_format_2_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, str]
) -> None:
    pin = "ab" * 32
    init(capsys, tmp_path, "--validation-sha256", pin.upper())
    manifest = load_manifest(tmp_path / "swarm.toml")
    assert (manifest.format, manifest.validation_sha256) == (2, pin)
    assert "validation_sha256" not in manifest.recipe_dict  # not a field peers configure
    assert f"validation_sha256={pin}" in ok(capsys, "swarm", "show", tmp_path / "swarm.toml")
    init(capsys, tmp_path, "--force")  # without a pin: format 1, as before
    assert load_manifest(tmp_path / "swarm.toml").format == 1
    line = fails(
        capsys,
        "swarm",
        "init",
        "--name",
        "s",
        "--founder",
        tmp_path / "founder.pem",
        "--out",
        tmp_path / "s.toml",
        "--validation-sha256",
        "xyz",
    )
    assert "64 lower-case hex digits" in line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--block-size", "0"), "--block-size must be >= 1, got 0"),
        (("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
        (("--grace-cap-s", "inf"), "--grace-cap-s must be finite and >= 0, got inf"),
        (("--fragments", "100000"), "--fragments 100000: 100000 fragments for only 29 tensors"),
    ],
)
def test_a_recipe_every_peer_would_refuse_is_never_signed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, str], says: str
) -> None:
    keygen(capsys, tmp_path / "founder.pem")
    line = fails(
        capsys,
        "swarm",
        "init",
        "--name",
        "s",
        "--founder",
        tmp_path / "founder.pem",
        "--model",
        "tiny",
        "--out",
        tmp_path / "s.toml",
        *flags,
        code=2,
    )
    assert line.startswith("atoll swarm init: ") and says in line, line
    assert not (tmp_path / "s.toml").exists()


def test_certificate_from_a_non_authority_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, str]
) -> None:
    init(capsys, tmp_path)
    line = fails(
        capsys,
        "swarm",
        "certify",
        "--manifest",
        tmp_path / "swarm.toml",
        "--authority",
        tmp_path / "stranger.pem",
        "--peer",
        keys["peer"],
        "--roles",
        "learner",
        "--out",
        tmp_path / "c.cert",
    )
    assert line.startswith("atoll swarm certify: ") and "not an authority" in line
    assert not (tmp_path / "c.cert").exists()


def test_only_the_founder_edits_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, str]
) -> None:
    init(capsys, tmp_path)
    before = (tmp_path / "swarm.toml").read_text()
    line = fails(
        capsys,
        "swarm",
        "add-authority",
        tmp_path / "swarm.toml",
        "--founder",
        tmp_path / "stranger.pem",
        "--lab",
        "labA",
        "--key",
        keys["stranger"],
    )
    assert "is not the founder's key" in line
    line = fails(
        capsys,
        "swarm",
        "revoke",
        tmp_path / "swarm.toml",
        "--founder",
        tmp_path / "auth_a.pem",
        "--peer",
        keys["peer"],
    )
    assert "is not the founder's key" in line
    assert (tmp_path / "swarm.toml").read_text() == before


def test_manifest_edited_by_hand_is_refused_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, str]
) -> None:
    init(capsys, tmp_path)
    path = tmp_path / "swarm.toml"
    path.write_text(path.read_text().replace('admission = "certified"', 'admission = "open"'))
    expected = (
        f"{path}: manifest signature does not verify: it was edited after signing, "
        "or not signed by its founder"
    )
    assert fails(capsys, "swarm", "show", path) == f"atoll swarm show: {expected}"
    assert fails(
        capsys,
        "swarm",
        "certify",
        "--manifest",
        path,
        "--authority",
        tmp_path / "auth_a.pem",
        "--peer",
        keys["peer"],
        "--roles",
        "learner",
        "--out",
        tmp_path / "c.cert",
    ).endswith(expected)
    assert fails(
        capsys,
        "swarm",
        "revoke",
        path,
        "--founder",
        tmp_path / "founder.pem",
        "--peer",
        keys["peer"],
    ).endswith(expected)
    assert fails(
        capsys,
        "swarm",
        "publish",
        path,
        "--peer",
        "http://127.0.0.1:9",
        "--founder",
        tmp_path / "founder.pem",
    ).endswith(expected)


def test_every_mistake_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, str]
) -> None:
    init(capsys, tmp_path)
    m, f, a = tmp_path / "swarm.toml", tmp_path / "founder.pem", tmp_path / "auth_a.pem"
    ok(
        capsys,
        "swarm",
        "add-authority",
        m,
        "--founder",
        f,
        "--lab",
        "labA",
        "--key",
        keys["auth_a"],
    )
    certify = (
        "swarm",
        "certify",
        "--manifest",
        m,
        "--authority",
        a,
        "--peer",
        keys["peer"],
        "--out",
        tmp_path / "c.cert",
    )
    missing = tmp_path / "missing.pem"
    assert "no key at" in fails(
        capsys, "swarm", "init", "--name", "s", "--founder", missing, "--out", tmp_path / "s.toml"
    )
    assert "already exists" in fails(
        capsys, "swarm", "init", "--name", "s", "--founder", f, "--out", m
    )
    assert "swarm name" in fails(
        capsys, "swarm", "init", "--name", "bad name", "--founder", f, "--out", tmp_path / "s.toml"
    )
    assert "unknown model preset" in fails(
        capsys,
        "swarm",
        "init",
        "--name",
        "s",
        "--founder",
        f,
        "--model",
        "huge",
        "--out",
        tmp_path / "s.toml",
        code=2,
    )
    assert "--codec must be" in fails(
        capsys,
        "swarm",
        "init",
        "--name",
        "s",
        "--founder",
        f,
        "--codec",
        "int3",
        "--out",
        tmp_path / "s.toml",
        code=2,
    )
    assert "no manifest at" in fails(capsys, "swarm", "show", tmp_path / "nope.toml")
    assert "--roles" in fails(capsys, *certify, "--roles", "admin", code=2)
    assert "--days" in fails(capsys, *certify, "--roles", "learner", "--days", "-1", code=2)
    assert "--days" in fails(capsys, *certify, "--roles", "learner", "--days", "soon", code=2)
    assert "neither a public key" in fails(
        capsys, *certify[:-4], "--peer", "abcd", "--roles", "learner", "--out", tmp_path / "c.cert"
    )
    assert "is not an http(s) URL" in fails(
        capsys, "swarm", "publish", m, "--peer", "ftp://x", "--founder", f, code=2
    )
    assert "could not reach" in fails(
        capsys, "swarm", "publish", m, "--peer", "http://127.0.0.1:9", "--founder", f
    )
    (tmp_path / "leaky.pem").write_bytes(a.read_bytes())
    (tmp_path / "leaky.pem").chmod(0o644)
    line = fails(
        capsys,
        "swarm",
        "certify",
        "--manifest",
        m,
        "--authority",
        tmp_path / "leaky.pem",
        "--peer",
        keys["peer"],
        "--roles",
        "learner",
        "--out",
        tmp_path / "c.cert",
    )
    assert line == (
        f"atoll swarm certify: key file {tmp_path / 'leaky.pem'} is readable by others "
        f"(mode 0644); run chmod 600 {tmp_path / 'leaky.pem'}"
    )
    ok(capsys, "swarm", "revoke", m, "--founder", f, "--peer", keys["peer"])
    assert "revoked" in fails(capsys, *certify, "--roles", "learner")
    assert not (tmp_path / "c.cert").exists()


# --- publish -----------------------------------------------------------------------------------
@pytest.fixture
async def manifest_sink() -> AsyncIterator[tuple[str, list[tuple[str, bytes]]]]:
    """A tiny peer that takes manifests on POST /v1/swarm/manifest (refusing one named 'refuse')."""
    got: list[tuple[str, bytes]] = []

    async def take(request: web.Request) -> web.Response:
        body = await request.read()
        got.append((request.content_type, body))
        if SwarmManifest.from_toml(body).version == 1:
            return web.json_response(
                {"error": "manifest version 1 is not newer than ours (2)"}, status=409
            )
        return web.json_response({"adopted": True})

    app = web.Application()
    app.router.add_post("/v1/swarm/manifest", take)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", got
    finally:
        await runner.cleanup()


async def test_publish_posts_the_toml(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    keys: dict[str, str],
    manifest_sink: tuple[str, list[tuple[str, bytes]]],
) -> None:
    url, got = manifest_sink
    init(capsys, tmp_path)
    m = tmp_path / "swarm.toml"

    async def publish() -> tuple[int, str, str]:
        code = await asyncio.wait_for(
            asyncio.to_thread(
                main,
                [
                    "swarm",
                    "publish",
                    str(m),
                    "--peer",
                    url + "/",
                    "--founder",
                    str(tmp_path / "founder.pem"),
                ],
            ),
            30,
        )
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = await publish()
    assert (
        code == 1
        and out == ""
        and err.splitlines()
        == [
            f"atoll swarm publish: {url} refused the manifest: 409 manifest version 1 is not newer than ours (2)"
        ]
    )
    ok(capsys, "swarm", "revoke", m, "--founder", tmp_path / "founder.pem", "--peer", keys["peer"])
    code, out, err = await publish()
    assert code == 0 and json.loads(out) == {"adopted": True}
    assert [ct for ct, _ in got] == ["application/toml", "application/toml"]
    assert got[-1][1] == m.read_bytes()
