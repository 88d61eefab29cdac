"""Replies have deadlines, on real sockets on 127.0.0.1: a client that asks for a fragment and
never reads is cut off once its reply makes no progress for ``reply_idle_s``, a trickling one
once the reply misses ``reply_deadline_s(size)``, a connection whose reply is stalled makes room
for a newcomer at the connection caps, and streamed replies are counted per address. An honest
reader and a kept-alive connection are untouched.

The flood test runs at the real caps (``ServeLimits()``: 128 connections an address, 512 in
all): four loopback addresses open every connection they may, each asks for a 2 MiB fragment
and never reads (a 4 KiB receive buffer and a 64 KiB send buffer keep the kernel's part small:
autotuned, the server's send buffer took 2.8 MB of a reply to a 4 KiB window), and an honest request
from a fifth address, and one from a flooding address, are still answered within a second.
Before replies had deadlines and stalled ones could be evicted, both were reset at accept."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from node.state.serve import serve_sealed, state_etag
from node.wire.transport import ServeLimits, Transport
from protocol.wire.codec import encode
from protocol.wire.messages import FragmentState
from protocol.wire.signing import Sealed, Signer, seal
from protocol.wire.tensors import EncodedTensor
from tests.node.wire.test_hostile_bodies import MIB, until

pytestmark = pytest.mark.timeout(120)

SIGNER = Signer.from_seed(bytes(32))
SEND_BUFFER = 64 << 10


def fragment(size: int) -> Sealed:
    """A sealed FragmentState of about ``size`` bytes."""
    n = size // 4
    t = EncodedTensor(
        codec="none", shape=(n,), dtype="float32", block_size=0, data=bytes(4 * n), scales=b""
    )
    state = FragmentState(swarm="t", fragment=0, version=1, tensors=(t,), content_hash=bytes(32))
    return seal(encode(state), SIGNER, now=1000.0, nonce=bytes(16))


class Server:
    """A transport serving GET /fragment (``serve_sealed``) and GET /ok; ``served`` counts the
    fragment requests that reached the route."""

    def __init__(self, limits: ServeLimits, sealed: Sealed) -> None:
        self.t = Transport(limits=limits)
        self.sealed, self.served = sealed, 0
        self.t.app.router.add_get("/fragment", self._fragment)
        self.t.app.router.add_get("/ok", self._ok)

    async def _fragment(self, request: web.Request) -> web.StreamResponse:
        self.served += 1
        return await serve_sealed(request, self.t, self.sealed, etag=state_etag(self.sealed, 1))

    @staticmethod
    async def _ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")


@contextlib.asynccontextmanager
async def serving(limits: ServeLimits, size: int = 2 * MIB) -> AsyncIterator[Server]:
    if limits.send_buffer is None:
        limits = dataclasses.replace(limits, send_buffer=SEND_BUFFER)
    server = Server(limits, fragment(size))
    await server.t.start()
    try:
        yield server
    finally:
        await server.t.close()


async def non_reader(
    port: int, source: str = "127.0.0.2", path: str = "/fragment"
) -> socket.socket:
    """A connection from ``source`` with a 4 KiB receive buffer that asks for ``path`` and then
    reads nothing."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((source, 0))
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


async def drained(sock: socket.socket, *, pause_s: float = 0.0, piece: int = 1 << 16) -> int:
    """Read ``sock`` until the server hangs up (a reset counts), ``piece`` bytes at a time with
    ``pause_s`` between reads; the bytes read."""
    loop, got = asyncio.get_running_loop(), 0
    while True:
        try:
            data = await loop.sock_recv(sock, piece)
        except ConnectionError:
            return got
        if not data:
            return got
        got += len(data)
        if pause_s:
            await asyncio.sleep(pause_s)


async def timed_get(url: str, source: str) -> tuple[int, float]:
    """An honest GET /ok from ``source`` on a fresh connection: (status, seconds)."""
    start = time.perf_counter()
    connector = aiohttp.TCPConnector(force_close=True, local_addr=(source, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.get(url + "/ok", timeout=aiohttp.ClientTimeout(total=10)) as resp,
    ):
        assert await resp.text() == "ok"
        return resp.status, time.perf_counter() - start


async def test_a_client_that_never_reads_is_cut_off_at_the_write_idle_deadline() -> None:
    async with serving(ServeLimits(reply_idle_s=1.0)) as server:
        t = server.t
        start = time.perf_counter()
        sock = await non_reader(t.port)
        await until(lambda: t.connections.stalled == 1)
        await until(lambda: t.connections.total == 0, timeout_s=5.0)
        took = time.perf_counter() - start
        assert 0.9 < took < 5.0, took
        assert t.connections.reply_timeouts == 1
        await until(lambda: not t.replies_in_flight)  # the route saw the cut and ended
        assert t.serve_status() == {
            "open": 0,
            "refused": 0,
            "evicted": 0,
            "head_timeouts": 0,
            "handshakes_failed": 0,
            "reply_timeouts": 1,
            "stalled_replies": 0,
            "bodies_in_flight": 0,
            "replies_in_flight": 0,
            "replies_refused": 0,
        }
        got = await drained(sock)  # what the kernel held, then the cut
        assert got < server.sealed.size
        sock.close()


async def test_a_trickling_reader_is_cut_off_at_the_reply_deadline() -> None:
    """64 KiB every 0.1 s keeps the reply moving (no write-idle cut) but it would take ~3 s:
    the reply's whole deadline of 1 s ends it."""
    limits = ServeLimits(reply_timeout_s=1.0, reply_slack_s_per_mib=0.0, reply_idle_s=10.0)
    async with serving(limits) as server:
        t = server.t
        start = time.perf_counter()
        sock = await non_reader(t.port)
        got = await drained(sock, pause_s=0.1)
        took = time.perf_counter() - start
        sock.close()
        assert got < server.sealed.size and 0.9 < took < 5.0, (got, took)
        assert t.connections.reply_timeouts == 1


async def test_an_honest_reader_and_a_kept_alive_connection_are_untouched() -> None:
    limits = ServeLimits(reply_timeout_s=1.0, reply_slack_s_per_mib=0.5, reply_idle_s=2.0)
    async with serving(limits) as server:
        t = server.t
        async with aiohttp.ClientSession() as s:
            async with s.get(t.url + "/fragment") as r:
                assert r.status == 200 and len(await r.read()) == server.sealed.size
            await asyncio.sleep(
                2.5
            )  # past the reply's deadline (2 s): the connection is idle, not cut
            async with s.get(t.url + "/fragment") as r:
                assert r.status == 200 and len(await r.read()) == server.sealed.size
        assert t.connections.reply_timeouts == 0 and t.connections.evicted == 0


async def test_a_stalled_reply_makes_room_for_a_newcomer() -> None:
    """At the per-address cap, a newcomer from the same address takes the place of the
    longest-stalled reply (before: every connection was busy, so the newcomer was reset)."""
    async with serving(ServeLimits(conns_per_ip=4)) as server:
        t = server.t
        socks = [await non_reader(t.port) for _ in range(4)]
        await until(lambda: t.connections.stalled == 4)
        status, took = await timed_get(t.url, "127.0.0.2")
        assert status == 200 and took < 1.0
        assert t.connections.evicted == 1 and t.connections.refused == 0
        assert await drained(socks[0]) < server.sealed.size  # the first one stalled went
        for sock in socks:
            sock.close()


async def test_streamed_replies_are_counted_per_address() -> None:
    async with serving(ServeLimits(replies_per_ip=2)) as server:
        t = server.t
        socks = [await non_reader(t.port) for _ in range(2)]
        await until(lambda: t.replies_in_flight == {"127.0.0.2": 2})
        third = await non_reader(t.port)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(5.0):
            head = await loop.sock_recv(third, 4096)
        assert head.startswith(b"HTTP/1.1 429") and b"at most 2 at once" in head
        assert t.replies_refused == 1
        status, _ = await timed_get(t.url, "127.0.0.3")  # another address: its own count
        assert status == 200
        for sock in (*socks, third):
            sock.close()
        await until(lambda: not t.replies_in_flight)


async def _flood(port: int, sources: list[str], per_source: int) -> list[socket.socket]:
    return [await non_reader(port, src) for src in sources for _ in range(per_source)]


@pytest.mark.parametrize("addresses", [4, 8], ids=["4x128", "8x64"])
async def test_a_slow_reader_flood_at_the_real_caps_leaves_honest_requests_answered(
    addresses: int,
) -> None:
    """``addresses`` loopback addresses open all 512 connections the server allows, each asking
    for a fragment it never reads: with 4 (the issue's 128 each), 64 an address are stalled
    replies and the rest were refused (429) and kept alive; with 8, all 512 are stalled replies.
    Before, every one was busy for ever and both honest requests were reset at accept."""
    limits = (
        ServeLimits()
    )  # the real caps: 128 connections an address, 512 in all, 64 replies an address
    assert (limits.conns_per_ip, limits.conns, limits.replies_per_ip) == (128, 512, 64)
    per_address = limits.conns // addresses
    flooders = [f"127.0.0.{i}" for i in range(2, 2 + addresses)]
    async with serving(limits) as server:
        t = server.t
        socks = await _flood(t.port, flooders, per_address)
        try:
            stalled = addresses * min(per_address, limits.replies_per_ip)
            await until(
                lambda: server.served == limits.conns and t.connections.stalled == stalled,
                timeout_s=30.0,
            )
            assert t.connections.total == limits.conns
            # a newcomer from another address (the server is full) and one from a full address
            for source in ("127.0.0.200", flooders[0]):
                status, took = await timed_get(t.url, source)
                assert status == 200 and took < 1.0, (source, took)
            # the first made room by closing a flooder (the second may find that place free)
            assert t.connections.evicted >= 1 and t.connections.refused == 0
        finally:
            for sock in socks:
                sock.close()
        await until(lambda: t.connections.total == 0, timeout_s=10.0)
