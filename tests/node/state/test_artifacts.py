"""The artifact store, its route and the fetcher, over real loopback HTTP: fetched by hash from
a peer that has it (or one a peer names), in ranges, resumed after a cut, verified; a tampered
byte is refused with one line, in transit and on disk."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from node.run.peer_http import http_fetch
from node.state.artifact_fetch import ArtifactFetcher
from node.state.artifact_serve import ArtifactServer
from node.state.artifacts import ArtifactError, ArtifactStore
from node.wire.transport import Transport

pytestmark = pytest.mark.timeout(30)

PIECE = 1000  # small pieces: a 5,500-byte artifact takes six answers


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    return http_fetch(url, headers=headers, limit=1 << 20, timeout=5)


class Peer:
    """A store served by an ``ArtifactServer`` on 127.0.0.1, naming ``hints`` when it lacks one."""

    def __init__(self, root: Path, hints: list[str] | None = None) -> None:
        self.store = ArtifactStore(root)
        self.t = Transport()
        self.server = ArtifactServer(self.store, self.t, hints=lambda: list(hints or []))
        self.server.install()


@pytest.fixture
async def peers(tmp_path: Path) -> AsyncIterator[tuple[Peer, Peer]]:
    holder = Peer(tmp_path / "holder")
    await holder.t.start()
    pointer = Peer(tmp_path / "pointer", hints=["not a url", holder.t.url])
    await pointer.t.start()
    try:
        yield holder, pointer
    finally:
        await holder.t.close()
        await pointer.t.close()


def test_the_store_writes_by_hash_and_refuses_a_file_changed_on_disk(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "a")
    source = tmp_path / "x.txt"
    source.write_bytes(b"hello artifacts")
    digest = store.put_file(source)
    assert digest == hashlib.sha256(b"hello artifacts").hexdigest()
    assert store.put_bytes(b"hello artifacts") == digest and store.has(digest)
    assert store.open_verified(digest).read_bytes() == b"hello artifacts"
    path = store.path(digest)
    path.write_bytes(b"hello artifactz")  # one byte changed
    with pytest.raises(ArtifactError, match=f"artifact {digest[:16]} .* changed on disk, refused"):
        store.open_verified(digest)
    assert not store.has(digest)  # moved aside: fetched again next time
    with pytest.raises(ArtifactError, match="not an artifact hash"):
        store.path("../../etc/passwd")


async def test_fetched_in_ranges_from_the_peer_a_miss_names_and_verified(
    peers: tuple[Peer, Peer], tmp_path: Path
) -> None:
    holder, pointer = peers
    data = os.urandom(5500)
    digest = holder.store.put_bytes(data)
    mine = ArtifactStore(tmp_path / "mine")
    fetcher = ArtifactFetcher(mine, _get, piece=PIECE)
    # the pointer lacks it and names the holder (its garbage hint is skipped)
    files = await asyncio.to_thread(fetcher.ensure, [digest], [pointer.t.url])
    assert files[digest].read_bytes() == data
    assert fetcher.fetched == {digest: holder.t.url} and fetcher.bytes_received == 5500
    assert holder.server.status() == {"served_bytes": 5500, "misses": 0}
    assert pointer.server.status() == {"served_bytes": 0, "misses": 1}
    assert not mine.partial(digest).exists()


async def test_a_cut_download_resumes_from_the_bytes_it_has(
    peers: tuple[Peer, Peer], tmp_path: Path
) -> None:
    holder, _ = peers
    data = os.urandom(4 * PIECE)  # an exact number of pieces: the end is a 416
    digest = holder.store.put_bytes(data)
    mine = ArtifactStore(tmp_path / "mine")
    mine.partial(digest).write_bytes(data[:2500])  # a download cut off earlier
    fetcher = ArtifactFetcher(mine, _get, piece=PIECE)
    path = await asyncio.to_thread(fetcher.fetch, digest, [holder.t.url])
    assert path.read_bytes() == data and fetcher.bytes_received == 1500


async def test_one_tampered_byte_is_refused_by_hash_and_never_stored(
    peers: tuple[Peer, Peer], tmp_path: Path
) -> None:
    holder, _ = peers
    data = os.urandom(3000)
    digest = hashlib.sha256(data).hexdigest()
    tampered = bytearray(data)
    tampered[1234] ^= 1
    holder.store.root.mkdir(parents=True, exist_ok=True)
    holder.store.path(digest).write_bytes(bytes(tampered))  # a peer serving a changed file
    mine = ArtifactStore(tmp_path / "mine")
    fetcher = ArtifactFetcher(mine, _get, piece=PIECE)
    with pytest.raises(ArtifactError) as info:
        await asyncio.to_thread(fetcher.fetch, digest, [holder.t.url])
    reason = str(info.value)
    assert "\n" not in reason and f"hash to {hashlib.sha256(tampered).hexdigest()[:16]}" in reason
    assert reason.startswith(f"artifact {digest[:16]} could not be fetched: {holder.t.url}: ")
    assert not mine.has(digest) and not mine.partial(digest).exists()


async def test_bad_asks_are_4xx_with_a_reason_never_a_500(peers: tuple[Peer, Peer]) -> None:
    holder, _ = peers
    digest = holder.store.put_bytes(b"x" * 100)
    base = f"{holder.t.url}/v1/artifacts"
    async with aiohttp.ClientSession() as s:
        for path, headers, status in (
            (f"{base}/{'z' * 64}", {}, 400),
            (f"{base}/{digest.upper()}", {}, 400),
            (f"{base}/{digest}", {"Range": "bytes=9" + "9" * 5000 + "-"}, 400),
            (f"{base}/{digest}", {"Range": "bytes=50-10"}, 400),
            (f"{base}/{digest}", {"Range": "bytes=100-"}, 416),
            (f"{base}/{hashlib.sha256(b'none').hexdigest()}", {}, 404),
        ):
            async with s.get(path, headers=headers) as resp:
                assert resp.status == status, (path[-20:], headers, await resp.text())
                assert json.loads(await resp.text())["reason"]
        async with s.get(f"{base}/{digest}", headers={"Range": "bytes=90-"}) as resp:
            assert resp.status == 206 and resp.headers["Content-Range"] == "bytes 90-99/100"
            assert await resp.read() == b"x" * 10
