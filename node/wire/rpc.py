"""RPC: sealed bytes → verified message → handler → sealed reply.

One explicit table maps message classes to async handlers (no dispatch by method name). A
peer's bad bytes, bad signature, replay, unknown type or oversized body becomes a
``RemoteProtocolError``: the reply is a 4xx with the reason as JSON, the error is counted per
kind and logged, and nothing else happens — training state is never touched before a message
has been verified and decoded.

Requests are addressed: their envelope must name this node as recipient (``NotAuthorized``
otherwise), so one captured on its way to another node cannot be replayed here. Replies are
sealed for the requester.

Big inputs stay off the event loop; three measures, since a member can send any header its
signature covers (numbers: an 8 MiB header of nested empty maps, with torch loaded):

1. A request header is capped per route (``max_header``, default ``MAX_REQUEST_HEADER``),
   checked from the frame prefix before the body is even hashed (``check_header``): requests
   carry tensors as raw blobs, so their headers are small — a Contribution of 3,000 tensors
   (a whole 70B Llama has ~720) or a Store of 64 largest records (~80 KiB) fits. Decoded on the
   loop, the 8 MiB header stalled it 4–5 s; now it is a 413 and ``GET /v1/status`` meanwhile
   answers within ~10 ms.
2. A header over ``OFF_LOOP_HEADER`` is decoded in a worker thread (and a body over
   ``OFF_LOOP_BODY`` hashed in one); the replay window is only ever touched on the loop. A
   thread alone is no cure: msgpack builds objects holding the GIL, and the same 8 MiB header
   in a thread still stopped the loop for over a second.
3. The cyclic GC is paused while any request decodes (``_gc_paused``). Millions of fresh
   containers set off full collections of the node's whole heap (~250 ms each, holding the GIL);
   a decoded header holds no reference cycles, so reference counting frees it all the same.
   With the cap, thread and pause, the worst header under the cap (256 KiB of empty maps)
   leaves ``GET /v1/status`` answering within ~50 ms (~250 ms without the pause).

A request body is capped by what the swarm's fragment plan can need (``max_rpc_body``): the
largest fragment as the widest message a member sends (a ReplicaState of fp32 theta and momentum,
8 bytes an element; a Contribution in any codec takes at most 5), plus the header cap, the
envelope and slack. A fixed 256 MiB let an open-swarm member that sends the bytes fill 16 GiB of
buffers on a peer of a small model; a body declaring more than the cap is a 413 before a byte of
it is buffered.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from node.wire.bodies import REQUEST_BODY, RequestBody
from node.wire.transport import Transport, refusal
from protocol.errors import NotAuthorized, Oversize, RemoteProtocolError
from protocol.wire.codec import Buffer, encode, header_length
from protocol.wire.messages import Message
from protocol.wire.sealing import LENGTH_PREFIX, MAX_ENVELOPE
from protocol.wire.signing import (
    Admitted,
    Envelope,
    Opened,
    ReplayWindow,
    Signer,
    envelope_length,
    message_digests,
    open_envelope,
    seal,
    split_sealed,
)
from protocol.wire.tensors import CODECS, TOPK_CHUNK, payload_bytes

__all__ = [
    "MAX_REQUEST_HEADER",
    "OFF_LOOP_BODY",
    "OFF_LOOP_HEADER",
    "Handler",
    "RpcServer",
    "check_header",
    "error_response",
    "max_rpc_body",
    "open_off_loop",
    "serve_sealed_request",
]

MAX_REQUEST_HEADER = 256 << 10  # msgpack header bytes of one request (the wire's own cap is 8 MiB)
OFF_LOOP_HEADER = 64 << 10  # headers above this are decoded in a worker thread
OFF_LOOP_BODY = 1 << 20  # bodies above this are hashed in a worker thread (blake3 drops the GIL)

# Bytes an element of the widest single tensor any codec makes (int8 with one fp32 scale an
# element: 5), and of the widest message: a ReplicaState carrying fp32 theta and momentum (8).
_WIDEST_CODEC = (
    max(sum(payload_bytes(c, TOPK_CHUNK, 0 if c in ("none", "bf16") else 1)) for c in CODECS)
    / TOPK_CHUNK
)
WIDEST_BYTES_PER_ELEMENT = max(2 * payload_bytes("none", 1, 0)[0], _WIDEST_CODEC)
RPC_SLACK = (
    1 << 20
)  # and 1/64 of the tensor bytes: msgpack framing of blobs, a few small tensors' rounding

log = logging.getLogger(__name__)


def max_rpc_body(numels: Iterable[int], *, max_header: int = MAX_REQUEST_HEADER) -> int:
    """The largest legitimate ``POST /v1/rpc`` body in a swarm whose fragments hold ``numels``
    elements: the largest fragment at ``WIDEST_BYTES_PER_ELEMENT``, plus a header of up to
    ``max_header`` bytes, the length prefix and envelope, and ``RPC_SLACK`` (see the module docstring)."""
    tensors = math.ceil(WIDEST_BYTES_PER_ELEMENT * max(numels, default=0))
    return tensors + tensors // 64 + max_header + LENGTH_PREFIX.size + MAX_ENVELOPE + RPC_SLACK


Handler = Callable[[Opened], Awaitable[Message]]


def error_response(exc: RemoteProtocolError) -> web.Response:
    """The 4xx reply to a refused request, with the reason as JSON (``transport.refusal``)."""
    return refusal(exc)


def check_header(body: Buffer, max_header: int) -> int:
    """The header length ``body``'s frame prefix declares; raises Oversize over ``max_header``
    and DecodeError on a bad prefix. Costs no hash and no decode."""
    n = header_length(body)
    if n > max_header:
        raise Oversize(
            f"message header of {n} bytes exceeds this route's cap of {max_header} "
            "(tensors travel as blobs, not in the header)"
        )
    return n


async def open_off_loop(
    envelope: Envelope,
    body: memoryview,
    *,
    replay: ReplayWindow,
    expected_recipient: bytes | None = None,
) -> Opened:
    """``envelope.open_body`` with the body hashed in a worker thread above ``OFF_LOOP_BODY``
    bytes and the header decoded in one above ``OFF_LOOP_HEADER`` bytes; ``replay`` is checked
    here, on the loop, with the time after hashing. Raises as ``Envelope.open_body``. If the
    caller is cancelled meanwhile, a thread may still read ``body``: do not reuse its buffer."""
    digests = None
    if body.nbytes > OFF_LOOP_BODY:
        digests = await asyncio.to_thread(message_digests, body)
    admitted = envelope.admit(
        body, now=time.time(), replay=replay, expected_recipient=expected_recipient, digests=digests
    )
    if header_length(body) > OFF_LOOP_HEADER:
        return await asyncio.to_thread(_decode, admitted)
    return _decode(admitted)


def _decode(admitted: Admitted) -> Opened:
    """``admitted.decode()`` with the cyclic GC paused (see the module docstring)."""
    with _gc_paused:
        return admitted.decode()


class _GcPause:
    """Pauses the cyclic GC while any decode runs, on the loop or in worker threads alike; the
    last one out restores what it found."""

    def __init__(self) -> None:
        self._lock, self._running, self._resume = threading.Lock(), 0, False

    def __enter__(self) -> None:
        with self._lock:
            if self._running == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._running += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0 and self._resume:
                gc.enable()


_gc_paused = _GcPause()


async def serve_sealed_request(
    transport: Transport,
    request: web.Request,
    *,
    max_size: int,
    replay: ReplayWindow,
    recipient: bytes,
    dispatch: Callable[[Opened], Awaitable[bytes]],
    on_error: Callable[[RemoteProtocolError], None],
    authorize: Callable[[bytes], Awaitable[bool]] | None = None,
    max_header: int = MAX_REQUEST_HEADER,
    broadcast: tuple[type[Message], ...] = (),
) -> web.Response:
    """Read a sealed request body into a pooled buffer, open it against ``replay`` and answer
    with the sealed bytes ``dispatch`` returns. Right after the envelope's signature verifies,
    before the body is hashed or decoded and before it takes a place in ``replay``: the
    envelope must name ``recipient`` (this node's peer id; a message of a ``broadcast`` type may
    name nobody instead, e.g. the DHT's first Ping to an address whose peer is not known yet),
    ``authorize`` is asked about its signer, and the header must fit ``max_header``; a stranger
    costs one signature check and leaves nothing behind. Large bodies and headers are handled off
    the loop (``open_off_loop``). A ``RemoteProtocolError`` on the way (bad bytes, signature,
    recipient, replay, size, refusal, or one ``dispatch`` raises) goes to ``on_error`` and
    becomes a 4xx ``error_response``; anything else propagates. The buffer goes back to the pool
    unless the request was cancelled (a worker thread may still be reading it), once no view a
    handler kept of it (``REQUEST_BODY``) is alive."""

    async def admit(envelope: Envelope) -> None:
        envelope.check_recipient(recipient, broadcast_ok=bool(broadcast))
        if authorize is not None and not await authorize(envelope.peer_id):
            raise NotAuthorized(f"peer {envelope.peer_id.hex()[:8]} is not a member of this swarm")

    async def head(wire: memoryview) -> int | None:
        # a large body's envelope, checked as soon as it is in: a stranger, a message for another
        # node or a forged signature is refused before the rest costs a buffer
        if wire.nbytes < LENGTH_PREFIX.size or wire.nbytes < (
            end := LENGTH_PREFIX.size + envelope_length(wire)
        ):
            return None
        envelope = open_envelope(wire[LENGTH_PREFIX.size : end], max_size=max_size)
        await admit(envelope)
        return end + envelope.size

    buf: bytearray | None = None
    held: RequestBody | None = None
    try:
        buf, used = await transport.read_request(request, max_size, on_head=head)
        held = RequestBody(transport.pool, buf, asyncio.get_running_loop())
        REQUEST_BODY.set(held)  # this request's own task and the threads it starts see it
        envelope, body = split_sealed(memoryview(buf)[:used], max_size=max_size)
        await admit(envelope)
        check_header(body, max_header)
        opened = await open_off_loop(envelope, body, replay=replay)
        transport.name_kind(request, type(opened.message).__name__)
        if not opened.recipient and not isinstance(opened.message, broadcast):
            raise NotAuthorized(f"a {type(opened.message).__name__} must name its recipient")
        reply = await dispatch(opened)
        return web.Response(body=reply, content_type="application/octet-stream")
    except RemoteProtocolError as exc:
        on_error(exc)
        return error_response(exc)
    except asyncio.CancelledError:
        buf = None
        raise
    finally:
        if held is not None and buf is not None:
            held.end()  # the buffer goes back now, or once a view a handler kept of it is collected
        elif buf is not None:
            transport.pool.give(buf)


async def _anyone(_peer: bytes) -> bool:
    return True


class RpcServer:
    """Serves ``POST /v1/rpc`` on a ``Transport``: verify, authorise, dispatch, reply sealed.
    ``max_message``: the largest body taken (a node passes ``max_rpc_body`` of its fragment
    plan; 256 MiB otherwise)."""

    def __init__(
        self,
        transport: Transport,
        signer: Signer,
        *,
        max_message: int = 256 << 20,
        authorize: Callable[[bytes], Awaitable[bool]] | None = None,
        replay: ReplayWindow | None = None,
        max_header: int = MAX_REQUEST_HEADER,
    ) -> None:
        self.transport, self.signer = transport, signer
        self.max_message, self.max_header = max_message, max_header
        self.authorize = authorize or _anyone
        self.handlers: dict[type[Message], Handler] = {}
        self.replay = replay or ReplayWindow(salt=os.urandom(16))
        self.errors: Counter[str] = Counter()
        transport.app.router.add_post("/v1/rpc", self._serve)

    def route(self, kind: type[Message], handler: Handler) -> None:
        if kind in self.handlers:
            raise ValueError(f"a handler for {kind.__name__} is already registered")
        self.handlers[kind] = handler

    def seal_reply(self, msg: Message, recipient: bytes = b"") -> bytes:
        """``msg`` sealed by this node for ``recipient`` (the requester's peer id)."""
        return seal(
            encode(msg), self.signer, now=time.time(), nonce=os.urandom(16), recipient=recipient
        ).tobytes()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        def refused(exc: RemoteProtocolError) -> None:
            self.errors[type(exc).__name__] += 1
            log.warning(
                "refused request from %s: %s: %s", request.remote, type(exc).__name__, exc.reason
            )

        return await serve_sealed_request(
            self.transport,
            request,
            max_size=self.max_message,
            replay=self.replay,
            recipient=self.signer.peer_id,
            dispatch=self._dispatch,
            on_error=refused,
            authorize=self.authorize,
            max_header=self.max_header,
        )

    async def _dispatch(self, opened: Opened) -> bytes:
        handler = self.handlers.get(type(opened.message))
        if handler is None:
            raise NotAuthorized(f"no handler here for {type(opened.message).__name__}")
        return self.seal_reply(await handler(opened), opened.peer_id)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())
