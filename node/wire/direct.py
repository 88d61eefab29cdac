"""A large body's bulk read straight off its socket into the body's buffer.

aiohttp hands a body over as ``bytes`` objects: the socket is read into a new object of up to
256 KiB, its C parser copies the body's part of it into another, and ``read_stream`` copies that
into the pooled buffer: two copies in user space of every byte received, about as much CPU as
the kernel's own copy (a 4 x 50M averaging round receives 1.2 GB). Once a body's length is known
and vouched for (``read_stream`` decides when), ``read_direct`` takes what aiohttp has parsed
already and then swaps the connection's protocol for a ``_Sink``, an ``asyncio.BufferedProtocol``
that the event loop's transport reads the rest into with ``recv_into``, straight into the buffer.

aiohttp's parser never sees those bytes, so its idea of where the body ends is wrong from then on:
the connection must not carry another message. The sink therefore stays in place for the rest of
the connection's life (aiohttp's protocol gets no byte again, so nothing after the body can be
parsed as a request or reply), it drops what follows the body (and stops reading after a little
of it), it passes the transport's
other events (write flow control, end of stream, the connection lost) to the protocol it
replaced, and ``Socket.spent`` is called so the caller closes the connection (the server after
its reply; the client at once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.errors import Oversize

if TYPE_CHECKING:
    import aiohttp

    from node.wire.bodies import BufferPool

__all__ = ["DIRECT_MIN", "Gone", "Socket", "read_direct"]

# Bodies with less than this left to read stay on aiohttp's path, and their connection alive: a
# direct read costs the next message a new connection (one round trip, and a TLS handshake).
DIRECT_MIN = 8 << 20
_SPARE = 64 << 10
# Bytes past a body are read and dropped up to this (a stray CRLF; a reply that is still being
# written must not meet a reset), then reading stops until the connection closes.
_DROP_MAX = 1 << 20


@dataclass(frozen=True, slots=True)
class Socket:
    """The connection a body arrives on. ``spent`` is called once a direct read has ended
    (whichever way): the caller must not let the connection carry another message."""

    transport: asyncio.BaseTransport
    spent: Callable[[], None]


class Gone(ConnectionError):
    """The sender ended the stream, or the connection was lost, before the body was in."""


class _Sink(asyncio.BufferedProtocol):
    """Reads into ``target[:end]`` from ``got`` on; pauses the transport while the target is full
    (the reader grows it); passes other events to the protocol it replaced."""

    def __init__(
        self, transport: Any, replaced: Any, target: bytearray, got: int, end: int
    ) -> None:
        self.transport, self.replaced = transport, replaced
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()  # when bytes last arrived
        self.error: BaseException | None = None
        self.dropped = 0  # bytes read past the body
        self._waiter: asyncio.Future[None] | None = None
        self._spare: bytearray | None = None
        self.retarget(target, got, end)

    def retarget(self, target: bytearray, got: int, end: int) -> None:
        self.target, self.got, self.end = memoryview(target), got, end

    def detach(self) -> None:
        """The reader is done with the target (whichever way): no byte goes into it again (the
        caller closes the connection)."""
        self.target.release()
        self.target, self.end = memoryview(b""), self.got

    @property
    def room(self) -> int:
        return min(len(self.target), self.end) - self.got

    # --- the transport's calls --------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self.room > 0:
            return self.target[self.got : min(len(self.target), self.end)]
        if self._spare is None:  # a read already under way when we paused: its bytes are dropped
            self._spare = bytearray(_SPARE)
        return self._spare

    def buffer_updated(self, nbytes: int) -> None:
        if (
            self.room <= 0
        ):  # past the body: dropped, and no more read once that is more than a little
            self.dropped += nbytes
            if self.dropped > _DROP_MAX:
                self.transport.pause_reading()
            return
        self.got += nbytes
        self.last = self.loop.time()
        if self.room <= 0:
            if self.got < self.end:
                self.transport.pause_reading()  # until the reader has grown the target
            self._wake()

    def eof_received(self) -> bool | None:
        self._fail(Gone("the sender ended the stream before the body was in"))
        return self.replaced.eof_received()  # type: ignore[no-any-return]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(
            Gone(
                f"connection lost before the body was in: {exc!r}"
                if exc
                else "connection closed before the body was in"
            )
        )
        self.replaced.connection_lost(exc)

    def pause_writing(self) -> None:
        self.replaced.pause_writing()

    def resume_writing(self) -> None:
        self.replaced.resume_writing()

    # --- the reader's side ------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.error is None and self.got < self.end:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout_s: float | None) -> None:
        """Until the target is full, the body is in, the stream failed, or ``timeout_s`` passed."""
        if self.room <= 0 or self.error is not None:
            return
        self._waiter = self.loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._waiter
        except TimeoutError:
            pass
        finally:
            self._waiter = None


async def read_direct(
    sock: Socket,
    content: aiohttp.StreamReader,
    buf: bytearray,
    used: int,
    length: int,
    pool: BufferPool,
    *,
    deadline: float | None,
    idle_s: float | None,
    on_timeout: Callable[[int, bool], BaseException],
    whole: bool = False,
) -> tuple[bytearray, int]:
    """Read the rest of a body of ``length`` bytes into ``buf`` (``used`` bytes in so far; grown
    from ``pool`` as bytes arrive, never beyond ``length``): first what aiohttp has parsed, then
    straight off the socket. ``whole``: the length is vouched for (see ``read_stream``), so the
    buffer is grown to it once before the socket is read, not doubled as bytes arrive: at 124M
    parameters no pooled buffer holds a fragment, and doubling from 1 MiB cost 7 copies and
    fresh buffers, ~40 ms of CPU more per 124 MB body than one buffer of its size. Returns (buffer, used); ``used`` < ``length`` only when aiohttp's
    reader had ended the body early. Raises ``Gone`` (a ``ConnectionError``, as aiohttp's reader
    raises) when the stream ends or the connection is lost first, ``Oversize`` if aiohttp's
    reader holds more than ``length``, or ``on_timeout(got, whole)`` past ``deadline`` (loop time;
    ``whole``) or ``idle_s`` without a byte. ``sock.spent`` is called once the socket was read from."""
    holder = [buf]  # the buffer in use: given back here if the read fails
    try:
        return await _read(
            sock, content, holder, used, length, pool, deadline, idle_s, on_timeout, whole
        )
    except BaseException:
        pool.give(holder[0])
        raise


async def _read(
    sock: Socket,
    content: aiohttp.StreamReader,
    holder: list[bytearray],
    used: int,
    length: int,
    pool: BufferPool,
    deadline: float | None,
    idle_s: float | None,
    on_timeout: Callable[[int, bool], BaseException],
    whole: bool,
) -> tuple[bytearray, int]:
    while True:  # what aiohttp parsed already (at most its reader's high-water mark)
        more = content.read_nowait(-1)
        if not more:
            break
        end = used + len(more)
        if end > length:
            raise Oversize(f"body exceeds its declared length of {length} bytes")
        if end > len(holder[0]):
            holder[0] = pool.grow(holder[0], used, end, length)
        holder[0][used:end] = more
        used = end
    transport: Any = sock.transport
    if used >= length or content.is_eof() or transport.is_closing():
        return holder[0], used
    loop = asyncio.get_running_loop()
    if whole and len(holder[0]) < length:
        holder[0] = pool.grow(holder[0], used, length, length)
    elif used == len(holder[0]):
        holder[0] = pool.grow(holder[0], used, used + 1, length)
    sink = _Sink(transport, transport.get_protocol(), holder[0], used, length)
    transport.set_protocol(sink)
    try:
        if not transport.is_reading():
            transport.resume_reading()  # aiohttp pauses while its reader is over its high-water mark
        while sink.got < length and sink.error is None:
            if sink.room <= 0:  # the buffer is full: a larger one, then read on
                holder[0] = pool.grow(holder[0], sink.got, sink.got + 1, length)
                sink.retarget(holder[0], sink.got, length)
                transport.resume_reading()
                continue
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise on_timeout(sink.got, True)
            if idle_s is not None and now - sink.last >= idle_s:
                raise on_timeout(sink.got, False)
            waits = [
                t
                for t in (
                    None if deadline is None else deadline - now,
                    None if idle_s is None else sink.last + idle_s - now,
                )
                if t is not None
            ]
            await sink.wait(min(waits) if waits else None)
        if sink.error is not None:
            raise sink.error
        return holder[0], sink.got
    finally:
        sink.detach()
        sock.spent()
