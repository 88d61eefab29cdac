"""A request with a ``Content-Encoding`` is refused unread however its headers are written.

Found in a red-team pass: the refusal read the first ``Content-Encoding`` line
(``request.headers.get``) while aiohttp's C parser inflates by the last one, so a request with
``Content-Encoding: identity`` then ``Content-Encoding: gzip`` passed the check and its body was
inflated (a stranger's junk answered "Can not decode content-encoding: gzip"; a member's chunked
body could inflate ~1000x up to the route's cap). Now every line counts: a 415 before the body
is read, then the connection is closed. Real aiohttp servers on 127.0.0.1, port 0."""

from __future__ import annotations

import asyncio
import gzip
import logging

import pytest

from node.wire.rpc import RpcServer
from node.wire.transport import ServeLimits, Transport
from protocol.wire.signing import Signer

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


async def _post(port: int, path: str, encodings: list[str], body: bytes, *, chunked: bool) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n" + "".join(
        f"Content-Encoding: {e}\r\n" for e in encodings
    )
    if chunked:
        data = (
            head.encode()
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n\r\n"
        )
    else:
        data = head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        async with asyncio.timeout(10):
            return await r.read()  # to EOF: the server hangs up after its answer
    except ConnectionResetError:
        return b""
    finally:
        w.close()


@pytest.mark.parametrize(
    "encodings",
    [
        ["identity", "gzip"],
        ["identity", "identity", "deflate"],
        ["gzip", "identity"],
        ["IDENTITY", " gzip "],
    ],
)
async def test_every_content_encoding_line_counts(
    encodings: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    transport = Transport(limits=ServeLimits(body_timeout_s=5, body_idle_s=3))
    RpcServer(transport, Signer.from_seed(b"\1" * 32))
    await transport.start()
    bomb = gzip.compress(bytes(16 * MIB), 9)  # 16 KB that would become 16 MiB
    try:
        for path in ("/v1/rpc", "/missing"):
            for body in (bomb, b"not gzip"):
                for chunked in (False, True):
                    reply = await _post(transport.port, path, encodings, body, chunked=chunked)
                    assert reply.startswith(b"HTTP/1.1 415"), (path, chunked, reply[:200])
                    assert b"EncodedBody" in reply and b"send the body as it is" in reply, reply
        assert (
            transport.bodies_in_flight.total() == 0 and transport.bytes_received == 0
        )  # not a byte read
    finally:
        await transport.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not [r for r in caplog.records if "decode content-encoding" in r.getMessage()]
