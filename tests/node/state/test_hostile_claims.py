"""A server's Content-Length is a claim, not a reason to allocate: a download's buffer grows
with the bytes that arrive. A hostile server that claims 512 MiB and sends 10 bytes costs the
client about a chunk, and the download fails with the reason."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from node.state.sync import (
    DownloadFailed,
    FetchConfig,
    FetchStats,
    fetch_sealed,
    serve_sealed,
    state_etag,
)
from node.wire.transport import CHUNK, BufferPool, Transport
from tests.node.state.test_sync import OWNER, make_state
from tests.node.wire.test_hostile_bodies import MIB, rss

pytestmark = pytest.mark.timeout(30)

CLAIM = 512 * MIB
TEN = (200).to_bytes(4, "big") + b"garbag"  # a plausible envelope length, then 6 bytes of it
FAST = FetchConfig(retries=1, backoff_s=0.01, backoff_cap_s=0.02)


class Liar:
    """Answers every GET with a 200 claiming ``CLAIM`` bytes, sends ``TEN``, then hangs up
    (``stall`` False) or goes quiet until the test ends."""

    def __init__(self, *, stall: bool) -> None:
        self.stall, self.done = stall, asyncio.Event()
        self.t = Transport()
        self.t.app.router.add_get("/f", self.lie)

    async def lie(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"ETag": '"v1-liar"'})
        resp.content_length = CLAIM
        await resp.prepare(request)
        await resp.write(TEN)
        if self.stall:
            async with asyncio.timeout(20):
                await self.done.wait()
        request.protocol.force_close()  # the 10 bytes are flushed first
        return resp


@pytest.fixture
async def client() -> AsyncIterator[Transport]:
    t = Transport()
    await t.start()
    yield t
    await t.close()


@pytest.mark.parametrize("stall", [False, True], ids=["hangs-up", "stalls"])
async def test_a_claimed_512_mib_body_of_10_bytes_costs_a_chunk_and_fails_with_the_reason(
    client: Transport, stall: bool
) -> None:
    liar = Liar(stall=stall)
    await liar.t.start()
    stats = FetchStats()
    try:
        gc.collect()
        before = rss()
        tracemalloc.start()
        try:
            with pytest.raises(DownloadFailed) as failed:
                await fetch_sealed(
                    client,
                    f"{liar.t.url}/f",
                    max_size=1 << 30,
                    expected_signer=OWNER.peer_id,
                    chunk_timeout_s=0.5,
                    config=FAST,
                    stats=stats,
                )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        grew = rss() - before
    finally:
        liar.done.set()
        await liar.t.close()
    reason = failed.value.reason
    print(
        f"{'stalling' if stall else 'hanging-up'} liar: peak traced {peak / MIB:.2f} MiB, "
        f"RSS +{grew / MIB:.1f} MiB; {reason}"
    )
    assert "gave up after 2 failed attempts" in reason
    assert (
        "received 10 of 536870912 bytes" in reason
        if not stall
        else "nothing arrived for 0.5 s (at 10/536870912 bytes)" in reason
    )
    assert stats.statuses == [200, 200] and stats.bytes_received == 20
    assert peak < 8 * MIB and grew < 16 * MIB
    partial = failed.value.partial
    assert partial is not None and partial.total == CLAIM and len(partial.buffer) <= CHUNK
    client.pool.give(partial.buffer)


class _Sizes(BufferPool):
    """A pool that notes the size of every buffer it hands out."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def take(self, size: int, *, fresh: int | None = None) -> bytearray:
        buf = super().take(size, fresh=fresh)
        self.sizes.append(len(buf))
        return buf


async def test_an_honest_body_is_taken_at_its_signed_size_or_grown_by_doubling(
    client: Transport,
) -> None:
    sealed, _ = make_state(3 << 20)  # 12 MiB of fp32
    total = len(sealed.tobytes())
    server = Transport()

    async def serve(request: web.Request) -> web.StreamResponse:
        return await serve_sealed(request, server, sealed, etag=state_etag(sealed, 1))

    server.app.router.add_get("/f", serve)
    await server.start()
    try:
        for signer, expect in (
            (OWNER.peer_id, [CHUNK, total]),  # the owner signed the size: one step
            (None, [CHUNK, 2 * CHUNK, 4 * CHUNK, 8 * CHUNK, total]),
        ):  # any signer: doubling
            client.pool = pool = _Sizes()
            opened = await fetch_sealed(
                client, f"{server.url}/f", max_size=64 * MIB, expected_signer=signer, config=FAST
            )
            assert opened.peer_id == OWNER.peer_id and pool.sizes == expect
    finally:
        await server.close()
