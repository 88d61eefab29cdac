"""A large body is written a piece at a time, each piece only once the transport's buffer is
empty (``writing_when_empty``): asyncio (3.11) sends a piece straight from our memory only when
its buffer is empty, and otherwise copies the whole piece into that buffer. Both ways: a streamed
reply, and a request body. The bytes arrive whole, over a reader slow enough to fill the socket,
and a kept-alive connection gets its limits back."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Iterator

import pytest
from aiohttp import web

from node.wire.transport import REPLY_PIECE, Transport

pytestmark = pytest.mark.timeout(60)

PIECES = 48  # 12 MiB of 256 KiB pieces


def _body() -> bytes:
    return random.Random(5).randbytes(PIECES * REPLY_PIECE)


def _watched(body: bytes, transport: asyncio.WriteTransport, seen: list[int]) -> Iterator[bytes]:
    """``body`` a piece at a time, noting the transport's unsent bytes as each is taken (the
    writer takes the next piece once the last one's write has returned)."""
    view = memoryview(body)
    for start in range(0, len(body), REPLY_PIECE):
        seen.append(transport.get_write_buffer_size())
        yield view[start : start + REPLY_PIECE]


async def _slow_read(reader: asyncio.StreamReader, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        got += await reader.read(64 << 10)
        await asyncio.sleep(0.002)  # slower than the writer: the socket fills, writes back up
    return bytes(got)


async def test_a_streamed_reply_writes_each_piece_into_an_empty_transport_buffer() -> None:
    server, body, seen = Transport(), _body(), []
    limits: list[tuple[int, int]] = []

    async def down(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        assert isinstance(transport, asyncio.WriteTransport)
        resp = await server.stream_reply(request, _watched(body, transport, seen), len(body))
        limits.append(transport.get_write_buffer_limits())
        return resp

    server.app.router.add_get("/down", down)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /down HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        got = await _slow_read(reader, len(body))
        writer.close()
    finally:
        await server.close()
    assert hashlib.sha256(got).digest() == hashlib.sha256(body).digest()
    assert len(seen) == PIECES
    # after the first piece (written behind the reply's head), every piece found nothing unsent
    assert seen[1:] == [0] * (PIECES - 1), f"unsent bytes as pieces were written: {seen}"
    assert limits and limits[0][1] > 0  # the default limits are back for the next reply


async def test_a_request_body_writes_each_piece_into_an_empty_transport_buffer() -> None:
    body, seen = _body(), []
    done = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        got = await _slow_read(reader, len(body))
        done.set_result(got)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = Transport()
    await client.start()

    def chunks() -> Iterator[bytes]:
        connector = client.session.connector
        assert connector is not None
        # the one connection the request went out on (aiohttp's protocol for it)
        transport = next(iter(connector._acquired)).transport
        assert isinstance(transport, asyncio.WriteTransport)
        yield from _watched(body, transport, seen)

    try:
        status, buf, _, _ = await client.request(
            "POST", f"http://127.0.0.1:{port}/up", chunks=chunks(), size=len(body)
        )
        client.pool.give(buf)
        got = await done
    finally:
        await client.close()
        listener.close()
    assert status == 204 and hashlib.sha256(got).digest() == hashlib.sha256(body).digest()
    assert len(seen) == PIECES
    assert seen[1:] == [0] * (PIECES - 1), f"unsent bytes as pieces were written: {seen}"
