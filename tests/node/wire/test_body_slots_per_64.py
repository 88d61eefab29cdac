"""Request bodies in flight are counted per address as connections are: an IPv6 address by its
/64, since one host commonly holds a whole /64.

Found in a red-team pass: ``Transport.read_request`` counted bodies under ``request.remote``
itself, so a sender with a /64 (2^64 addresses) had no per-address cap on bodies at all and
could take every one of the server's body slots by itself (429 for everyone else), though its
connections were capped per /64. The addresses are set by a middleware here (a test host has no
/64 of its own); the counting is the transport's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from node.wire.rpc import RpcServer
from node.wire.transport import ServeLimits, Transport
from protocol.wire.signing import Signer

pytestmark = pytest.mark.timeout(60)


@web.middleware
async def _from_header(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The request as if from the address in its ``X-From`` header."""
    return await handler(request.clone(remote=request.headers["X-From"]))


async def _stalled(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(
        f"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nX-From: {source}\r\nContent-Length: 100000\r\n\r\n".encode()
        + b"\0"
    )
    await w.drain()
    return r, w


async def test_body_slots_are_counted_per_ipv6_64() -> None:
    transport = Transport(
        limits=ServeLimits(bodies_per_ip=2, bodies=64, body_timeout_s=20, body_idle_s=20)
    )
    transport.admit_with(_from_header)
    RpcServer(transport, Signer.from_seed(b"\1" * 32))
    await transport.start()
    held = []
    try:
        for host in (
            "2001:db8:0:1::1",
            "2001:db8:0:1::2",
        ):  # two addresses of one /64: its two slots
            held.append(await _stalled(transport.port, host))
        async with asyncio.timeout(5):
            while transport.bodies_in_flight.total() < 2:
                await asyncio.sleep(0.01)
        r, w = await _stalled(transport.port, "2001:db8:0:1::ffff")  # a third address of that /64
        held.append((r, w))
        async with asyncio.timeout(
            5
        ):  # (not hung up on: the middleware's clone is not the request the guard sees)
            reply = await r.readuntil(b"\r\n\r\n")
            reply += await r.read(4096)
        assert reply.startswith(b"HTTP/1.1 429") and b"2001:db8:0:1::/64" in reply, reply[:300]
        r, w = await _stalled(transport.port, "2001:db8:0:2::1")  # another /64 has its own slots
        held.append((r, w))
        async with asyncio.timeout(5):
            while transport.bodies_in_flight.total() < 3:
                await asyncio.sleep(0.01)
        assert dict(transport.bodies_in_flight) == {"2001:db8:0:1::/64": 2, "2001:db8:0:2::/64": 1}
    finally:
        for _, w in held:
            w.close()
        await transport.close()
