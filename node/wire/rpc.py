"""RPC: sealed bytes → verified message → handler → sealed reply.

One explicit table maps message classes to async handlers (no dispatch by method name). A
peer's bad bytes, bad signature, replay, unknown type or oversized body becomes a
``RemoteProtocolError``: the reply is a 4xx with the reason as JSON, the error is counted per
kind and logged, and nothing else happens — training state is never touched before a message
has been verified and decoded.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from aiohttp import web

from node.wire.transport import Transport, refusal
from protocol.errors import NotAuthorized, RemoteProtocolError
from protocol.wire.codec import encode
from protocol.wire.messages import Message
from protocol.wire.signing import Opened, ReplayWindow, Signer, seal, split_sealed

__all__ = ["Handler", "RpcServer", "error_response", "serve_sealed_request"]

log = logging.getLogger(__name__)

Handler = Callable[[Opened], Awaitable[Message]]


def error_response(exc: RemoteProtocolError) -> web.Response:
    """The 4xx reply to a refused request, with the reason as JSON (``transport.refusal``)."""
    return refusal(exc)


async def serve_sealed_request(
    transport: Transport,
    request: web.Request,
    *,
    max_size: int,
    replay: ReplayWindow,
    dispatch: Callable[[Opened], Awaitable[bytes]],
    on_error: Callable[[RemoteProtocolError], None],
    authorize: Callable[[bytes], Awaitable[bool]] | None = None,
) -> web.Response:
    """Read a sealed request body into a pooled buffer, open it against ``replay`` and answer
    with the sealed bytes ``dispatch`` returns. ``authorize`` is asked about the envelope's
    signer right after its signature verifies, before the body is hashed or decoded and before
    it takes a place in ``replay``: a stranger costs one signature check and leaves nothing
    behind. A ``RemoteProtocolError`` on the way (bad bytes, signature, replay, size, refusal,
    or one ``dispatch`` raises) goes to ``on_error`` and becomes a 4xx ``error_response``;
    anything else propagates. The buffer always goes back to the pool."""
    buf: bytearray | None = None
    try:
        buf, used = await transport.read_request(request, max_size)
        envelope, body = split_sealed(memoryview(buf)[:used], max_size=max_size)
        if authorize is not None and not await authorize(envelope.peer_id):
            raise NotAuthorized(f"peer {envelope.peer_id.hex()[:8]} is not a member of this swarm")
        opened = envelope.open_body(body, now=time.time(), replay=replay)
        reply = await dispatch(opened)
        return web.Response(body=reply, content_type="application/octet-stream")
    except RemoteProtocolError as exc:
        on_error(exc)
        return error_response(exc)
    finally:
        if buf is not None:
            transport.pool.give(buf)


async def _anyone(_peer: bytes) -> bool:
    return True


class RpcServer:
    """Serves ``POST /v1/rpc`` on a ``Transport``: verify, authorise, dispatch, reply sealed."""

    def __init__(
        self,
        transport: Transport,
        signer: Signer,
        *,
        max_message: int = 256 << 20,
        authorize: Callable[[bytes], Awaitable[bool]] | None = None,
        replay: ReplayWindow | None = None,
    ) -> None:
        self.transport, self.signer = transport, signer
        self.max_message = max_message
        self.authorize = authorize or _anyone
        self.handlers: dict[type[Message], Handler] = {}
        self.replay = replay or ReplayWindow()
        self.errors: Counter[str] = Counter()
        transport.app.router.add_post("/v1/rpc", self._serve)

    def route(self, kind: type[Message], handler: Handler) -> None:
        if kind in self.handlers:
            raise ValueError(f"a handler for {kind.__name__} is already registered")
        self.handlers[kind] = handler

    def seal_reply(self, msg: Message) -> bytes:
        return seal(encode(msg), self.signer, now=time.time(), nonce=os.urandom(16)).tobytes()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        def refused(exc: RemoteProtocolError) -> None:
            self.errors[type(exc).__name__] += 1
            log.warning("refused request from %s: %s: %s", request.remote, type(exc).__name__, exc.reason)

        return await serve_sealed_request(self.transport, request, max_size=self.max_message,
                                          replay=self.replay, dispatch=self._dispatch, on_error=refused,
                                          authorize=self.authorize)

    async def _dispatch(self, opened: Opened) -> bytes:
        handler = self.handlers.get(type(opened.message))
        if handler is None:
            raise NotAuthorized(f"no handler here for {type(opened.message).__name__}")
        return self.seal_reply(await handler(opened))

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

