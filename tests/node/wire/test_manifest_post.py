"""``POST /v1/swarm/manifest`` on a real server on 127.0.0.1: nothing is read or parsed before
the founder's signature (or, in a certified swarm, a member's certificate) vouches for the post,
every parse runs off the loop one at a time, and the size cap fits a large real manifest."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import tomli_w

from node.dht.swarm import (
    MANIFEST_PATH,
    POST_SIGNATURE_HEADER,
    SwarmCredentials,
    manifest_post_headers,
)
from node.wire.transport import Transport
from protocol.dht.ratelimit import RateLimiter
from protocol.wire.membership import MAX_MANIFEST_BYTES, Authority, SwarmManifest
from protocol.wire.signing import Signer
from tests.node.wire.test_admission import Swarm, client, serve

pytestmark = pytest.mark.timeout(120)

# TOML that takes tomllib ~1-3 s to parse on the 2-core box: one array of 500k integers
SLOW_TOML = ("x = [" + "1," * (MAX_MANIFEST_BYTES // 2))[: MAX_MANIFEST_BYTES - 1].encode() + b"]"


def key() -> Signer:
    return Signer.from_seed(os.urandom(32))


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``SwarmManifest.from_toml`` call, by the length of the text it parsed."""
    seen: list[int] = []
    real = SwarmManifest.from_toml.__func__  # type: ignore[attr-defined]

    def counted(cls: type[SwarmManifest], text: str | bytes) -> SwarmManifest:
        seen.append(len(text))
        return real(cls, text)  # type: ignore[no-any-return]

    monkeypatch.setattr(SwarmManifest, "from_toml", classmethod(counted))
    return seen


@pytest.fixture
async def open_swarm() -> AsyncIterator[tuple[Swarm, Transport, SwarmCredentials]]:
    swarm = Swarm("open")
    server, cred = await serve(swarm, key())
    try:
        yield swarm, server, cred
    finally:
        await server.close()


async def _post(
    s: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object]]:
    async with s.post(url + MANIFEST_PATH, data=body, headers=headers) as r:
        return r.status, await r.json()


async def test_unsigned_manifest_posts_cost_no_parse_and_leave_the_loop_free(
    open_swarm: tuple[Swarm, Transport, SwarmCredentials], parses: list[int]
) -> None:
    """A burst of unsigned 1 MiB posts (each ~2 s of TOML to parse) while GETs are answered:
    before, every one was parsed on the loop and a GET waited seconds; now each is a 401 before its
    body is read, no parse runs, and every GET is answered within a second."""
    _, server, _ = open_swarm
    url = server.url
    async with aiohttp.ClientSession() as s:

        async def post() -> int | str:
            try:
                async with s.post(url + MANIFEST_PATH, data=SLOW_TOML) as r:
                    return r.status
            except aiohttp.ClientError as exc:  # hung up on before the whole body went out
                return type(exc).__name__

        async def get() -> float:
            t0 = time.perf_counter()
            async with s.get(url + MANIFEST_PATH) as r:
                assert r.status == 200
                await r.read()
            return time.perf_counter() - t0

        posts = [asyncio.create_task(post()) for _ in range(4)]
        waits = [await get()]
        while not all(p.done() for p in posts) or len(waits) < 5:
            waits.append(await get())
        statuses = [p.result() for p in posts]
    assert parses == [], f"unsigned posts were parsed: {len(parses)} parses of {parses[:4]} bytes"
    assert max(waits) < 1.0, (
        f"a GET waited {max(waits):.2f} s during the burst (statuses {statuses})"
    )
    assert all(st in (401, "ClientOSError", "ServerDisconnectedError") for st in statuses), statuses


async def test_a_founder_signed_post_is_adopted_and_forgeries_are_refused_unread(
    open_swarm: tuple[Swarm, Transport, SwarmCredentials], parses: list[int]
) -> None:
    swarm, server, cred = open_swarm
    cred._publishes = RateLimiter(rate=1.0, burst=100)  # more posts than one address's burst of 4
    newer = swarm.manifest.with_revoked(key().public_key).signed(swarm.founder)
    text = tomli_w.dumps(newer.to_toml_data()).encode()
    signed = manifest_post_headers(swarm.founder, newer, text)
    async with aiohttp.ClientSession() as s:
        # signed by someone else, or a founder signature over another body: 401, nothing parsed
        status, body = await _post(s, server.url, text, manifest_post_headers(key(), newer, text))
        assert status == 401 and "founder" in str(body["reason"])
        status, body = await _post(s, server.url, SLOW_TOML, signed)
        assert status == 401 and "not the one" in str(body["reason"])
        status, _ = await _post(s, server.url, text, {POST_SIGNATURE_HEADER: "1 abc def"})
        assert status == 400
        assert parses == [] and cred.manifest.version == swarm.manifest.version
        # the founder's post: read, parsed once (off the loop) and adopted
        status, body = await _post(s, server.url, text, signed)
        assert status == 200 and body["adopted"] is True and cred.manifest == newer
        assert len(parses) == 1 and cred.parses == 1
        # the same post again (a replay): answered from its head, not read or parsed
        status, body = await _post(s, server.url, text, signed)
        assert status == 200 and body["adopted"] is False and len(parses) == 1


async def test_a_second_parse_meanwhile_is_refused_at_once(
    open_swarm: tuple[Swarm, Transport, SwarmCredentials],
) -> None:
    swarm, server, cred = open_swarm
    newer = swarm.manifest.with_revoked(key().public_key).signed(swarm.founder)
    text = tomli_w.dumps(newer.to_toml_data()).encode()
    async with aiohttp.ClientSession() as s:
        async with cred._parsing:  # a parse running (another post's, or a member's manifest)
            t0 = time.perf_counter()
            status, body = await _post(
                s, server.url, text, manifest_post_headers(swarm.founder, newer, text)
            )
            assert status == 429 and "being checked" in str(body["reason"])
            assert time.perf_counter() - t0 < 1.0  # refused, not queued
        status, body = await _post(
            s, server.url, text, manifest_post_headers(swarm.founder, newer, text)
        )
        assert status == 200 and body["adopted"] is True


async def test_a_certified_member_may_post_without_the_founder_header() -> None:
    swarm = Swarm("certified")
    server, cred = await serve(swarm, key())
    member = key()
    ok = await client(swarm, member, swarm.cert(member))
    try:
        newer = swarm.manifest.with_revoked(key().public_key).signed(swarm.founder)
        status, buf, used, _ = await ok.request(
            "POST",
            server.url + MANIFEST_PATH,
            chunks=[tomli_w.dumps(newer.to_toml_data()).encode()],
            size=len(tomli_w.dumps(newer.to_toml_data()).encode()),
        )
        ok.pool.give(buf)
        assert status == 200 and cred.manifest == newer
    finally:
        await ok.close()
        await server.close()


async def test_atoll_swarm_publish_signs_its_post(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from node.cli import main
    from node.wire.identity import load_manifest

    founder_key, path = tmp_path / "f.pem", tmp_path / "s.toml"
    assert main(["keygen", "--out", str(founder_key)]) == 0
    assert (
        main(
            [
                "swarm",
                "init",
                "--name",
                "s",
                "--founder",
                str(founder_key),
                "--model",
                "tiny",
                "--admission",
                "open",
                "--out",
                str(path),
            ]
        )
        == 0
    )
    first = load_manifest(path)
    assert (
        main(["swarm", "revoke", str(path), "--founder", str(founder_key), "--peer", "ab" * 32])
        == 0
    )
    capsys.readouterr()
    cred = SwarmCredentials(first, key(), None)
    server = Transport("127.0.0.1", 0)
    cred.install(server)
    await server.start()
    try:
        code = await asyncio.wait_for(
            asyncio.to_thread(
                main,
                [
                    "swarm",
                    "publish",
                    str(path),
                    "--peer",
                    server.url,
                    "--founder",
                    str(founder_key),
                ],
            ),
            60,
        )
        assert code == 0, capsys.readouterr().err
        assert cred.manifest.version == first.version + 1 and cred.parses == 1
    finally:
        await server.close()


def test_the_size_cap_fits_256_authorities_and_10000_revocations() -> None:
    """The cap (MAX_MANIFEST_BYTES) with headroom over a large real manifest, as tomli_w writes it:
    256 authorities with 64-character lab names, 64 recipe fields, 10,000 revoked keys."""
    founder = key()
    m = SwarmManifest(
        name="s" * 64,
        founder=founder.public_key,
        admission="certified",
        created=time.time(),
        version=1 << 40,
        recipe=tuple(sorted({f"k{i}": "v" * 60 for i in range(64)}.items())),
        authorities=tuple(
            Authority(f"lab{i:03d}".ljust(64, "x"), os.urandom(32)) for i in range(256)
        ),
        revoked=frozenset(os.urandom(32) for _ in range(10_000)),
    ).signed(founder)
    size = len(tomli_w.dumps(m.to_toml_data()).encode())
    assert size * 1.25 < MAX_MANIFEST_BYTES, (
        f"{size} bytes leave no headroom under {MAX_MANIFEST_BYTES}"
    )
    assert SwarmManifest.from_toml(tomli_w.dumps(m.to_toml_data())) == m
