"""A real ``RpcServer`` on 127.0.0.1 that admits one member and records the contributions it
answers: the server the wire tests send hostile bodies to."""

from __future__ import annotations

from node.wire.rpc import RpcServer
from node.wire.transport import ServeLimits, Transport
from protocol.wire.messages import Ack, Contribution
from protocol.wire.signing import Opened, Signer

SERVER, MEMBER = Signer.from_seed(b"\1" * 32), Signer.from_seed(b"\5" * 32)


def member_rpc(limits: ServeLimits | None = None) -> tuple[Transport, RpcServer, list[Opened]]:
    """A transport (not started) whose RpcServer, signed as SERVER, admits only MEMBER and acks
    every ``Contribution``, appending what it opened to the list returned."""
    transport = Transport() if limits is None else Transport(limits=limits)
    seen: list[Opened] = []

    async def member(peer: bytes) -> bool:
        return peer == MEMBER.peer_id

    async def handler(opened: Opened) -> Ack:
        seen.append(opened)
        return Ack(accepted=True, reason="ok", version=0)

    server = RpcServer(transport, SERVER, authorize=member)
    server.route(Contribution, handler)
    return transport, server, seen
