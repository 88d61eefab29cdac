"""Idle sockets and trickled heads cost the server little: connections are counted per address
at accept (before TLS or HTTP); beyond the cap the oldest one without a request in progress is
closed to make room, and a newcomer is reset only when all are busy; a request head that does
not arrive in time gets a 408 and a closed connection; honest requests keep their answers
meanwhile. Plain HTTP and TLS alike, on real sockets on 127.0.0.1 (a flood comes from
127.0.0.2 or 127.0.0.3, so the honest client at 127.0.0.1 has an address of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import ssl

import aiohttp
import pytest
from aiohttp import web

from node.wire.tls import client_context, server_context
from node.wire.transport import ServeLimits, Transport, address_key
from protocol.wire.signing import Signer
from tests.node.wire.test_hostile_bodies import MIB, rss, until

pytestmark = pytest.mark.timeout(60)

FLOOD = "127.0.0.2"


async def _ok(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


class Hold:
    """GET /hold: answered once ``release`` is set; ``holding`` counts the requests waiting."""

    def __init__(self) -> None:
        self.release, self.holding = asyncio.Event(), 0

    async def handle(self, _request: web.Request) -> web.Response:
        self.holding += 1
        await self.release.wait()
        return web.Response(text="held")


async def serve(limits: ServeLimits, tls: bool, hold: Hold | None = None) -> Transport:
    t = Transport(
        limits=limits, tls=server_context(Signer.from_seed(os.urandom(32))) if tls else None
    )
    t.app.router.add_get("/ok", _ok)
    t.app.router.add_get("/hold", (hold or Hold()).handle)

    async def echo(request: web.Request) -> web.Response:
        buf, used = await t.read_request(request)
        try:
            return web.Response(body=bytes(memoryview(buf)[:used]))
        finally:
            t.pool.give(buf)

    t.app.router.add_post("/echo", echo)
    await t.start()
    return t


async def idle(port: int, source: str = FLOOD) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw TCP connection from ``source`` that sends nothing (not even a TLS hello)."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed(reader: asyncio.StreamReader) -> bytes:
    """What arrives until the server hangs up (a reset counts as a hang-up)."""
    try:
        return await reader.read()
    except ConnectionError:
        return b""


async def timed_get(t: Transport) -> tuple[int, float]:
    """An honest GET /ok from 127.0.0.1 on a fresh connection: (status, seconds)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    connector = aiohttp.TCPConnector(ssl=client_context() if t.tls else False, force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"{t.url}/ok", timeout=aiohttp.ClientTimeout(total=5)) as resp,
    ):
        assert await resp.text() == "ok"
        return resp.status, loop.time() - start


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_a_flood_of_idle_sockets_holds_only_the_cap_and_honest_requests_are_answered(
    tls: bool,
) -> None:
    limits = ServeLimits(
        head_timeout_s=3.0, conns_per_ip=32
    )  # a public node's setting; 128 by default
    t = await serve(limits, tls)
    loop = asyncio.get_running_loop()
    try:
        await timed_get(t)  # first use of TLS and of a client session: not the flood's cost
        await until(lambda: t.connections.total == 0)
        gc.collect()
        before = rss()
        start = loop.time()
        hung_up: list[float] = []

        async def watch(reader: asyncio.StreamReader) -> bytes:
            reply = await closed(reader)
            hung_up.append(loop.time() - start)
            return reply

        conns = [await idle(t.port) for _ in range(200)]
        waits = [asyncio.create_task(watch(r)) for r, _ in conns]
        await until(lambda: t.connections.evicted == 200 - limits.conns_per_ip)
        done, held = await asyncio.wait(waits, timeout=1.0)
        closed_within = max(hung_up)
        assert len(held) == limits.conns_per_ip and len(done) == 200 - limits.conns_per_ip
        assert (
            t.connections.open == {FLOOD: limits.conns_per_ip}
            and t.connections.total == limits.conns_per_ip
        )
        assert t.connections.refused == 0  # each newcomer took the place of the oldest idle one
        status, latency = await timed_get(t)
        peak = rss()
        assert status == 200 and latency < 1.0
        # the held ones are closed by the head deadline (a TLS handshake that never starts included)
        async with asyncio.timeout(limits.head_timeout_s + 2.0):
            replies = await asyncio.gather(*held)
        closed_after = loop.time() - start
        if not tls:
            assert all(r.startswith(b"HTTP/1.1 408") and b"HeadTimeout" in r for r in replies)
        await until(lambda: t.connections.total == 0)
        assert t.connections.head_timeouts == (0 if tls else limits.conns_per_ip)
        assert t.connections.handshakes_failed == (limits.conns_per_ip if tls else 0)
        print(
            f"{'https' if tls else 'http'}: 200 idle sockets from {FLOOD}: {limits.conns_per_ip} held, "
            f"{len(done)} closed within {closed_within * 1e3:.0f} ms of the first connect; "
            f"honest GET answered in {latency * 1e3:.0f} ms; RSS +{(peak - before) / MIB:.1f} MiB; held ones closed after {closed_after:.2f} s"
        )
        assert peak - before < 16 * MIB
        for _, w in conns:
            w.close()
    finally:
        await t.close()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_an_honest_client_behind_the_flooding_address_still_gets_in(tls: bool) -> None:
    t = await serve(ServeLimits(), tls)
    try:
        conns = [await idle(t.port, "127.0.0.1") for _ in range(200)]
        await until(lambda: t.connections.evicted == 200 - t.limits.conns_per_ip)
        status, latency = await timed_get(t)  # takes the place of the oldest idle socket
        assert status == 200 and latency < 1.0
        assert (
            t.connections.open["127.0.0.1"] <= t.limits.conns_per_ip and t.connections.refused == 0
        )
        print(
            f"{'https' if tls else 'http'}: honest GET from the flooding address answered in {latency * 1e3:.0f} ms"
        )
        for _, w in conns:
            w.close()
        await until(lambda: t.connections.total == 0)
    finally:
        await t.close()


async def held_request(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from ``source`` whose GET /hold the server keeps busy until released."""
    r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    w.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
    await w.drain()
    return r, w


async def test_busy_connections_are_never_closed_for_room_so_newcomers_are_refused() -> None:
    hold = Hold()
    t = await serve(ServeLimits(conns_per_ip=4, conns=6, head_timeout_s=30.0), tls=False, hold=hold)
    try:
        a = [await held_request(t.port, "127.0.0.2") for _ in range(4)]
        await until(lambda: hold.holding == 4)
        r, w = await idle(t.port, "127.0.0.2")  # a fifth from a full address: all four are busy
        async with asyncio.timeout(2.0):
            assert await closed(r) == b""
        assert t.connections.refused == 1 and t.connections.evicted == 0
        b = [await held_request(t.port, "127.0.0.3") for _ in range(2)]
        await until(lambda: hold.holding == 6)
        with pytest.raises(aiohttp.ClientError):  # the server is full of busy connections
            await timed_get(t)
        # aiohttp retries an idempotent request once after a reset: refused twice
        assert t.connections.refused == 3 and t.connections.open == {"127.0.0.2": 4, "127.0.0.3": 2}
        hold.release.set()
        for r, _ in a + b:
            async with asyncio.timeout(2.0):
                assert (await r.readuntil(b"held")).startswith(b"HTTP/1.1 200")
        assert (await timed_get(t))[0] == 200
        for _, w in a + b:
            w.close()
        await until(lambda: t.connections.total == 0)
    finally:
        hold.release.set()
        await t.close()


async def test_an_idle_keepalive_connection_makes_room_when_nothing_is_pending() -> None:
    t = await serve(ServeLimits(conns_per_ip=2, head_timeout_s=30.0), tls=False)
    try:
        r1, w1 = await asyncio.open_connection("127.0.0.1", t.port, local_addr=(FLOOD, 0))
        w1.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await r1.readuntil(b"\r\n\r\nok")).startswith(
            b"HTTP/1.1 200"
        )  # now idle, kept alive
        r2, w2 = await asyncio.open_connection("127.0.0.1", t.port, local_addr=(FLOOD, 0))
        w2.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # pending: half a head
        await until(lambda: t.connections.total == 2)
        r3, w3 = await idle(t.port)  # the pending one goes first
        async with asyncio.timeout(2.0):
            assert await closed(r2) == b""
        r4, w4 = await idle(t.port)  # then (r3 pending again) r3; then the idle one
        async with asyncio.timeout(2.0):
            assert await closed(r3) == b""
        w4.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await r4.readuntil(b"\r\n\r\nok")).startswith(b"HTTP/1.1 200")
        r5, w5 = await idle(t.port)  # no pending one left: the oldest idle one, r1, makes room
        async with asyncio.timeout(2.0):
            assert await closed(r1) == b""
        assert t.connections.evicted == 3 and t.connections.refused == 0
        for w in (w1, w2, w3, w4, w5):
            w.close()
        await until(lambda: t.connections.total == 0)
    finally:
        await t.close()


async def trickle(writer: asyncio.StreamWriter, data: bytes, gap_s: float) -> None:
    """Send ``data`` a byte at a time, ``gap_s`` apart, until the server hangs up."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(gap_s)


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_a_trickled_request_head_is_closed_within_the_head_timeout(tls: bool) -> None:
    t = await serve(ServeLimits(head_timeout_s=1.0), tls)
    loop = asyncio.get_running_loop()
    head = (
        b"GET /ok HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"s" * 100 + b"\r\n\r\n"
    )  # 6.5 s of bytes
    try:
        start = loop.time()
        r, w = await asyncio.open_connection(
            "127.0.0.1", t.port, local_addr=(FLOOD, 0), ssl=client_context() if tls else None
        )
        writing = asyncio.create_task(trickle(w, head, 0.05))
        async with asyncio.timeout(3.0):
            reply = await closed(r)
        took = loop.time() - start
        writing.cancel()
        assert reply.startswith(b"HTTP/1.1 408") and b"HeadTimeout" in reply, reply[:80]
        assert 0.9 < took < 2.0 and t.connections.head_timeouts == 1
        await until(lambda: t.connections.total == 0)
        print(
            f"{'https' if tls else 'http'}: trickled head closed after {took:.2f} s "
            f"(head timeout {t.limits.head_timeout_s} s)"
        )
        w.close()
    finally:
        await t.close()


async def test_keepalive_idles_between_requests_but_the_next_head_has_a_deadline() -> None:
    t = await serve(ServeLimits(head_timeout_s=0.5), tls=False)
    loop = asyncio.get_running_loop()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", t.port)
        for _ in range(2):  # idle longer than the head timeout between two requests: still open
            w.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await r.readuntil(b"\r\n\r\nok")).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.8)
        start = loop.time()
        w.write(b"GET /ok HTTP/1.1\r\n")  # and then nothing: half a head
        async with asyncio.timeout(3.0):
            assert (await closed(r)).startswith(b"HTTP/1.1 408")
        assert 0.4 < loop.time() - start < 1.5
        w.close()
    finally:
        await t.close()


async def test_a_slow_body_after_a_complete_head_is_not_cut_by_the_head_timeout() -> None:
    t = await serve(ServeLimits(head_timeout_s=0.3), tls=False)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", t.port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\n")
        for piece in (b"ab", b"cd", b"ef"):
            await asyncio.sleep(0.3)
            w.write(piece)
        async with asyncio.timeout(5):
            reply = await r.readuntil(b"abcdef")
        assert reply.startswith(b"HTTP/1.1 200")
        w.close()
        await until(lambda: t.connections.total == 0)
    finally:
        await t.close()


async def test_a_failed_tls_handshake_frees_its_slot() -> None:
    t = await serve(ServeLimits(conns_per_ip=2), tls=True)
    try:
        for _ in range(5):
            r, w = await idle(t.port, "127.0.0.1")
            w.write(b"this is no TLS client hello\r\n\r\n")
            async with asyncio.timeout(3.0):
                await closed(r)
            w.close()
        await until(lambda: t.connections.total == 0)
        assert t.connections.handshakes_failed == 5
        assert (await timed_get(t))[0] == 200
        with pytest.raises((aiohttp.ClientError, ssl.SSLError)):  # plain HTTP to a TLS port
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{t.port}/ok") as resp:
                await resp.read()
        await until(lambda: t.connections.total == 0)
    finally:
        await t.close()


def test_addresses_are_counted_per_ipv4_address_and_per_ipv6_64() -> None:
    assert address_key("192.0.2.7") == "192.0.2.7"
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert (
        address_key("2001:db8:1:2:aaaa::1")
        == address_key("2001:db8:1:2:ffff::9")
        == "2001:db8:1:2::/64"
    )
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("not an address") == "not an address"
    with pytest.raises(ValueError):
        ServeLimits(conns_per_ip=0)
    with pytest.raises(ValueError):
        ServeLimits(head_timeout_s=0)


def test_every_place_that_counts_senders_uses_sender_key() -> None:
    """One function says which key a sender's address is counted under (netgroups)."""
    from protocol.dht.netgroups import sender_key
    from protocol.dht.record_store import source_key

    assert address_key is sender_key and source_key is sender_key
    assert address_key("x" * 100) == "x" * 64  # other text is cut, as the record store did
    assert source_key("fe80::1%eth0") == "fe80::/64"  # zones are stripped, as connections did


class _Handler(asyncio.Protocol):
    pass


async def test_many_addresses_of_one_48_cannot_take_every_connection_slot() -> None:
    """Counted per /64 only, 32 /64s of one /48 took all 64 slots; counted at the /56 and /48
    too (``PrefixCounts``, as long-polls are), the /48 holds 16 caps' worth and no more."""
    from node.wire.connections import Connections, _Gate

    limits = ServeLimits(conns_per_ip=2, conns=64)
    conns = Connections(limits)
    loop = asyncio.get_running_loop()

    def connect(ip: str) -> _Gate | None:
        return _Gate(conns, ip, _Handler, loop.time() + 60) if conns.admit(ip) else None

    # every /64 of the /48 (256 /56s x 2 /64s) opens one idle, pending connection after another
    flood = [f"2001:db8:7:{s:02x}{h:02x}::1" for s in range(256) for h in range(2)]
    for ip in flood:
        connect(ip)
    assert conns.open["2001:db8:7::/48"] == 16 * limits.conns_per_ip == conns.total
    assert conns.refused == 0  # newcomers took the place of the /48's oldest, not anyone else's
    # the rest of the server is free: an honest IPv4 client and another /48 get every slot left
    honest = [connect(f"192.0.2.{i}") for i in range(1, 17)]
    honest += [connect(f"2001:db8:8:{i:x}00::1") for i in range(16)]
    assert all(g is not None for g in honest) and conns.total == 64 and conns.evicted > 0
    # busy connections are never closed for room: a full /48 then refuses its own newcomers
    for gate in list(conns._pending):
        if "2001:db8:7::/48" in gate.prefixes:
            conns._state(gate, "busy")
    evicted = conns.evicted
    assert connect("2001:db8:7:ffff::9") is None and conns.evicted == evicted
    assert conns.open["2001:db8:7::/48"] == 32
