"""A body in tiny pieces (chunked transfer encoding of 1-byte chunks) costs the reader about what
aiohttp's own parsing of it costs, and never holds the event loop while a buffer of them drains.

Found in a red-team pass: ``read_stream`` took each piece on its own, with a fresh timeout around
each, back to back as long as aiohttp had any buffered (it returns them without a pause). A
stranger's DHT request of 1 MB sent as 1-byte chunks (6 MB on the wire, which anyone may POST to
``/v1/dht``) took 9.4 s of the server's CPU and stalled its event loop for up to 1.7 s at a time;
now 1.3 s (aiohttp's parser and bookkeeping, ~1.3 us a chunk) and ~0.1 s stalls. Checked here
as what happened (how often the reader went back to aiohttp, whether other tasks ran meanwhile),
not as a time."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import aiohttp
import pytest
from aiohttp.base_protocol import BaseProtocol

from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.route import DHTRouter
from node.wire.bodies import BufferPool, read_stream
from node.wire.transport import Transport
from protocol.wire.codec import Encoded
from protocol.wire.signing import Signer, seal

pytestmark = pytest.mark.timeout(60)

PIECES = 50_000


class _Counting(aiohttp.StreamReader):
    """aiohttp's reader, counting the reads that go back to it for the next piece."""

    reads = 0

    async def readchunk(self) -> tuple[bytes, bool]:
        self.reads += 1
        return await super().readchunk()


def _tiny_chunked(payload: bytes) -> _Counting:
    """A request body as aiohttp's parser hands over a chunked body of 1-byte chunks, all
    buffered already (the sender was faster than the reader)."""
    loop = asyncio.get_running_loop()
    reader = _Counting(BaseProtocol(loop), 1 << 30, loop=loop)  # a high limit: never paused here
    reader.begin_http_chunk_receiving()
    for i in range(len(payload)):
        reader.feed_data(payload[i : i + 1])
        reader.end_http_chunk_receiving()
    reader.feed_eof()
    return reader


async def test_tiny_pieces_are_read_together_and_other_tasks_run_meanwhile() -> None:
    payload = os.urandom(PIECES)
    reader = _tiny_chunked(payload)
    ticks = 0

    async def other_task() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    ticker = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    pool = BufferPool()
    buf, used = await read_stream(reader, None, 1 << 20, pool, timeout_s=30, idle_s=10)
    ticker.cancel()
    assert bytes(memoryview(buf)[:used]) == payload
    # one piece at a time was 50,000 reads, and not one tick of any other task until the end
    assert reader.reads < PIECES // 100, reader.reads
    assert ticks >= 2, ticks


async def test_a_strangers_dht_request_in_1_byte_chunks_is_answered_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """End to end: the request is read whole and refused for what it is (not a message) with a 400
    and a reason, and nothing worse than INFO/WARNING is logged."""
    caplog.set_level(logging.DEBUG)
    server, stranger = Signer.from_seed(b"\1" * 32), Signer.from_seed(b"\7" * 32)
    transport = Transport()
    router = DHTRouter(transport)
    await transport.start()
    router.mount(DHTNode(server, transport, router.url(), DHTConfig(maintenance_period_s=0)))
    try:
        message = bytes(PIECES)
        wire = seal(
            Encoded(parts=[memoryview(message)], size=len(message)),
            stranger,
            now=time.time(),
            nonce=os.urandom(16),
            recipient=server.peer_id,
        ).tobytes()
        body = (
            b"".join(b"1\r\n" + wire[i : i + 1] + b"\r\n" for i in range(len(wire))) + b"0\r\n\r\n"
        )
        r, w = await asyncio.open_connection("127.0.0.1", transport.port)
        w.write(
            b"POST /v1/dht HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + body
        )
        await w.drain()
        async with asyncio.timeout(30):
            reply = await r.read()
        w.close()
        assert (
            reply.startswith(b"HTTP/1.1 400") and b"DecodeError" in reply and b"bad magic" in reply
        ), reply[:300]
        assert router.errors == {"DecodeError": 1} and transport.bodies_in_flight.total() == 0
    finally:
        await transport.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
