"""Transport: link profiles, size caps, streamed bodies into pooled buffers, over real HTTP."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from node.wire.bodies import CHUNK, MIN_BUFFER
from node.wire.transport import BufferPool, LinkDropped, LinkEmulator, LinkProfile, Transport
from protocol.errors import Oversize

pytestmark = pytest.mark.timeout(30)


def test_link_profile_parses_units_and_refuses_nonsense() -> None:
    p = LinkProfile.parse("latency=50ms, bandwidth=10mbit, drop=0.01")
    assert p == LinkProfile(0.05, 10e6, 0.01) and p.active
    assert LinkProfile.parse("") == LinkProfile() and not LinkProfile().active
    for bad in ("latency=fast", "jitter=1ms", "drop=2", "bandwidth"):
        with pytest.raises(ValueError):
            LinkProfile.parse(bad)


def test_buffer_pool_reuses_buffers() -> None:
    pool = BufferPool()
    a = pool.take(10)
    pool.give(a)
    assert pool.take(5) is a


def test_a_small_body_takes_a_small_buffer_and_a_large_claim_at_most_a_chunk() -> None:
    pool = BufferPool()
    assert len(pool.take(10)) == MIN_BUFFER == 64 << 10
    assert len(pool.take(200_000)) == 200_000  # its length, as declared
    assert len(pool.take(200_000, fresh=CHUNK)) == 200_000
    assert len(pool.take(512 << 20, fresh=CHUNK)) == CHUNK  # a claim: grown as bytes arrive
    # a burst of 24 small bodies leaves the pool holding 24 small buffers, not 24 MiB
    bufs = [pool.take(20_000, fresh=CHUNK) for _ in range(24)]
    for b in bufs:
        pool.give(b)
    assert pool.held == 24 * MIN_BUFFER


def test_buffer_pool_keeps_its_largest_buffers_and_grows_from_its_largest() -> None:
    mib = 1 << 20
    pool = BufferPool(max_buffers=2, max_buffer=64 * mib, max_bytes=45 * mib)
    small, mid, big, other = (
        bytearray(mib),
        bytearray(8 * mib),
        bytearray(25 * mib),
        bytearray(16 * mib),
    )
    for buf in (small, mid, big):
        pool.give(buf)  # three buffers, two places: the smallest goes
    assert pool.held == 33 * mib
    pool.give(other)  # again three: the 8 MiB one goes
    assert pool.held == 41 * mib
    pool.give(bytearray(65 * mib))  # above max_buffer: not kept
    assert pool.held == 41 * mib
    assert pool.take(20 * mib) is big  # the smallest that fits
    # none fits 30 MiB: a caller that grows the buffer gets the largest (16 MiB), not a fresh 1 MiB
    assert pool.take(30 * mib, fresh=mib) is other and pool.held == 0
    assert len(pool.take(30 * mib, fresh=mib)) == mib  # empty: a fresh CHUNK


async def test_a_chunked_body_is_read_whole_across_its_chunk_boundaries() -> None:
    server = await _echo_server(max_body=8 << 20)
    try:
        payload = random.Random(2).randbytes(3_000_000)

        async def pieces() -> AsyncIterator[bytes]:  # no Content-Length: chunked transfer encoding
            for i in range(0, len(payload), 100_000):
                yield payload[i : i + 100_000]

        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{server.url}/echo", data=pieces()) as resp,
        ):
            assert resp.status == 200 and await resp.read() == payload
        assert server.bytes_received == len(payload)
    finally:
        await server.close()


async def _echo_server(max_body: int) -> Transport:
    t = Transport(max_body=max_body)

    async def echo(request: web.Request) -> web.StreamResponse:
        try:
            buf, used = await t.read_request(request)
        except Oversize as exc:
            return web.Response(status=413, text=exc.reason)
        try:
            return await t.stream_reply(request, [bytes(memoryview(buf)[:used])], used)
        finally:
            t.pool.give(buf)

    t.app.router.add_post("/echo", echo)
    await t.start()
    return t


async def test_streamed_round_trip_and_caps() -> None:
    server = await _echo_server(max_body=3 << 20)
    client = Transport()
    await client.start()
    try:
        assert server.port != 0 and server.url.endswith(str(server.port))
        payload = random.Random(1).randbytes(2_500_000)
        chunks = [memoryview(payload)[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
        status, buf, used, _ = await client.request(
            "POST", f"{server.url}/echo", chunks=chunks, size=len(payload)
        )
        assert status == 200 and bytes(memoryview(buf)[:used]) == payload
        client.pool.give(buf)
        assert server.bytes_received == len(payload)
        # what went on the wire: the body and the request's head (its line, Host, Content-Length)
        assert len(payload) + 50 < client.bytes_sent < len(payload) + 1024, client.bytes_sent
        # the server sent the echoed body and a reply head (status line, Content-Length)
        assert len(payload) + 30 < server.bytes_sent < len(payload) + 1024, server.bytes_sent
        big = b"x" * (4 << 20)
        status, buf, used, _ = await client.request(
            "POST", f"{server.url}/echo", chunks=[big], size=len(big)
        )
        assert status == 413
        with pytest.raises(Oversize):
            await client.request(
                "POST", f"{server.url}/echo", chunks=[payload], size=len(payload), max_reply=1000
            )
    finally:
        await client.close()
        await server.close()


async def test_a_reply_gives_its_buffer_back_on_exit_even_when_the_block_raises() -> None:
    server = await _echo_server(max_body=3 << 20)
    client = Transport()
    await client.start()
    try:
        payload = random.Random(2).randbytes(300_000)
        async with client.reply(
            "POST", f"{server.url}/echo", chunks=[payload], size=len(payload)
        ) as r:
            assert r.status == 200 and bytes(r.body) == payload
            assert client.pool.held == 0  # the buffer is out with the reply
        held = client.pool.held
        assert held >= len(payload)  # back in the pool
        with pytest.raises(RuntimeError, match="caller failed"):
            async with client.reply(
                "POST", f"{server.url}/echo", chunks=[payload], size=len(payload)
            ) as r:
                raise RuntimeError("caller failed")
        assert client.pool.held == held  # taken again and given back again
    finally:
        await client.close()
        await server.close()


async def test_link_emulator_drops_and_delays() -> None:
    server = await _echo_server(max_body=1 << 20)
    client = Transport(link=LinkEmulator(default=LinkProfile(drop_rate=1.0)))
    await client.start()
    try:
        with pytest.raises(LinkDropped):
            await client.request("POST", f"{server.url}/echo", chunks=[b"hi"], size=2)
        client.link.per_peer[server.url] = LinkProfile(latency_s=0.05, bandwidth_bps=8e5)
        status, buf, used, _ = await client.request(
            "POST", f"{server.url}/echo", chunks=[b"y" * 10_000], size=10_000
        )
        assert status == 200 and used == 10_000
    finally:
        await client.close()
        await server.close()


async def test_bodiless_replies_are_read_again_and_again() -> None:
    """aiohttp hands every bodiless reply (a 204, a long-poll with nothing new) the same shared
    empty stream, which says "end of a chunk" for ever once read: each is still read as empty
    at once (a learner's poll loop once spun on the second one, and its node stopped answering)."""
    t = Transport()

    async def nothing(_request: web.Request) -> web.StreamResponse:
        return web.Response(status=204)

    t.app.router.add_get("/nothing", nothing)
    await t.start()
    try:
        for _ in range(3):
            async with asyncio.timeout(10):
                status, buf, used, _ = await t.request("GET", f"{t.url}/nothing", timeout_s=5)
            assert (status, used) == (204, 0)
            t.pool.give(buf)
    finally:
        await t.close()


async def test_a_cookie_a_peer_sets_is_never_sent_back() -> None:
    """Peers use no cookies: the client keeps none (no jar to filter on every request), so a
    cookie one peer sets does not follow the node to that peer or any other."""
    t = Transport()
    seen: list[str | None] = []

    async def set_cookie(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Cookie"))
        resp = web.Response(status=204)
        resp.set_cookie("track", "me")
        return resp

    t.app.router.add_get("/c", set_cookie)
    await t.start()
    try:
        for _ in range(2):
            async with asyncio.timeout(10):
                _, buf, _, _ = await t.request("GET", f"http://localhost:{t.port}/c", timeout_s=5)
            t.pool.give(buf)
    finally:
        await t.close()
    assert seen == [None, None]


async def test_bytes_by_route_names_every_byte_sent() -> None:
    server = Transport()

    async def tagged(request: web.Request) -> web.StreamResponse:
        await request.read()
        server.name_kind(
            request, "Contribution"
        )  # as a sealed-RPC handler does once it has opened the body
        return web.Response(body=b"y" * 500)

    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return await server.stream_reply(request, [body], len(body))

    server.app.router.add_post("/v1/fragments/{p}/rpc", tagged)
    server.app.router.add_post("/echo", echo)
    await server.start()
    client = Transport()
    await client.start()
    try:
        for p in (0, 7):  # fragment numbers fold into one route
            status, buf, _, _ = await client.request(
                "POST",
                f"{server.url}/v1/fragments/{p}/rpc",
                chunks=[b"x" * 1000],
                size=1000,
                kind="Contribution",
            )
            assert status == 200
            client.pool.give(buf)
        status, buf, _, _ = await client.request(
            "POST", f"{server.url}/echo", chunks=[b"z" * 300], size=300
        )
        client.pool.give(buf)
        assert set(client.bytes_by_route) == {"/v1/fragments/*/rpc:Contribution", "/echo"}
        assert 2000 < client.bytes_by_route["/v1/fragments/*/rpc:Contribution"] < 2000 + 1024
        assert set(server.bytes_by_route) == {
            "reply /v1/fragments/*/rpc:Contribution",
            "reply /echo",
        }
        assert 1000 < server.bytes_by_route["reply /v1/fragments/*/rpc:Contribution"] < 1000 + 1024
        assert 300 < server.bytes_by_route["reply /echo"] < 300 + 512
        for t in (client, server):  # the routes add up to bytes_sent, nothing left out
            assert sum(t.bytes_by_route.values()) == t.bytes_sent
        # one message a request and a reply: two Contributions and an echo each way
        assert client.messages_by_route == {"/v1/fragments/*/rpc:Contribution": 2, "/echo": 1}
        assert server.messages_by_route == {
            "reply /v1/fragments/*/rpc:Contribution": 2,
            "reply /echo": 1,
        }
    finally:
        await client.close()
        await server.close()


async def test_a_taken_reply_buffer_stays_the_callers_and_settle_outlives_a_cancel() -> None:
    server = await _echo_server(max_body=3 << 20)
    client = Transport()
    await client.start()
    try:
        payload = random.Random(3).randbytes(200_000)
        async with client.reply(
            "POST", f"{server.url}/echo", chunks=[payload], size=len(payload)
        ) as r:
            buf, used = r.take()
            with pytest.raises(RuntimeError, match="taken already"):
                r.take()
        assert client.pool.held == 0 and bytes(buf[:used]) == payload  # not given back
        events: list[str] = []
        reading = asyncio.Event()

        async def read_in_a_thread() -> None:
            reading.set()
            await asyncio.to_thread(time.sleep, 0.2)
            events.append("read")

        async def fetch() -> None:
            async with client.reply(
                "POST", f"{server.url}/echo", chunks=[payload], size=len(payload)
            ) as r:
                await r.settle(read_in_a_thread())
            events.append("not reached")

        task = asyncio.create_task(fetch())
        await reading.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert events == ["read"]  # the reader finished before the buffer went back
        assert client.pool.held >= len(payload)
    finally:
        await client.close()
        await server.close()
