"""A member's header bomb — a msgpack header of millions of nested empty maps or one-element
arrays, sealed by an authorised key — gets a 4xx with a reason while a cheap route on the same
server keeps answering: headers over the route's cap are refused from the frame prefix before
any hash or decode, and large headers under it are decoded in a worker thread, never on the
event loop. Both are checked as what happened (which decodes ran, on which thread), not as a
time, which a loaded machine stretches (decoding the largest header the cap lets through takes
~0.1 s on the loop; an 8 MiB one ~4 s). Real aiohttp servers on 127.0.0.1, port 0."""

from __future__ import annotations

import asyncio
import math
import os
import struct
import threading
import time

import aiohttp
import pytest
from aiohttp import web

import node.wire.rpc
from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.route import DHTRouter
from node.wire.rpc import MAX_REQUEST_HEADER, OFF_LOOP_HEADER, RpcServer, check_header
from node.wire.transport import Transport
from protocol.dht.messages import MAX_STORE_RECORDS, Store
from protocol.dht.records import sign_record
from protocol.errors import Oversize
from protocol.ids import key_id
from protocol.wire.codec import FORMAT_VERSION, MAGIC, Encoded, encode, header_length
from protocol.wire.messages import Contribution, Message, PeerInfo
from protocol.wire.signing import Opened, Signer, seal
from protocol.wire.tensors import EncodedTensor
from tests.node.wire.member_rpc import MEMBER, SERVER, member_rpc

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20
EMPTY_MAP, ONE_ELEMENT_ARRAY = b"\x80", b"\x91\x00"


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every header decode the RPC layer runs, as whether it ran on this test's (the event loop's)
    thread."""
    ran: list[bool] = []
    real, loop_thread = node.wire.rpc._decode, threading.get_ident()

    def spy(admitted: object) -> Opened:
        ran.append(threading.get_ident() == loop_thread)
        return real(admitted)  # type: ignore[arg-type]

    monkeypatch.setattr(node.wire.rpc, "_decode", spy)
    return ran


def bomb(size: int, element: bytes) -> bytes:
    """An encoded message of about ``size`` bytes whose header is ``[1, [[[element × 15] × m] ×
    n], []]``: one whole msgpack object (so it passes the codec's completeness check), every
    array within the codec's length limits, about one object per byte."""
    inner = bytes([0x90 + 15]) + element * 15
    m = max(1, ((size - 64) // 65536 - 3) // len(inner))
    middle = b"\xdc" + struct.pack(">H", m) + inner * m
    n = min(65536, (size - 64) // len(middle))
    header = b"\x93\x01\xdd" + struct.pack(">I", n) + middle * n + b"\x90"
    return struct.pack(">4sBI", MAGIC, FORMAT_VERSION, len(header)) + header


def sealed(message: bytes | Message, who: Signer = MEMBER, to: bytes = SERVER.peer_id) -> bytes:
    if isinstance(message, bytes):
        encoded = Encoded(parts=[memoryview(message)], size=len(message))
    else:
        encoded = encode(message)
    return seal(encoded, who, now=time.time(), nonce=os.urandom(16), recipient=to).tobytes()


async def serve(*, dht: bool = False) -> tuple[Transport, RpcServer, list[Opened]]:
    """An RpcServer admitting MEMBER, a cheap ``GET /v1/status``, and optionally a DHT node."""
    transport, server, seen = member_rpc()

    async def status(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    transport.app.router.add_get("/v1/status", status)
    router = DHTRouter(transport) if dht else None
    await transport.start()
    if router is not None:
        router.mount(DHTNode(SERVER, transport, router.url(), DHTConfig(maintenance_period_s=0)))
    return transport, server, seen


async def while_posting(
    url: str, path: str, body: bytes, pollers: int = 4
) -> tuple[int, str, float, int]:
    """POST ``body`` to ``path`` while ``pollers`` clients GET /v1/status back to back (one is
    always in flight, so any stall of the loop shows); the POST's status and reason, the slowest
    GET in seconds and how many GETs answered meanwhile."""
    slowest, answered = 0.0, 0
    done = asyncio.Event()
    async with aiohttp.ClientSession() as session:

        async def get() -> None:
            async with session.get(url + "/v1/status") as resp:
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(get() for _ in range(pollers)))  # connections open before timing
        await asyncio.to_thread(int)  # and the worker threads started

        async def poll() -> None:
            nonlocal slowest, answered
            while not done.is_set():
                t0 = time.perf_counter()
                await get()
                slowest, answered = max(slowest, time.perf_counter() - t0), answered + 1

        async def post() -> tuple[int, str]:
            try:
                async with session.post(url + path, data=body) as resp:
                    return resp.status, (await resp.json())["reason"]
            finally:
                done.set()

        async with asyncio.TaskGroup() as tg:
            polls = [tg.create_task(poll()) for _ in range(pollers)]
            result = tg.create_task(post())
        assert all(p.done() for p in polls)
    status, reason = result.result()
    return status, reason, slowest, answered


@pytest.mark.parametrize("element", [EMPTY_MAP, ONE_ELEMENT_ARRAY], ids=["maps", "arrays"])
async def test_an_8_mib_header_bomb_is_refused_from_its_prefix_and_status_keeps_answering(
    element: bytes, decodes: list[bool]
) -> None:
    transport, server, seen = await serve()
    try:
        body = sealed(bomb(8 * MIB, element))
        status, reason, slowest, answered = await while_posting(transport.url, "/v1/rpc", body)
        assert status == 413 and f"cap of {MAX_REQUEST_HEADER}" in reason, reason
        assert answered > 0 and decodes == [], (slowest, answered, decodes)  # never decoded
        assert (
            server.errors["Oversize"] == 1 and len(server.replay) == 0 and not seen
        )  # not even hashed
    finally:
        await transport.close()


@pytest.mark.parametrize("element", [EMPTY_MAP, ONE_ELEMENT_ARRAY], ids=["maps", "arrays"])
async def test_a_header_bomb_just_under_the_cap_is_decoded_off_the_loop(
    element: bytes, decodes: list[bool]
) -> None:
    transport, server, seen = await serve()
    try:
        message = bomb(MAX_REQUEST_HEADER - 64, element)
        assert OFF_LOOP_HEADER < header_length(message) <= MAX_REQUEST_HEADER
        status, reason, slowest, answered = await while_posting(
            transport.url, "/v1/rpc", sealed(message)
        )
        assert status == 400 and "Contribution" in reason, (
            reason
        )  # decoded, and refused for what it is
        assert answered > 0 and decodes == [False], (
            slowest,
            answered,
            decodes,
        )  # in a worker thread
        assert server.errors["DecodeError"] == 1 and not seen
        # the member's next, honest message still goes through
        contribution = Contribution(
            swarm="s",
            fragment=0,
            base_version=0,
            base_digest=bytes(32),
            tokens=1,
            steps=1,
            step_time=0.1,
            sender_step=1,
            tensors=(_tensor((2, 2)),),
        )
        async with (
            aiohttp.ClientSession() as session,
            session.post(transport.url + "/v1/rpc", data=sealed(contribution)) as resp,
        ):
            assert resp.status == 200, await resp.text()
        assert len(seen) == 1 and seen[0].recipient == SERVER.peer_id
    finally:
        await transport.close()


async def test_the_dht_route_caps_request_headers_too(decodes: list[bool]) -> None:
    transport, _, _ = await serve(dht=True)
    stranger = Signer.from_seed(os.urandom(32))  # the DHT serves anyone
    try:
        body = sealed(bomb(MIB - 1024, EMPTY_MAP), stranger)  # DHT bodies are capped at 1 MiB
        status, reason, slowest, _ = await while_posting(transport.url, "/v1/dht", body)
        assert status == 413 and f"cap of {MAX_REQUEST_HEADER}" in reason, reason
        assert decodes == [], decodes
    finally:
        await transport.close()


async def test_requests_for_another_node_are_refused_with_the_reason() -> None:
    transport, server, seen = await serve(dht=True)
    elsewhere = Signer.from_seed(b"\7" * 32).peer_id
    contribution = Contribution(
        swarm="s",
        fragment=0,
        base_version=0,
        base_digest=bytes(32),
        tokens=1,
        steps=1,
        step_time=0.1,
        sender_step=1,
        tensors=(_tensor((2, 2)),),
    )
    store = Store(
        sender=PeerInfo(peer_id=MEMBER.peer_id),
        records=(sign_record(MEMBER, key_id("k"), b"v", time.time() + 60),),
    )
    try:
        async with aiohttp.ClientSession() as session:
            for path, message, to, why in [
                ("/v1/rpc", contribution, elsewhere, f"sealed for peer {elsewhere.hex()[:16]}"),
                ("/v1/rpc", contribution, b"", "names no recipient"),
                ("/v1/dht", store, elsewhere, f"sealed for peer {elsewhere.hex()[:16]}"),
                ("/v1/dht", store, b"", "a Store must name its recipient"),
            ]:
                async with session.post(transport.url + path, data=sealed(message, to=to)) as resp:
                    assert resp.status == 403 and why in (await resp.json())["reason"], path
        assert server.errors["NotAuthorized"] == 2 and len(server.replay) == 0 and not seen
    finally:
        await transport.close()


def test_honest_requests_fit_their_route_caps() -> None:
    """The caps leave room: a Store of the most records with the largest values, and a
    Contribution of 3,000 int8-coded 2-d tensors (a whole 70B-parameter Llama has ~720)."""
    records = tuple(
        sign_record(MEMBER, key_id(f"k{i}"), bytes(1024), 2e9) for i in range(MAX_STORE_RECORDS)
    )
    store = encode(
        Store(
            sender=PeerInfo(peer_id=MEMBER.peer_id, address="http://" + "h" * 200), records=records
        )
    )
    assert header_length(store.parts[0]) < MAX_REQUEST_HEADER // 2
    tensors = tuple(_tensor((1, 70_000), "int8") for _ in range(3_000))  # 32-bit dims
    contribution = encode(
        Contribution(
            swarm="s" * 128,
            fragment=0,
            base_version=2**40,
            base_digest=bytes(32),
            tokens=2**40,
            steps=2**20,
            step_time=0.1,
            sender_step=2**30,
            tensors=tensors,
        )
    )
    assert header_length(contribution.parts[0]) < MAX_REQUEST_HEADER
    with pytest.raises(Oversize):
        check_header(bomb(2 * MIB, EMPTY_MAP), MAX_REQUEST_HEADER)


_ZEROS = memoryview(bytes(1 << 20))  # shared by every test tensor: encode copies nothing


def _tensor(shape: tuple[int, ...], codec: str = "none") -> EncodedTensor:
    n = math.prod(shape)
    if codec == "none":
        return EncodedTensor(
            codec="none",
            shape=shape,
            dtype="float32",
            block_size=0,
            data=_ZEROS[: 4 * n],
            scales=b"",
        )
    return EncodedTensor(
        codec="int8",
        shape=shape,
        dtype="float32",
        block_size=256,
        data=_ZEROS[:n],
        scales=_ZEROS[: 4 * -(-n // 256)],
    )


async def _send_head(port: int, sealed: bytes, declared: int, sent: int) -> bytes:
    """POST /v1/rpc declaring ``declared`` body bytes, send the first ``sent`` of ``sealed`` and
    wait for the answer with the rest never sent."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(
        f"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode()
        + sealed[:sent]
    )
    try:
        await w.drain()
        async with asyncio.timeout(10):
            return await r.read()
    except ConnectionResetError:  # refused and hung up on while still sending
        return b""
    finally:
        w.close()


async def test_a_large_body_is_refused_from_its_envelope_before_the_rest_is_read() -> None:
    """A stranger's, a forged or a misaddressed 16 MiB request is refused as soon as its envelope
    is in (64 KiB sent, the rest never): no buffer the size of the body, no wait for it. A member's
    body longer than its envelope says is refused as it overflows."""
    message = bytes(16 * MIB)
    encoded = Encoded(parts=[memoryview(message)], size=len(message))
    stranger = Signer.from_seed(b"\7" * 32)

    def sealed(by: Signer, recipient: bytes = SERVER.peer_id) -> bytes:
        return b"".join(
            seal(encoded, by, now=time.time(), nonce=os.urandom(16), recipient=recipient).parts
        )

    async def member(peer: bytes) -> bool:
        return peer == MEMBER.peer_id

    transport = Transport()
    server = RpcServer(transport, SERVER, authorize=member)
    await transport.start()
    try:
        cases = [
            (sealed(stranger), b"403", b"not a member"),
            (sealed(MEMBER, recipient=stranger.peer_id), b"403", b""),
            (bytearray(sealed(MEMBER)), b"401", b""),
        ]
        cases[2][0][200] ^= 1  # a flipped byte in the signed envelope fields
        for wire, status, says in cases:
            reply = await _send_head(transport.port, bytes(wire), len(wire), 64 << 10)
            assert reply[9:12] == status and says in reply, reply[:300]
        assert (
            max((len(b) for b in transport.pool._free), default=0) <= MIB
        )  # no body-sized buffer was made
        longer = sealed(MEMBER) + bytes(2 * MIB)  # 2 MiB more than the envelope declares
        reply = await _send_head(transport.port, longer, len(longer), len(longer))
        assert reply == b"" or (reply[9:12] == b"413" and b"by its head" in reply), reply[:300]
        assert server.errors == {"NotAuthorized": 2, "BadSignature": 1, "Oversize": 1}, (
            server.errors
        )
        assert transport.bodies_in_flight.total() == 0
    finally:
        await transport.close()
