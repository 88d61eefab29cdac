"""State sync over real HTTP on 127.0.0.1: ranges, resume, version change, corruption, signer."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable

import pytest
import torch
from aiohttp import web
from multidict import CIMultiDict

from node.diloco.flat import content_hash, flat_from_tensors
from node.state.sync import (
    DownloadFailed,
    FetchConfig,
    FetchStats,
    Manifest,
    ManifestCache,
    PartialDownload,
    RangeNotSatisfiable,
    SyncFailed,
    chunk_manifest,
    encode_manifest,
    etag_version,
    fetch_sealed,
    parse_range,
    serve_manifest,
    serve_sealed,
    state_etag,
    sync_fragments,
)
from node.wire.transport import LinkEmulator, Transport
from protocol.diloco.compression import compress
from protocol.errors import DecodeError, NotAuthorized
from protocol.wire.codec import Encoded, encode
from protocol.wire.messages import FragmentState
from protocol.wire.signing import Sealed, Signer, seal

OWNER = Signer.from_seed(b"o" * 32)
OTHER = Signer.from_seed(b"p" * 32)
MALLORY = Signer.from_seed(b"m" * 32)
SWARM = "sync-test"
MAX = 64 << 20
PIECE = 256 << 10  # manifest chunk size in these tests
FAST = FetchConfig(retries=2, backoff_s=0.01, backoff_cap_s=0.05)
N = 1 << 20  # elements in most test states: 4 MiB of fp32


def make_state(
    numel: int = N, version: int = 1, *, fragment: int = 0, signer: Signer = OWNER
) -> tuple[Sealed, torch.Tensor]:
    theta = torch.randn(numel, generator=torch.Generator().manual_seed(version * 100 + fragment))
    enc, _ = compress(theta, "none")
    state = FragmentState(
        swarm=SWARM,
        fragment=fragment,
        version=version,
        tensors=(enc,),
        content_hash=content_hash([enc]),
    )
    return seal(
        encode(state), signer, now=1000.0 + version, nonce=version.to_bytes(16, "big")
    ), theta


def flipped(sealed: Sealed, at: int) -> Sealed:
    """The same sealed state with the byte at wire offset ``at`` (inside the body) flipped."""
    head = 4 + len(sealed.envelope)
    body = bytearray(sealed.message.tobytes())
    body[at - head] ^= 0xFF
    return Sealed(
        envelope=sealed.envelope, message=Encoded(parts=[memoryview(body)], size=len(body))
    )


class CutLink(LinkEmulator):
    """Server-side fault: the response in flight dies (or stalls) once ``at`` bytes are out."""

    def __init__(self, at: int, *, stall: bool = False) -> None:
        super().__init__()
        self.at, self.stall, self.armed, self.sent = at, stall, True, 0
        self.unstall = asyncio.Event()

    async def throttle(self, url: str, nbytes: int) -> None:
        self.sent += nbytes
        if self.armed and self.sent > self.at:
            self.armed = False
            if not self.stall:
                raise ConnectionResetError("test: connection cut")
            await self.unstall.wait()


class Server:
    """One peer serving ``/v1/fragments/{p}/latest`` (+ ``/manifest``) through state_sync."""

    def __init__(self, *, link: LinkEmulator | None = None, manifests: bool = True) -> None:
        self.t = Transport(link=link)
        self.states: dict[int, tuple[int, Sealed]] = {}
        self.hook: Callable[[int], Sealed | None] = lambda i: (
            None
        )  # request no. -> bytes to serve instead
        self.headers: list[dict[str, str]] = []
        self.cache = ManifestCache(chunk_size=PIECE)
        self.lying_manifest: bytes | None = None
        self.t.app.router.add_get("/v1/fragments/{p}/latest", self.latest)
        if manifests:
            self.t.app.router.add_get("/v1/fragments/{p}/latest/manifest", self.manifest)

    def put(self, p: int, version: int, sealed: Sealed) -> None:
        self.states[p] = (version, sealed)

    def url(self, p: int = 0) -> str:
        return f"{self.t.url}/v1/fragments/{p}/latest"

    async def latest(self, request: web.Request) -> web.StreamResponse:
        version, sealed = self.states[int(request.match_info["p"])]
        self.headers.append(dict(request.headers))
        served = self.hook(len(self.headers) - 1) or sealed
        return await serve_sealed(request, self.t, served, etag=state_etag(sealed, version))

    async def manifest(self, request: web.Request) -> web.Response:
        version, sealed = self.states[int(request.match_info["p"])]
        if self.lying_manifest is not None:
            return web.Response(body=self.lying_manifest)
        return await serve_manifest(
            request, sealed, etag=state_etag(sealed, version), cache=self.cache
        )


class Net:
    """The client transport and the servers started for one test."""

    def __init__(self) -> None:
        self.client = Transport()
        self.servers: list[Server] = []

    async def serve(self, **kw: object) -> Server:
        s = Server(**kw)  # type: ignore[arg-type]
        await s.t.start()
        self.servers.append(s)
        return s

    async def close(self) -> None:
        for s in self.servers:
            if isinstance(s.t.link, CutLink):
                s.t.link.unstall.set()
            await s.t.close()
        await self.client.close()


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    await n.client.start()
    yield n
    await n.close()


async def fetch(net: Net, url: str, stats: FetchStats, **kw: object) -> FragmentState:
    kw.setdefault("expected_signer", OWNER.peer_id)
    kw.setdefault("config", FAST)
    opened = await fetch_sealed(net.client, url, max_size=MAX, stats=stats, **kw)  # type: ignore[arg-type]
    assert isinstance(opened.message, FragmentState)
    return opened.message


def decoded(state: FragmentState) -> torch.Tensor:
    return flat_from_tensors(state.tensors, [tuple(t.shape) for t in state.tensors])


# ── pure pieces ──────────────────────────────────────────────────────────────────────────────
@pytest.mark.timeout(5)
def test_parse_range() -> None:
    assert parse_range("bytes=10-", 100) == (10, 100)
    assert parse_range("bytes=10-19", 100) == (10, 20)
    assert parse_range("bytes=90-500", 100) == (90, 100)
    assert parse_range("bytes=-30", 100) == (70, 100)
    for ignored in ("bytes=0-1,5-6", "items=1-2", "bytes=-", "bytes=9-3", "nonsense"):
        assert parse_range(ignored, 100) is None, ignored
    for bad in ("bytes=100-", "bytes=-0"):
        with pytest.raises(RangeNotSatisfiable):
            parse_range(bad, 100)


@pytest.mark.timeout(5)
def test_manifest_round_trip_and_caps() -> None:
    sealed, _ = make_state(100_000)
    wire = sealed.tobytes()
    hashes = chunk_manifest(sealed, PIECE // 4)
    assert hashes == [
        hashlib.sha256(wire[i : i + PIECE // 4]).digest() for i in range(0, len(wire), PIECE // 4)
    ]
    etag = state_etag(sealed, 1)
    assert etag_version(etag) == 1 and etag_version("W/x") is None
    raw = encode_manifest(hashes, etag=etag, size=sealed.size, chunk_size=PIECE // 4)
    m = Manifest.parse(raw, max_total=MAX)
    assert all(m.ok(k, memoryview(wire)[slice(*m.span(k))]) for k in range(len(hashes)))
    with pytest.raises(DecodeError, match="hashes for"):
        Manifest.parse(
            encode_manifest(hashes[:-1], etag=etag, size=sealed.size, chunk_size=PIECE // 4),
            max_total=MAX,
        )
    for garbage in (
        b"",
        b"\x91\x01",
        raw[:-3],
        encode_manifest(hashes, etag=etag, size=sealed.size, chunk_size=1024),
    ):
        with pytest.raises(DecodeError):
            Manifest.parse(garbage, max_total=MAX)


# ── serving ──────────────────────────────────────────────────────────────────────────────────
@pytest.mark.timeout(10)
async def test_serve_sealed_ranges_and_if_range(net: Net) -> None:
    s = await net.serve()
    sealed, _ = make_state(50_000)
    s.put(0, 1, sealed)
    wire, etag, session = sealed.tobytes(), state_etag(sealed, 1), net.client.session

    async def get(**headers: str) -> tuple[int, bytes, CIMultiDict[str]]:
        async with session.get(s.url(), headers=headers) as r:
            return r.status, await r.read(), r.headers.copy()

    status, body, h = await get()
    assert (status, body, h["ETag"], h["Accept-Ranges"]) == (200, wire, f'"{etag}"', "bytes")
    status, body, h = await get(Range="bytes=10-19")
    assert (status, body, h["Content-Range"]) == (206, wire[10:20], f"bytes 10-19/{len(wire)}")
    status, body, h = await get(Range="bytes=1000-", **{"If-Range": f'"{etag}"'})
    assert (status, body) == (206, wire[1000:])
    status, body, _ = await get(Range="bytes=1000-", **{"If-Range": '"v0-deadbeef"'})
    assert (status, body) == (200, wire)  # another version: the whole body, never a splice
    status, _, h = await get(Range=f"bytes={len(wire)}-")
    assert (status, h["Content-Range"]) == (416, f"bytes */{len(wire)}")
    async with session.head(s.url()) as r:
        assert (r.status, r.content_length, await r.read()) == (200, len(wire), b"")


# ── fetching ─────────────────────────────────────────────────────────────────────────────────
@pytest.mark.timeout(10)
async def test_full_download_verifies_and_decodes(net: Net) -> None:
    s = await net.serve()
    sealed, theta = make_state(3_000_000)
    s.put(0, 1, sealed)
    stats = FetchStats()
    state = await fetch(net, s.url(), stats)
    assert (state.version, stats.statuses, stats.bytes_received) == (1, [200], sealed.size)
    assert torch.equal(decoded(state), theta)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stall", [False, True], ids=["cut", "stall"])
async def test_interrupted_download_resumes_with_range(net: Net, stall: bool) -> None:
    s = await net.serve(link=CutLink(1_500_000, stall=stall))
    sealed, theta = make_state()
    s.put(0, 1, sealed)
    stats = FetchStats()
    state = await fetch(net, s.url(), stats, chunk_timeout_s=0.5 if stall else 30.0)
    assert stats.statuses[0] == 200 and set(stats.statuses[1:]) == {206}, stats.reasons
    have = int(stats.ranges[1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < have <= 1_500_000
    assert s.headers[1]["If-Range"] == f'"{state_etag(sealed, 1)}"'
    assert stats.bytes_received == sealed.size  # nothing fetched twice
    assert torch.equal(decoded(state), theta)


@pytest.mark.timeout(10)
async def test_resume_after_version_change_restarts_from_zero(net: Net) -> None:
    s = await net.serve(link=CutLink(1_500_000))
    v1, _ = make_state(version=1)
    v2, theta2 = make_state(version=2)
    s.put(0, 1, v1)

    def bump(i: int) -> None:  # the owner publishes v2 while the first response is in flight
        if i == 0:
            s.put(0, 2, v2)

    s.hook = bump  # type: ignore[assignment]
    stats = FetchStats()
    state = await fetch(net, s.url(), stats)
    assert stats.statuses == [200, 200] and stats.version_changes == 1, stats.reasons
    assert s.headers[1]["If-Range"] == f'"{state_etag(v1, 1)}"'
    assert state.version == 2 and torch.equal(decoded(state), theta2)


@pytest.mark.timeout(10)
async def test_resume_partial_from_another_replica(net: Net) -> None:
    flaky = await net.serve(link=CutLink(1_500_000))
    replica = await net.serve()
    sealed, theta = make_state()
    flaky.put(0, 1, sealed)
    replica.put(0, 1, sealed)
    with pytest.raises(DownloadFailed, match="gave up") as info:
        await fetch(net, flaky.url(), FetchStats(), config=FetchConfig(retries=0))
    partial = info.value.partial
    assert isinstance(partial, PartialDownload) and 0 < partial.have < sealed.size
    stats = FetchStats()
    state = await fetch(net, replica.url(), stats, resume=partial)
    assert stats.statuses == [206] and stats.bytes_received == sealed.size - partial.have
    assert torch.equal(decoded(state), theta)


@pytest.mark.timeout(10)
async def test_corrupt_chunk_with_manifest_refetches_only_that_range(net: Net) -> None:
    s = await net.serve()
    sealed, theta = make_state()
    s.put(0, 1, sealed)
    at = 9 * PIECE + 1234
    bad = flipped(sealed, at)
    s.hook = lambda i: bad if i == 0 else None
    stats = FetchStats()
    state = await fetch(net, s.url(), stats, manifest_url=s.url() + "/manifest")
    assert stats.manifest_used and stats.refetched_chunks == 1 and stats.restarts == 0, (
        stats.reasons
    )
    assert stats.statuses == [200, 206] and stats.ranges[1] == f"bytes={9 * PIECE}-"
    assert stats.bytes_received <= sealed.size + PIECE + (1 << 20)
    assert torch.equal(decoded(state), theta)


@pytest.mark.timeout(10)
async def test_corrupt_body_without_manifest_restarts_once(net: Net) -> None:
    s = await net.serve()
    sealed, theta = make_state()
    s.put(0, 1, sealed)
    bad = flipped(sealed, sealed.size - 10)
    s.hook = lambda i: bad if i == 0 else None
    stats = FetchStats()
    state = await fetch(net, s.url(), stats)
    assert stats.statuses == [200, 200] and stats.restarts == 1
    assert "content hash mismatch" in stats.reasons[0]
    assert torch.equal(decoded(state), theta)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("manifest", [False, True], ids=["plain", "manifest"])
async def test_persistent_corruption_is_refused(net: Net, manifest: bool) -> None:
    s = await net.serve()
    sealed, _ = make_state()
    s.put(0, 1, sealed)
    bad = flipped(sealed, 5 * PIECE + 7)
    s.hook = lambda i: bad
    stats = FetchStats()
    url = s.url() + "/manifest" if manifest else None
    with pytest.raises(
        DownloadFailed, match="content hash mismatch; refused after 2 downloads"
    ) as info:
        await fetch(net, s.url(), stats, manifest_url=url)
    assert info.value.partial is None
    assert stats.refetched_chunks == (2 if manifest else 0), stats.reasons


@pytest.mark.timeout(10)
async def test_lying_manifest_is_dropped_and_the_owner_hash_decides(net: Net) -> None:
    s = await net.serve()
    sealed, theta = make_state()
    s.put(0, 1, sealed)
    lie = chunk_manifest(flipped(sealed, 3 * PIECE), PIECE)
    s.lying_manifest = encode_manifest(
        lie, etag=state_etag(sealed, 1), size=sealed.size, chunk_size=PIECE
    )
    stats = FetchStats()
    state = await fetch(net, s.url(), stats, manifest_url=s.url() + "/manifest")
    assert stats.refetched_chunks == 2 and "manifest dropped" in stats.reasons[-1]
    assert torch.equal(decoded(state), theta)


@pytest.mark.timeout(10)
async def test_wrong_signer_is_refused_early(net: Net) -> None:
    s = await net.serve()
    sealed, _ = make_state(signer=MALLORY)
    s.put(0, 1, sealed)
    stats = FetchStats()
    with pytest.raises(NotAuthorized, match="signed by .* not the expected owner"):
        await fetch(net, s.url(), stats)
    assert stats.bytes_received < sealed.size


# ── sync ─────────────────────────────────────────────────────────────────────────────────────
@pytest.mark.timeout(10)
async def test_sync_fragments_from_two_owners(net: Net) -> None:
    a, b = await net.serve(), await net.serve(manifests=False)  # b: no manifest route (404)
    owners = {0: (OWNER, a), 1: (OTHER, b), 2: (OWNER, a)}
    thetas = {}
    for p, (signer, server) in owners.items():
        sealed, thetas[p] = make_state(50_000 * (p + 1), version=p + 3, fragment=p, signer=signer)
        server.put(p, p + 3, sealed)
    shapes = [[(50_000 * (p + 1),)] for p in range(3)]

    def owner_of(p: int) -> tuple[bytes, str]:
        signer, server = owners[p]
        return signer.peer_id, server.t.url

    stats: dict[int, FetchStats] = {}
    got = await sync_fragments(
        net.client,
        owner_of,
        3,
        shapes,
        swarm=SWARM,
        held_versions=[-1, -1, -1],
        max_size=MAX,
        config=FAST,
        stats=stats,
    )
    assert {p: v for p, (v, _) in got.items()} == {0: 3, 1: 4, 2: 5}
    assert all(torch.equal(flat, thetas[p]) for p, (_, flat) in got.items())
    assert stats[0].manifest_used and not stats[1].manifest_used

    requests = len(a.headers)
    got = await sync_fragments(
        net.client,
        owner_of,
        3,
        shapes,
        swarm=SWARM,
        held_versions=[3, -1, 5],
        max_size=MAX,
        config=FAST,
        stats=stats,
    )
    assert list(got) == [1] and got[1][0] == 4
    assert len(a.headers) == requests  # up to date: the manifest said so, no body requested
    assert "not newer" in stats[0].reasons[-1]

    requests = len(b.headers)
    got = await sync_fragments(
        net.client,
        owner_of,
        3,
        shapes,
        swarm=SWARM,
        held_versions=[3, 4, 5],
        max_size=MAX,
        config=FAST,
        stats=stats,
    )
    assert got == {} and len(b.headers) == requests + 1  # no manifest: the body's ETag said so
    assert stats[1].statuses == [200] and stats[1].bytes_received < 50_000 * 8
    assert "version 4 is not newer than the 4 held" in stats[1].reasons[-1]


@pytest.mark.timeout(10)
async def test_sync_failure_keeps_what_synced(net: Net) -> None:
    a = await net.serve()
    sealed, theta = make_state(1000, version=2)
    a.put(0, 2, sealed)
    a.put(1, 2, sealed)  # fragment 1's route serves fragment 0's state
    shapes = [[(1000,)], [(1000,)], [(1000,)]]
    owner_of = {0: (OWNER.peer_id, a.t.url), 1: (OWNER.peer_id, a.t.url)}.get
    with pytest.raises(SyncFailed) as info:
        await sync_fragments(
            net.client,
            owner_of,
            3,
            shapes,
            swarm=SWARM,
            held_versions=[-1, -1, -1],
            max_size=MAX,
            config=FAST,
        )
    err = info.value
    assert set(err.failures) == {1, 2} and "not FragmentState sync-test/1" in err.failures[1]
    assert err.failures[2] == "no owner known" and "2/3 fragments failed" in err.reason
    assert list(err.fetched) == [0] and torch.equal(err.fetched[0][1], theta)
