"""``POST /v1/rpc`` bodies are capped by the fragment plan (``max_rpc_body``), not a fixed
256 MiB: the widest message a member can legitimately send for the plan's largest fragment fits,
and a body declaring one byte more is a 413 before a byte of it is buffered."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from node.wire.bodies import BufferPool
from node.wire.rpc import MAX_REQUEST_HEADER, WIDEST_BYTES_PER_ELEMENT, RpcServer, max_rpc_body
from node.wire.transport import Transport
from protocol.diloco.fragments import plan_fragments
from protocol.wire.codec import encode
from protocol.wire.messages import Contribution, ReplicaState
from protocol.wire.signing import Signer, seal
from protocol.wire.tensors import CODECS, EncodedTensor, payload_bytes

pytestmark = pytest.mark.timeout(60)

SENDER, SERVER = Signer.from_seed(bytes([1]) * 32), Signer.from_seed(bytes([2]) * 32)


def tensor(codec: str, shape: tuple[int, ...], block_size: int) -> EncodedTensor:
    n = 1
    for d in shape:
        n *= d
    data, scales = payload_bytes(codec, n, block_size)
    return EncodedTensor(
        codec=codec,
        shape=shape,
        dtype="float32",
        block_size=block_size,
        data=bytes(data),
        scales=bytes(scales),
    )


def sealed_size(msg: object) -> int:
    return seal(
        encode(msg), SENDER, now=time.time(), nonce=os.urandom(16), recipient=SERVER.peer_id
    ).size


def test_the_widest_legitimate_message_of_the_largest_fragment_fits_the_cap() -> None:
    plan = plan_fragments(
        [("w1", (512, 300)), ("b1", (300,)), ("w2", (300, 7)), ("emb", (1000, 64))], 3
    )
    largest = max(plan.fragments, key=lambda f: f.numel)
    cap = max_rpc_body(f.numel for f in plan.fragments)
    assert WIDEST_BYTES_PER_ELEMENT == 8  # fp32 theta + fp32 momentum
    flat = (largest.numel,)
    replica = ReplicaState(
        swarm="s",
        fragment=largest.index,
        epoch=1,
        version=3,
        digest=bytes(32),
        theta=(tensor("none", flat, 0),),
        momentum=(tensor("none", flat, 0),),
    )
    assert sealed_size(replica) <= cap
    for codec in CODECS:  # a contribution per tensor, each codec at its widest (block size 1)
        block = 0 if codec in ("none", "bf16") else 1
        c = Contribution(
            swarm="s",
            fragment=largest.index,
            base_version=0,
            base_digest=bytes(32),
            tokens=1,
            steps=1,
            step_time=0.1,
            sender_step=1,
            tensors=tuple(tensor(codec, s, block) for s in largest.shapes),
        )
        assert sealed_size(c) <= cap, codec
    # and no more than a few MiB above it: not the 256 MiB of before
    assert cap < 8 * largest.numel * 1.05 + MAX_REQUEST_HEADER + (2 << 20)


class _CountingPool(BufferPool):
    def __init__(self) -> None:
        super().__init__()
        self.taken = 0

    def take(self, size: int, *, fresh: int | None = None) -> bytearray:
        self.taken += 1
        return super().take(size, fresh=fresh)


async def test_a_body_declaring_more_than_the_plan_allows_is_refused_before_it_is_buffered() -> (
    None
):
    plan = plan_fragments([("w", (256, 256)), ("b", (256,))], 2)
    cap = max_rpc_body(f.numel for f in plan.fragments)
    t = Transport()
    t.pool = _CountingPool()
    rpc = RpcServer(t, SERVER, max_message=cap)
    await t.start()
    try:
        for declared, expect in ((cap + 1, b"HTTP/1.1 413"), (256 << 20, b"HTTP/1.1 413")):
            r, w = await asyncio.open_connection("127.0.0.1", t.port)
            w.write(
                f"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode()
            )
            await w.drain()  # the head only: not a byte of the body is sent
            async with asyncio.timeout(5.0):
                head = await r.readuntil(b"\r\n\r\n")
            w.close()
            assert head.startswith(expect), head[:80]
        assert t.pool.taken == 0 and rpc.errors["Oversize"] == 2
    finally:
        await t.close()
