"""A large request body's head (the sealed message's envelope) vouches for its size: until it has,
the body gets no more time than a small one, and once it has, the body must be exactly as long
as its Content-Length said.

Found in a red-team pass: a body's deadline grew by ``body_slack_s_per_mib`` for every MiB its
Content-Length claimed, before a byte of it was checked. A stranger declaring 256 MiB and
trickling its envelope one byte every few seconds held one of the server's body slots for
~286 s (30 s + 256 s) instead of 30 s, at 0.1 B/s: eight such connections per address, from a
few addresses, kept every member's RPC answered 429. And a member's body whose envelope declared
fewer bytes than its Content-Length was read on, then timed out, though it could only be refused.
Real aiohttp servers on 127.0.0.1, port 0; time scaled down."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from node.wire.rpc import RpcServer
from node.wire.transport import ServeLimits, Transport
from protocol.wire.codec import Encoded, encode
from protocol.wire.messages import Contribution
from protocol.wire.signing import Opened, Signer, seal
from protocol.wire.tensors import EncodedTensor
from tests.node.wire.member_rpc import MEMBER, SERVER, member_rpc

pytestmark = pytest.mark.timeout(60)

STRANGER = Signer.from_seed(b"\7" * 32)
MIB = 1 << 20
# a body may take 1 s, plus 2 s per declared MiB; no gap between chunks over 0.8 s
LIMITS = ServeLimits(body_timeout_s=1.0, body_slack_s_per_mib=2.0, body_idle_s=0.8)


def _contribution(n: int) -> Contribution:
    tensor = EncodedTensor(
        codec="none", shape=(n,), dtype="float32", block_size=0, data=bytes(4 * n), scales=b""
    )
    return Contribution(
        swarm="s",
        fragment=0,
        base_version=0,
        base_digest=bytes(32),
        tokens=1,
        steps=1,
        step_time=0.1,
        sender_step=1,
        tensors=(tensor,),
    )


def _sealed(who: Signer, n: int = MIB // 2, *, size: int | None = None) -> bytes:
    encoded = encode(_contribution(n))
    if size is not None:  # an envelope that declares another size than the message has
        encoded = Encoded(parts=encoded.parts, size=size)
    return seal(
        encoded, who, now=time.time(), nonce=os.urandom(16), recipient=SERVER.peer_id
    ).tobytes()


async def _server() -> tuple[Transport, RpcServer, list[Opened]]:
    transport, server, seen = member_rpc(LIMITS)
    await transport.start()
    return transport, server, seen


async def _post(
    port: int, declared: int, pieces: list[bytes], gap_s: float, wait_s: float
) -> tuple[bytes, float]:
    """POST /v1/rpc declaring ``declared`` bytes, then ``pieces`` ``gap_s`` apart (stopping when
    the server hangs up); the reply (b"" if none) and the seconds from the head to the reply."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def send() -> None:
        w.write(f"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode())
        for piece in pieces:
            w.write(piece)
            await w.drain()
            await asyncio.sleep(gap_s)

    sending = asyncio.create_task(send())
    try:
        async with asyncio.timeout(wait_s):
            reply = await r.readuntil(b"\r\n\r\n")
            reply += await r.read(4096)
    except (ConnectionError, asyncio.IncompleteReadError):
        reply = b""
    finally:
        sending.cancel()
        w.close()
    return reply, loop.time() - start


async def test_a_claimed_size_buys_no_time_before_the_envelope_vouches_for_it() -> None:
    """A stranger declares 64 MiB (a deadline of 129 s once vouched for) and trickles its envelope
    a byte every 0.3 s: cut off at the 1 s any body gets, not after 129 s."""
    transport, server, _ = await _server()
    try:
        wire = _sealed(STRANGER)
        pieces = [wire[i : i + 1] for i in range(200)]  # the envelope is ~210 bytes: never complete
        reply, took = await _post(transport.port, 64 * MIB, pieces, gap_s=0.3, wait_s=8.0)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"head not complete" in reply, reply
        assert took < 4.0, took
        assert server.errors == {"BodyTimeout": 1} and transport.bodies_in_flight.total() == 0
    finally:
        await transport.close()


async def test_once_the_envelope_is_in_a_large_body_has_its_whole_deadline() -> None:
    """A member's 2 MiB body (a deadline of 1 s + 4 s) whose envelope comes at once and whose rest
    takes ~2 s is read whole and answered."""
    transport, server, seen = await _server()
    try:
        wire = _sealed(MEMBER)
        head, rest = wire[: 64 << 10], wire[64 << 10 :]
        pieces = [head] + [rest[i : i + (256 << 10)] for i in range(0, len(rest), 256 << 10)]
        reply, took = await _post(transport.port, len(wire), pieces, gap_s=0.25, wait_s=10.0)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert took > LIMITS.body_timeout_s and len(seen) == 1 and not server.errors, (
            took,
            server.errors,
        )
    finally:
        await transport.close()


async def test_a_content_length_other_than_the_envelope_says_is_refused_at_once() -> None:
    """The envelope declares 1 KiB less than the message and Content-Length the whole message:
    refused as soon as the envelope is in, not after the sender goes quiet."""
    transport, server, seen = await _server()
    try:
        honest = _sealed(MEMBER)
        message_size = len(honest) - 4 - int.from_bytes(honest[:4], "big")
        wire = _sealed(MEMBER, size=message_size - 1024)
        declared = len(wire)
        # send all but the last 1024 bytes, exactly what the envelope declares, then go quiet
        reply, took = await _post(
            transport.port,
            declared,
            [wire[: 64 << 10], wire[64 << 10 : -1024]],
            gap_s=0.05,
            wait_s=8.0,
        )
        assert reply == b"" or reply.startswith(b"HTTP/1.1 413"), reply[:300]
        if reply:
            assert f"{declared}".encode() in reply and b"envelope" in reply, reply
        assert took < LIMITS.body_idle_s, took  # not a 408 after the idle timeout
        assert server.errors == {"Oversize": 1} and not seen, server.errors
        assert transport.bodies_in_flight.total() == 0
    finally:
        await transport.close()
