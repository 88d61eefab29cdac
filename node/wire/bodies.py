"""Request and reply bodies in memory: pooled buffers and reading a body into one.

Bodies travel in chunks of at most ``CHUNK`` bytes and are read into pooled buffers, so a
fragment of hundreds of MB is never concatenated or copied twice (fresh memory is slow to fill
on small machines: on the 2-core box a 25 MB body read into a fresh buffer grown by doubling
cost ~25x one read into a pooled buffer). The pool keeps what a peer's busiest moment used, up
to ``POOL_MAX_BYTES``, dropping its smallest buffers first. A declared length is a claim, not a
reason to allocate: a buffer grows with the bytes that actually arrive. A small body gets a small
buffer (at least ``MIN_BUFFER``): an owner of a small model holds one buffer per contribution in
flight, and at 1 MiB each its pool's high-water mark grew by ~10 MiB in one burst of 24. A
piece under ``SMALL_PIECE`` bytes (a chunked body of 1-byte chunks) takes what is buffered behind
it along, and other tasks run before the next: read one by one, 6 MB of them held the loop 12 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
import weakref
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

import aiohttp

from node.config import LARGE_MODEL_BYTES
from node.wire.direct import DIRECT_MIN, Socket, read_direct
from protocol.errors import Oversize, RemoteProtocolError

__all__ = [
    "CHUNK",
    "MIN_BUFFER",
    "POOL_BUFFERS",
    "POOL_MAX_BUFFER",
    "POOL_MAX_BYTES",
    "REQUEST_BODY",
    "pool_bytes_for_model",
    "BodyTimeout",
    "BufferPool",
    "ClientGone",
    "RequestBody",
    "keep_while_viewed",
    "read_stream",
    "unfilled",
]

CHUNK = 1 << 20
# a piece of a body under SMALL_PIECE bytes takes what else is buffered along, up to COALESCE bytes
SMALL_PIECE = 4 << 10
COALESCE = 16 << 10
MIN_BUFFER = 64 << 10  # the smallest buffer made: a body of a few bytes and one of 60 KiB share it
# What the buffer pool keeps for reuse: never a buffer above POOL_MAX_BUFFER, at most
# POOL_BUFFERS buffers and POOL_MAX_BYTES in all (a peer that once received a huge body does not
# hold it forever). A peer of a 4 x 50M swarm has ~8-16 bodies of 25 MB in flight at its busiest
# (its learner's fetches, its owned fragments' contributions, a replica state): they all fit.
POOL_MAX_BUFFER = 256 << 20
POOL_MAX_BYTES = 512 << 20
POOL_BUFFERS = 32
# A large model (``node.config.LARGE_MODEL_BYTES``) has its pool capped at 1/MODEL_SHARE of its
# fp32 bytes. Its bodies arrive over links (a 113 MB fragment in ~9 s at 100 Mbit/s) far slower
# than a fresh buffer's page faults (~55 ms for it here), and at 124M parameters a pool of
# 512 MiB was a whole model's bytes held beside everything else (docs/scale.md)
MODEL_SHARE = 16


def _bytearray_from_c() -> Callable[[None, int], bytearray] | None:
    """CPython's ``PyByteArray_FromStringAndSize``, which leaves a new bytearray's bytes as
    malloc gave them when passed no string (None elsewhere than CPython)."""
    api = getattr(ctypes, "pythonapi", None)
    if api is None or not hasattr(api, "PyByteArray_FromStringAndSize"):
        return None
    make = api.PyByteArray_FromStringAndSize
    make.restype, make.argtypes = ctypes.py_object, (ctypes.c_char_p, ctypes.c_ssize_t)
    return make  # type: ignore[no-any-return]


_BYTEARRAY_FROM_C = _bytearray_from_c()


def unfilled(size: int) -> bytearray:
    """A new bytearray of ``size`` bytes whose contents are whatever its memory held: a body's
    bytes overwrite it before anything reads it, and ``bytearray(size)`` zeroed every received
    byte once more (2 % of a 4 x 124M averaging round's CPU, and the page faults of a fresh
    buffer taken before the socket's bytes arrive). What a pooled buffer held is no secret
    either: only ``[:used]`` of a body is ever read."""
    if _BYTEARRAY_FROM_C is None:
        return bytearray(size)
    return _BYTEARRAY_FROM_C(None, size)


def pool_bytes_for_model(model_bytes: int) -> int:
    """What a peer's pool keeps for a model of ``model_bytes`` fp32 bytes: ``POOL_MAX_BYTES`` for
    a small one, a 1/``MODEL_SHARE`` of the model from ``LARGE_MODEL_BYTES`` on (never more)."""
    if model_bytes < LARGE_MODEL_BYTES:
        return POOL_MAX_BYTES
    return min(POOL_MAX_BYTES, model_bytes // MODEL_SHARE)


# Buffers that a live view still shows (id -> views): never handed out again, so no later body is
# read into memory a view shows; each is freed with its last reference instead of being pooled.
_VIEWED: dict[int, int] = {}
_VIEWED_LOCK = threading.Lock()


def keep_while_viewed(buf: bytearray, view: object) -> None:
    """``view`` (a weak-referenceable object over ``buf``'s bytes that lives as long as anything
    shows them, e.g. the numpy array a tensor was made from) keeps ``buf`` out of every pool
    until it is collected: a pool given ``buf`` meanwhile drops it instead of reusing it (a
    learner adopting a verified version straight from the reply it arrived in, no copy)."""
    key = id(buf)
    with _VIEWED_LOCK:
        _VIEWED[key] = _VIEWED.get(key, 0) + 1
    weakref.finalize(view, _unview, key)


def _unview(key: int) -> None:
    with _VIEWED_LOCK:
        left = _VIEWED.pop(key, 1) - 1
        if left > 0:
            _VIEWED[key] = left


def _viewed(buf: bytearray) -> bool:
    with _VIEWED_LOCK:
        return id(buf) in _VIEWED


class BodyTimeout(RemoteProtocolError):
    """A request body that stopped arriving, or did not arrive in time."""

    status = 408


class ClientGone(RemoteProtocolError):
    """The sender went away, or ended the body before its declared length."""


class BufferPool:
    """Reusable bytearrays, so receiving a fragment does not fault in fresh memory each time.

    It keeps at most ``max_buffers`` buffers of at most ``max_buffer`` bytes each and
    ``max_bytes`` in all; beyond that its smallest buffers are dropped (and their memory freed):
    a large buffer is the costly one to fill afresh."""

    def __init__(
        self,
        max_buffers: int = POOL_BUFFERS,
        *,
        max_buffer: int = POOL_MAX_BUFFER,
        max_bytes: int = POOL_MAX_BYTES,
    ) -> None:
        self._free: list[bytearray] = []
        self._max, self.max_buffer, self.max_bytes = max_buffers, max_buffer, max_bytes
        self.held = 0  # bytes kept for reuse

    def bound(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` from now on (what is kept beyond it is dropped now)."""
        self.max_bytes = max_bytes
        self._drop_excess()

    def take(self, size: int, *, fresh: int | None = None) -> bytearray:
        """The smallest pooled buffer of at least ``size`` bytes. If none: with ``fresh`` (the
        caller grows the buffer as bytes arrive), the largest pooled one of at least
        ``min(size, fresh)`` bytes, else a new one of that many; without, a new one of ``size``
        bytes. A new buffer has at least ``MIN_BUFFER`` bytes."""
        want = size if fresh is None else min(size, fresh)
        best = min((b for b in self._free if len(b) >= size), key=len, default=None)
        if best is None:
            best = max((b for b in self._free if len(b) >= want), key=len, default=None)
        if best is None:
            return unfilled(max(want, MIN_BUFFER))
        self._free.remove(best)
        self.held -= len(best)
        return best

    def give(self, buf: bytearray) -> None:
        if len(buf) > self.max_buffer or _viewed(buf):  # a viewed one is freed with its views
            return
        self._free.append(buf)
        self.held += len(buf)
        self._drop_excess()

    def _drop_excess(self) -> None:
        while len(self._free) > self._max or self.held > self.max_bytes:
            smallest = min(self._free, key=len)
            self._free.remove(smallest)
            self.held -= len(smallest)

    def grow(self, buf: bytearray, used: int, need: int, limit: int) -> bytearray:
        """A buffer of at least ``need`` bytes holding ``buf[:used]`` (``buf`` is given back):
        double the size, but never beyond ``limit``."""
        grown = self.take(min(max(need, 2 * len(buf)), limit))
        grown[:used] = memoryview(buf)[:used]
        self.give(buf)
        return grown


class RequestBody:
    """The pooled buffer a request's body was read into, seen by its handler through
    ``REQUEST_BODY``. A handler that keeps a view of the body past its reply (an owner merging a
    contribution's fp32 tensors where they arrived instead of copying them) lets the view hold
    the buffer: it goes back to the pool once the request has ended *and* the view has been
    collected, so no later body is read into memory a view still shows."""

    def __init__(self, pool: BufferPool, buf: bytearray, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.buf, self.loop = pool, buf, loop
        self._holders = 1  # the request itself
        self._kept = self._ended = False
        self._lock = threading.Lock()  # a view may be made, or collected, in a worker thread

    def keep_for(self, view: object) -> bool:
        """Let ``view`` hold the buffer: a weak-referenceable object over this body's bytes that
        lives as long as anything shows them (the numpy array a tensor was made from, which its
        storage, and so every slice of it, keeps alive). False when another view holds it already
        (one per body: the caller copies instead) or the request has ended (a task it started
        still sees this body in its context)."""
        with self._lock:
            if self._kept or self._ended:
                return False
            self._kept, self._holders = True, self._holders + 1
        weakref.finalize(view, self._release_from_any_thread)
        return True

    def end(self) -> None:
        """The request has ended (on the event loop): the buffer goes back unless a view holds it."""
        with self._lock:
            self._ended = True
        self.release()

    def release(self) -> None:
        """One holder is done (on the event loop): the last one gives the buffer back."""
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self.pool.give(self.buf)

    def _release_from_any_thread(self) -> None:
        with contextlib.suppress(
            RuntimeError
        ):  # a closed loop: the buffer is simply freed with the view
            self.loop.call_soon_threadsafe(self.release)


REQUEST_BODY: ContextVar[RequestBody | None] = ContextVar("atoll_request_body", default=None)


async def read_stream(
    content: aiohttp.StreamReader,
    length: int | None,
    max_size: int,
    pool: BufferPool,
    *,
    timeout_s: float | None = None,
    idle_s: float | None = None,
    on_head: Callable[[memoryview], Awaitable[int | None]] | None = None,
    head_timeout_s: float | None = None,
    socket: Socket | None = None,
    length_vouched: bool = False,
) -> tuple[bytearray, int]:
    """Read a body into a pooled buffer; return (buffer, used bytes). Caller gives it back.

    The buffer grows as bytes arrive (a declared length is only an upper bound). Raises
    ``Oversize`` as soon as the body (declared or actual) exceeds ``max_size``; ``BodyTimeout``
    when no chunk arrives for ``idle_s`` or the whole body takes longer than ``timeout_s``
    (None: no limit); ``ClientGone`` for a body that ends before its declared length.

    ``on_head``: while more of the body is still to come, called with the bytes so far until it
    returns the body's whole length as its head declares it (None: not enough yet); it raises to
    refuse the body before the rest of it is read, and the body may then be no longer than it
    said (nor, with a declared ``length``, shorter: ``Oversize`` at once). ``head_timeout_s``:
    how long the head may take, its say included (None: ``timeout_s`` only), so that a large
    declared length buys the sender no time until its head vouches for it (``BodyTimeout``). A
    body that arrives whole in its first chunks is not shown to it.

    ``socket``: the connection the body arrives on. A body of a declared length with at least
    ``DIRECT_MIN`` bytes still to come once ``on_head`` (if any) has vouched for it is read from
    there on straight off the socket into the buffer (``node.wire.direct``), and the connection
    is spent: ``socket.spent`` is called, and the caller closes it. Its buffer then takes the
    whole length at once when the length is vouched for: by ``on_head`` (a member's signed
    envelope naming this node), or by the caller (``length_vouched``: a reply to a request of
    ours, under its ``max_size``); else it grows with the bytes that arrive.
    """
    if length is not None and length > max_size:
        raise Oversize(f"body of {length} bytes exceeds the cap of {max_size}")
    limit = max_size if length is None else length
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    head_deadline = (
        None if on_head is None or head_timeout_s is None else loop.time() + head_timeout_s
    )
    buf = pool.take(limit, fresh=CHUNK)
    used, handed = 0, False
    vouched = length_vouched or on_head is not None
    try:
        while True:
            # until the head has vouched for the body's length, the head's deadline binds too
            by_head = (
                on_head is not None
                and head_deadline is not None
                and (deadline is None or head_deadline < deadline)
            )
            until = head_deadline if by_head else deadline
            left = None if until is None else max(until - loop.time(), 0.0)
            by_idle = idle_s is not None and (left is None or idle_s <= left)
            wait = idle_s if by_idle else left
            try:
                async with asyncio.timeout(wait):
                    # the next piece as it arrived: read(n) would join pieces, one more copy
                    chunk, boundary = await content.readchunk()
            except TimeoutError:
                if by_idle:
                    raise BodyTimeout(_stalled(used, length, wait, whole=False)) from None
                if by_head:
                    raise BodyTimeout(
                        f"request body's head not complete after {head_timeout_s:.1f} s ({used} bytes "
                        "arrived): a body has no more time than a small one until its head is in"
                    ) from None
                raise BodyTimeout(_stalled(used, length, timeout_s, whole=True)) from None
            if not chunk:
                # the end of one chunk of a chunked body: more may follow. aiohttp's shared empty
                # body (a 204's) answers (b"", True) for ever once read: it is at its end
                if boundary and not content.at_eof():
                    continue
                break
            # tiny pieces (a chunked body of 1-byte chunks) cost ~12 us each read one by one, and the
            # loop ran them back to back while any were buffered (6 MB of 1-byte chunks: 12 s, stalls
            # of 1.2 s): what is buffered now comes along joined, then other tasks run. (A stand-in
            # reader without ``read_nowait`` is read piece by piece.)
            read_nowait = (
                getattr(content, "read_nowait", None) if len(chunk) < SMALL_PIECE else None
            )
            if read_nowait is not None and (more := read_nowait(COALESCE)):
                chunk += more
                await asyncio.sleep(0)
            end = used + len(chunk)
            if end > limit:
                raise Oversize(
                    f"body exceeds {'its declared length' if length is not None else 'the cap'} "
                    f"of {limit} bytes"
                )
            if end > len(buf):
                buf = pool.grow(buf, used, end, limit)
            buf[used:end] = chunk
            used = end
            if on_head is not None and (length is None or used < length):
                with (
                    memoryview(buf) as whole,
                    whole[:used] as head,
                ):  # released before the buffer grows
                    declared = await on_head(head)
                if declared is not None:
                    on_head = None
                    if length is not None and declared != length:
                        raise Oversize(
                            f"body of {length} bytes by its Content-Length but {declared} by its head "
                            "(the sealed message's envelope): refused before the rest is read"
                        )
                    if declared > limit or declared < used:
                        raise Oversize(
                            f"body of {declared} bytes by its head does not fit the {limit} allowed "
                            f"with {used} arrived"
                        )
                    limit = declared
            if (
                socket is not None
                and on_head is None
                and length is not None
                and length - used >= DIRECT_MIN
            ):
                handed = True  # read_direct gives it back if it fails

                def timed_out(got: int, whole: bool) -> BaseException:
                    return BodyTimeout(
                        _stalled(got, length, timeout_s if whole else idle_s, whole=whole)
                    )

                buf, used = await read_direct(
                    socket,
                    content,
                    buf,
                    used,
                    length,
                    pool,
                    deadline=deadline,
                    idle_s=idle_s,
                    on_timeout=timed_out,
                    whole=vouched,
                )
                handed = False
                break
        if length is not None and used != length:
            raise ClientGone(f"body ended after {used} of {length} declared bytes")
    except BaseException:
        if not handed:
            pool.give(buf)
        raise
    return buf, used


def _stalled(got: int, length: int | None, limit_s: float | None, *, whole: bool) -> str:
    declared = f" of {length} declared" if length is not None else ""
    if whole:
        return f"request body not complete after {limit_s:.1f} s ({got}{declared} bytes arrived)"
    return f"request body stalled: {got}{declared} bytes arrived, then nothing for {limit_s:.1f} s"
