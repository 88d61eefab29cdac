"""POST /v1/rpc refuses a stranger right after its envelope's signature: no hash, no decode, and no
place in the replay window, so a flood of validly signed messages from fresh keys cannot make an
honest member's next message a "replay"."""

from __future__ import annotations

import os
import time

import aiohttp
import pytest
import torch

from node.wire.rpc import RpcServer
from node.wire.transport import Transport
from protocol.diloco.compression import compress
from protocol.wire.codec import encode
from protocol.wire.messages import Ack, Contribution
from protocol.wire.signing import Opened, ReplayWindow, Signer, seal, verify_sealed

pytestmark = pytest.mark.timeout(60)

STRANGERS = 600
CAPACITY = 200  # a small window: the flood overflows it many times over
SERVER = Signer.from_seed(bytes([1]) * 32)


def _sealed(who: Signer, *, at: float, to: bytes = SERVER.peer_id) -> bytes:
    tensor = compress(torch.zeros(2, 2), "none")[0]
    msg = Contribution(
        swarm="flood",
        fragment=0,
        base_version=0,
        base_digest=bytes(32),
        tokens=1,
        steps=1,
        step_time=0.0,
        sender_step=1,
        tensors=(tensor,),
    )
    return seal(encode(msg), who, now=at, nonce=os.urandom(16), recipient=to).tobytes()


async def test_a_flood_from_fresh_keys_leaves_a_members_next_message_accepted() -> None:
    member = Signer.from_seed(bytes([5]) * 32)
    transport = Transport()
    server = RpcServer(transport, SERVER, authorize=lambda peer: _member(peer, member.peer_id))
    server.replay = ReplayWindow(capacity=CAPACITY)

    async def handler(opened: Opened) -> Ack:
        return Ack(accepted=True, reason="ok", version=0)

    server.route(Contribution, handler)
    await transport.start()
    try:
        async with aiohttp.ClientSession() as session:
            statuses = []
            for _ in range(STRANGERS):  # validly signed, dated as far ahead as the skew allows
                body = _sealed(Signer.from_seed(os.urandom(32)), at=time.time() + 59.0)
                async with session.post(f"{transport.url}/v1/rpc", data=body) as resp:
                    statuses.append(resp.status)
                    assert "not a member" in (await resp.json())["reason"]
            assert statuses == [403] * STRANGERS
            assert len(server.replay) == 0  # not one of them took a place in the window
            async with session.post(
                f"{transport.url}/v1/rpc", data=_sealed(member, at=time.time())
            ) as resp:
                assert resp.status == 200, await resp.text()
                reply = verify_sealed(await resp.read(), max_size=1 << 16).message
        assert isinstance(reply, Ack) and reply.accepted
        assert server.errors["NotAuthorized"] == STRANGERS
    finally:
        await transport.close()


async def _member(peer: bytes, member: bytes) -> bool:
    return peer == member
