"""HTTP transport: one aiohttp server, one client session, size caps, link emulation.

``Transport`` turns HTTP into bytes and back and nothing more: ``rpc`` decides what the bytes
mean. Bodies travel in chunks of at most ``CHUNK`` bytes and are read into pooled buffers, so a
fragment of hundreds of MB is never concatenated or copied twice (fresh memory is slow to fill
on small machines). The server binds port 0 and announces the real port only once bound.

Refusing is cheap (``ServeLimits``). A declared ``Content-Length`` is a claim, not a reason to
allocate: a body's buffer grows with the bytes that actually arrive (a pooled buffer is reused
when one is large enough), and the pool keeps no huge buffer. A body must keep arriving (an idle
timeout between chunks) and be complete within an overall timeout that grows with its declared
size; a sender that stalls gets a 408 and its connection is closed. Each address may have only
a few bodies being read at once (429 beyond), header lines and fields are bounded, and a
``RemoteProtocolError`` raised by any route becomes a 4xx with a JSON reason, never a 500.

Connections are counted before anything is parsed. The server runs its own accept loop
(``_GatedSite``): each accepted socket is counted under its remote address (an IPv6 address by
its /64) before a TLS handshake or an HTTP byte is read. Beyond ``conns_per_ip`` for that
address or ``conns`` in all, the oldest connection there without a request in progress is
closed to make room, and the newcomer is reset only when there is none (see ``Connections``).
An admitted socket gets a ``_Gate`` in front of aiohttp's request handler, which gives up its
place when the connection closes (whichever way) and holds a header deadline: the first
request head (TLS handshake included) must be complete within ``head_timeout_s`` of the
accept, and every later one within ``head_timeout_s`` of its first byte, or the connection
gets a 408 and is closed. Between requests an idle keep-alive connection is closed after
``keepalive_s``.

Kernel traffic shaping is not available on every machine, so ``LinkEmulator`` adds latency,
a bandwidth cap and a drop rate to this node's outbound requests, per destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import random
import socket
import ssl
import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from node.wire.tls import PinnedKey, client_context, origin
from protocol.errors import Oversize, RemoteProtocolError

__all__ = [
    "CHUNK", "BodyTimeout", "BufferPool", "Busy", "ClientGone", "Connections", "LinkDropped", "LinkEmulator",
    "LinkProfile", "ServeLimits", "Transport", "address_key", "refusal", "read_stream",
]

log = logging.getLogger(__name__)

CHUNK = 1 << 20
# What the buffer pool keeps for reuse: never a buffer above POOL_MAX_BUFFER, at most
# POOL_MAX_BYTES in all (a peer that once received a huge body does not hold it forever).
POOL_MAX_BUFFER = 64 << 20
POOL_MAX_BYTES = 128 << 20
# Reading a request body: it must be complete within BODY_TIMEOUT_S plus BODY_SLACK_S_PER_MIB
# per declared MiB (so a 256 MiB body may take ~5 min, i.e. ~1 MiB/s), and no gap between two
# chunks may exceed BODY_IDLE_S.
BODY_TIMEOUT_S = 30.0
BODY_SLACK_S_PER_MIB = 1.0
BODY_IDLE_S = 10.0
# Request bodies being read at once, per sender address and in all.
MAX_BODIES_PER_IP = 8
MAX_BODIES = 64
# Request line / header field sizes and count (aiohttp's defaults, named), and how long an idle
# keep-alive connection stays open (aiohttp's default is an hour).
MAX_LINE_SIZE = 8190
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 64
KEEPALIVE_S = 75.0
# Open connections per remote address (an IPv6 address by its /64) and in all; how long a request
# head (request line and headers, after the TLS handshake if any) may take to arrive. A TLS
# connection costs ~256 KiB from its accept on (asyncio's SSL read buffer), a plain one ~8 KiB.
MAX_CONNS_PER_IP = 128  # a local swarm's peers all connect from 127.0.0.1: 8 peers' long-polls fit
MAX_CONNS = 512
HEAD_TIMEOUT_S = 5.0


class BodyTimeout(RemoteProtocolError):
    """A request body that stopped arriving, or did not arrive in time."""

    status = 408


class Busy(RemoteProtocolError):
    """Too many request bodies are being read from this address (or in all); retry later."""

    status = 429


class ClientGone(RemoteProtocolError):
    """The sender went away, or ended the body before its declared length."""


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """How much a server lets one request cost before refusing it (see the module docstring)."""

    body_timeout_s: float = BODY_TIMEOUT_S
    body_slack_s_per_mib: float = BODY_SLACK_S_PER_MIB
    body_idle_s: float = BODY_IDLE_S
    bodies_per_ip: int = MAX_BODIES_PER_IP
    bodies: int = MAX_BODIES
    max_line_size: int = MAX_LINE_SIZE
    max_field_size: int = MAX_FIELD_SIZE
    max_headers: int = MAX_HEADERS
    keepalive_s: float = KEEPALIVE_S
    conns_per_ip: int = MAX_CONNS_PER_IP
    conns: int = MAX_CONNS
    head_timeout_s: float = HEAD_TIMEOUT_S

    def __post_init__(self) -> None:
        timeouts = (self.body_timeout_s, self.body_idle_s, self.head_timeout_s)
        if min(timeouts) <= 0 or min(self.bodies_per_ip, self.bodies, self.conns_per_ip, self.conns) < 1:
            raise ValueError(f"invalid serve limits {self}: timeouts must be > 0 and caps >= 1")

    def body_deadline_s(self, declared: int | None) -> float:
        """How long a body of ``declared`` bytes (None: unknown) may take in all."""
        return self.body_timeout_s + self.body_slack_s_per_mib * (declared or 0) / (1 << 20)


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log, where a malformed request (a bad request line, an oversized header)
    is one INFO line rather than an ERROR with a traceback: a peer's bad bytes, not our fault,
    and a peer must not be able to flood the log with tracebacks."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.info(f"{msg}: %s: %s", *args, type(exc_info).__name__, exc_info, **kw)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kw)


def refusal(exc: RemoteProtocolError) -> web.Response:
    """The reply to a refused request: its status and a JSON ``{"error", "reason"}``."""
    body = {"error": type(exc).__name__, "reason": exc.reason}
    return web.Response(status=exc.status, text=json.dumps(body), content_type="application/json")


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """An emulated link: one-way added latency, a bandwidth cap (0 = none), a drop rate."""

    latency_s: float = 0.0
    bandwidth_bps: float = 0.0
    drop_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bps < 0 or not 0.0 <= self.drop_rate <= 1.0:
            raise ValueError(f"invalid link profile {self}: need latency >= 0, bandwidth >= 0, 0 <= drop <= 1")

    @classmethod
    def parse(cls, spec: str) -> LinkProfile:
        """Parse ``latency=50ms,bandwidth=10mbit,drop=0.01`` (any subset, any order)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key not in ("latency", "bandwidth", "drop"):
                raise ValueError(f"bad link spec {part!r}: use latency=50ms,bandwidth=10mbit,drop=0.01")
            values[key] = _parse_quantity(key, raw.strip().lower())
        return cls(values.get("latency", 0.0), values.get("bandwidth", 0.0), values.get("drop", 0.0))

    @property
    def active(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_bps > 0 or self.drop_rate > 0


def _parse_quantity(key: str, raw: str) -> float:
    units = {
        "latency": {"ms": 1e-3, "s": 1.0, "": 1.0},
        "bandwidth": {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0, "": 1.0},
        "drop": {"": 1.0},
    }[key]
    for suffix in sorted(units, key=len, reverse=True):
        if raw.endswith(suffix):
            try:
                return float(raw[: len(raw) - len(suffix)]) * units[suffix]
            except ValueError:
                break
    raise ValueError(f"bad {key} value {raw!r}; examples: latency=50ms, bandwidth=10mbit, drop=0.01")


class LinkDropped(ConnectionError):
    """The link emulator dropped this request, as a lossy network would."""


@dataclass
class LinkEmulator:
    """Applies a ``LinkProfile`` to outbound requests; per-destination profiles override."""

    default: LinkProfile = field(default_factory=LinkProfile)
    per_peer: dict[str, LinkProfile] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def profile(self, url: str) -> LinkProfile:
        for prefix, prof in self.per_peer.items():
            if url.startswith(prefix):
                return prof
        return self.default

    async def before_send(self, url: str) -> None:
        prof = self.profile(url)
        if prof.drop_rate and self.rng.random() < prof.drop_rate:
            raise LinkDropped(f"emulated drop on link to {url} (rate {prof.drop_rate})")
        if prof.latency_s:
            await asyncio.sleep(prof.latency_s)

    async def throttle(self, url: str, nbytes: int) -> None:
        prof = self.profile(url)
        if prof.bandwidth_bps:
            await asyncio.sleep(nbytes * 8 / prof.bandwidth_bps)


class BufferPool:
    """Reusable bytearrays, so receiving a fragment does not fault in fresh memory each time.

    It keeps at most ``max_buffers`` buffers of at most ``max_buffer`` bytes each and
    ``max_bytes`` in all; a buffer given back beyond that is dropped (and its memory freed)."""

    def __init__(self, max_buffers: int = 8, *, max_buffer: int = POOL_MAX_BUFFER,
                 max_bytes: int = POOL_MAX_BYTES) -> None:
        self._free: list[bytearray] = []
        self._max, self.max_buffer, self.max_bytes = max_buffers, max_buffer, max_bytes
        self.held = 0  # bytes kept for reuse

    def take(self, size: int, *, fresh: int | None = None) -> bytearray:
        """The smallest pooled buffer of at least ``size`` bytes; if none, a new one of ``size``
        bytes (at least ``CHUNK``), or of only ``fresh`` bytes when that is given and smaller
        (the caller then grows it as bytes arrive)."""
        want = size if fresh is None else min(size, fresh)
        for least in (size, want):
            best = min((b for b in self._free if len(b) >= least), key=len, default=None)
            if best is not None:
                self._free.remove(best)
                self.held -= len(best)
                return best
        return bytearray(max(want, CHUNK))

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        if len(self._free) < self._max and size <= self.max_buffer and self.held + size <= self.max_bytes:
            self._free.append(buf)
            self.held += size

    def grow(self, buf: bytearray, used: int, need: int, limit: int) -> bytearray:
        """A buffer of at least ``need`` bytes holding ``buf[:used]`` (``buf`` is given back):
        double the size, but never beyond ``limit``."""
        grown = self.take(min(max(need, 2 * len(buf)), limit))
        grown[:used] = memoryview(buf)[:used]
        self.give(buf)
        return grown


async def read_stream(
    content: aiohttp.StreamReader, length: int | None, max_size: int, pool: BufferPool,
    *, timeout_s: float | None = None, idle_s: float | None = None,
) -> tuple[bytearray, int]:
    """Read a body into a pooled buffer; return (buffer, used bytes). Caller gives it back.

    The buffer grows as bytes arrive (a declared length is only an upper bound). Raises
    ``Oversize`` as soon as the body (declared or actual) exceeds ``max_size``; ``BodyTimeout``
    when no chunk arrives for ``idle_s`` or the whole body takes longer than ``timeout_s``
    (None: no limit); ``ClientGone`` for a body that ends before its declared length.
    """
    if length is not None and length > max_size:
        raise Oversize(f"body of {length} bytes exceeds the cap of {max_size}")
    limit = max_size if length is None else length
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    buf = pool.take(limit, fresh=CHUNK)
    used = 0
    try:
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            by_idle = idle_s is not None and (left is None or idle_s <= left)
            wait = idle_s if by_idle else left
            try:
                async with asyncio.timeout(wait):
                    chunk = await content.read(CHUNK)
            except TimeoutError:
                raise BodyTimeout(_stalled(used, length, wait if by_idle else timeout_s,
                                           whole=not by_idle)) from None
            if not chunk:
                break
            end = used + len(chunk)
            if end > limit:
                raise Oversize(f"body exceeds {'its declared length' if length is not None else 'the cap'} "
                               f"of {limit} bytes")
            if end > len(buf):
                buf = pool.grow(buf, used, end, limit)
            buf[used:end] = chunk
            used = end
        if length is not None and used != length:
            raise ClientGone(f"body ended after {used} of {length} declared bytes")
    except BaseException:
        pool.give(buf)
        raise
    return buf, used


def _stalled(got: int, length: int | None, limit_s: float | None, *, whole: bool) -> str:
    declared = f" of {length} declared" if length is not None else ""
    if whole:
        return f"request body not complete after {limit_s:.1f} s ({got}{declared} bytes arrived)"
    return f"request body stalled: {got}{declared} bytes arrived, then nothing for {limit_s:.1f} s"


# ── connections: counted at accept, a deadline on each request head ──────────────────────────
_HEAD_TIMEOUT_BODY = b'{"error": "HeadTimeout", "reason": "the request head did not arrive in time"}'
_HEAD_TIMEOUT_REPLY = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY))
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset and keeps no TIME_WAIT
# A connection is pending (no complete request head yet, TLS handshake included), busy (a
# request is being handled), idle (kept alive between requests) or closed.
_Phase = Literal["pending", "busy", "idle", "closed"]


def address_key(ip: str) -> str:
    """What an address is counted under: an IPv4 address itself (also when IPv4-mapped), an
    IPv6 address by its /64 (one host commonly holds a whole /64); anything else as it is."""
    try:
        addr = ipaddress.ip_address(ip.partition("%")[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is None:
            return str(ipaddress.IPv6Network((addr, 64), strict=False))
        addr = addr.ipv4_mapped
    return str(addr)


class Connections:
    """The server's open connections, per address key (``address_key``) and in all.

    At a cap, room is made by closing the oldest connection of that address (or, when the
    server is full, of any) that is *pending* (no complete request head yet: most likely a
    slow or idle stranger, since an honest client sends its request at once) or else *idle*
    (kept alive between requests). A newcomer is refused only when every such connection is
    busy with a request. So a flood from one address holds at most the cap, and an honest
    client (even one behind the same address) still gets in."""

    def __init__(self, limits: ServeLimits) -> None:
        self.limits = limits
        self.open: Counter[str] = Counter()
        self.total = 0
        self.refused = 0  # reset at accept: no room
        self.evicted = 0  # closed to make room for a newer connection
        self.head_timeouts = 0  # closed with a 408: the request head did not arrive in time
        self.handshakes_failed = 0  # TLS handshakes that failed or did not finish in time
        self._pending: dict[_Gate, None] = {}  # oldest first
        self._idle: dict[_Gate, None] = {}  # oldest first
        self._gates: dict[object, _Gate] = {}  # aiohttp's request handler -> its gate

    def admit(self, ip: str) -> str | None:
        """Count a new connection from ``ip`` (making room if need be) and return its key, or
        None when there is no room."""
        key = address_key(ip)
        per_ip_full = self.open[key] >= self.limits.conns_per_ip and not self._evict(key)
        if per_ip_full or (self.total >= self.limits.conns and not self._evict(None)):
            self.refused += 1
            return None
        self.open[key] += 1
        self.total += 1
        return key

    def gate(self, handler: object) -> _Gate | None:
        """The gate in front of aiohttp's request handler ``handler`` (``request.protocol``)."""
        return self._gates.get(handler)

    def _evict(self, key: str | None) -> bool:
        for group in (self._pending, self._idle):
            victim = next((g for g in group if key is None or g.key == key), None)
            if victim is not None:
                self.evicted += 1
                victim.evict()
                return True
        return False

    def _state(self, gate: _Gate, state: _Phase) -> None:
        """Move ``gate`` to ``state`` (it is in at most one of ``_pending`` and ``_idle``)."""
        self._pending.pop(gate, None)
        self._idle.pop(gate, None)
        if state == "pending":
            self._pending[gate] = None
        elif state == "idle":
            self._idle[gate] = None
        elif state == "closed":
            self.total -= 1
            self.open[gate.key] -= 1
            if self.open[gate.key] <= 0:
                del self.open[gate.key]


class _Gate(asyncio.Protocol):
    """An admitted connection, in front of aiohttp's request handler (made once the connection,
    TLS included, is up): keeps its place in ``Connections`` until it closes, and closes it with
    a 408 when a request head misses its deadline. ``Transport._guard`` says when a request
    starts and ends; ``opening`` is the task that opens it (a TLS handshake), until it is open."""

    def __init__(self, conns: Connections, key: str, make_handler: Callable[[], asyncio.Protocol],
                 deadline: float) -> None:
        self.conns, self.key, self.make_handler = conns, key, make_handler
        self.deadline = deadline  # the first request head must be complete by then (loop time)
        self.loop = asyncio.get_running_loop()
        self.opening: asyncio.Task[None] | None = None
        self.handler: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.held, self.busy = True, False
        self._timer: asyncio.TimerHandle | None = None
        conns._state(self, "pending")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.handler = self.make_handler()
        self.conns._gates[self.handler] = self
        self._timer = self.loop.call_at(self.deadline, self._expire)
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self._timer is None:  # the first byte of a next request
            self._timer = self.loop.call_at(self.loop.time() + self.conns.limits.head_timeout_s, self._expire)
            self.conns._state(self, "pending")
        assert self.handler is not None
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        if self.handler is not None:
            self.conns._gates.pop(self.handler, None)
            self.handler.connection_lost(exc)

    def request_started(self) -> None:
        self.busy = True
        self._disarm()
        if self.held:
            self.conns._state(self, "busy")

    def request_finished(self) -> None:
        self.busy = False
        if self.held:
            self.conns._state(self, "idle")

    def release(self) -> None:
        """Give up this connection's place (once, however often called)."""
        self._disarm()
        if self.held:
            self.held = False
            self.conns._state(self, "closed")

    def evict(self) -> None:
        """Close it to make room (a task not yet opening it closes the socket when it starts)."""
        self.release()
        if self.transport is not None:
            self.transport.abort()
        elif self.opening is not None:
            self.opening.cancel()  # mid-handshake: asyncio closes the socket

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        self.conns.head_timeouts += 1
        log.debug("closing a connection from %s: no request head within %.1f s",
                  self.transport.get_extra_info("peername"), self.conns.limits.head_timeout_s)
        self.transport.write(_HEAD_TIMEOUT_REPLY)
        self.transport.close()


class _GatedSite(web.BaseSite):
    """aiohttp's ``TCPSite`` with our own accept loop, which admits each socket to
    ``Connections`` (or resets it) before a TLS handshake or an HTTP byte is read."""

    __slots__ = ("_host", "_port", "_conns", "_sockets", "_task", "_unopened")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, conns: Connections,
                 ssl_context: ssl.SSLContext | None) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port, self._conns = host, port, conns
        self._sockets: list[socket.socket] = []
        self._task: asyncio.Task[None] | None = None
        self._unopened: set[socket.socket] = set()  # admitted, not yet handed to asyncio

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        await super().start()
        self._sockets = await _listen(self._host, self._port, self._backlog)
        self._port = self._sockets[0].getsockname()[1]
        self._task = asyncio.create_task(self._serve(), name=f"accept {self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (*self._sockets, *self._unopened):
            sock.close()
        self._unopened.clear()
        await super().stop()

    async def _serve(self) -> None:
        async with asyncio.TaskGroup() as tg:  # the accept loops and the connections being opened
            for sock in self._sockets:
                tg.create_task(self._accept(sock, tg))

    async def _accept(self, sock: socket.socket, tg: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except (ConnectionAbortedError, InterruptedError):  # that one connection is gone
                continue
            except OSError as exc:  # out of descriptors or memory: let some close, then go on
                log.warning("accept on %s failed (%s); pausing for 1 s", self.name, exc)
                await asyncio.sleep(1.0)
                continue
            while True:  # take every connection already waiting in the backlog
                self._admit(conn, addr[0], tg)
                try:
                    conn, addr = sock.accept()
                except OSError:  # nothing waiting (BlockingIOError), or an error the next await sees
                    break

    def _admit(self, conn: socket.socket, ip: str, tg: asyncio.TaskGroup) -> None:
        key = self._conns.admit(ip)
        if key is None:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            conn.close()
            return
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        gate = _Gate(self._conns, key, server, loop.time() + self._conns.limits.head_timeout_s)
        self._unopened.add(conn)
        tg.create_task(self._open(conn, gate))

    async def _open(self, conn: socket.socket, gate: _Gate) -> None:
        self._unopened.discard(conn)
        if not gate.held:  # it made room for a newer connection before this task started
            conn.close()
            return
        gate.opening = asyncio.current_task()
        head_s = self._conns.limits.head_timeout_s
        tls = {"ssl_handshake_timeout": head_s, "ssl_shutdown_timeout": head_s} if self._ssl_context else {}
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: gate, conn, ssl=self._ssl_context, **tls)
        except (OSError, ssl.SSLError, TimeoutError) as exc:  # a failed or slow TLS handshake
            log.debug("connection not opened: %r", exc)
            self._conns.handshakes_failed += 1
            gate.release()
        except asyncio.CancelledError:  # evicted mid-handshake, or the server stops
            gate.release()
            raise
        finally:
            gate.opening = None


async def _listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (one port for all, when ``port`` is 0)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr[0], sockets[0].getsockname()[1] if len(sockets) > 1 else port, *addr[2:]))
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Transport:
    """One aiohttp server bound to ``host:port`` (port 0 picks a free one) and one client session."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_body: int = 512 << 20,
        link: LinkEmulator | None = None,
        limits: ServeLimits | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.tls = tls  # serve HTTPS with this context (certified swarms); None: plain HTTP
        # Signs each outbound request (``Atoll-Auth`` and ``Atoll-Certificate`` headers), if set.
        self.authenticate: Callable[[str, str], dict[str, str]] | None = None
        self.pins: dict[str, bytes] = {}  # origin -> TLS key pin, from members' certificates
        self._pinned_tls: dict[bytes, PinnedKey] = {}
        self._unpinned_tls = client_context()
        self.max_body = max_body
        self.link = link or LinkEmulator()
        self.limits = limits or ServeLimits()
        self.app = web.Application(client_max_size=max_body, middlewares=[self._guard])
        self.pool = BufferPool()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bodies_in_flight: Counter[str] = Counter()  # request bodies being read, per address
        self.connections = Connections(self.limits)  # open connections, per address and in all
        self._hang_up: set[int] = set()  # ids of requests whose connection closes after the reply
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def admit_with(self, middleware: Callable[..., Awaitable[web.StreamResponse]]) -> None:
        """Run ``middleware`` on every request, inside the guard that turns refusals into 4xx
        (before ``start``)."""
        self.app.middlewares.append(middleware)

    def client_options(self, method: str, url: str) -> dict[str, Any]:
        """``headers`` (authentication) and ``ssl`` (TLS pin, when the address has one) for a
        request of ``method`` to ``url``."""
        headers = self.authenticate(method, url) if self.authenticate is not None else {}
        opts: dict[str, Any] = {"headers": headers}
        if url.startswith("https://"):
            # one object per pin (and one context): aiohttp keys its connection pool by them
            pin = self.pins.get(origin(url))
            if pin is None:
                opts["ssl"] = self._unpinned_tls
            else:
                if pin not in self._pinned_tls:
                    self._pinned_tls[pin] = PinnedKey(pin)
                opts["ssl"] = self._pinned_tls[pin]
        return opts

    async def start(self) -> str:
        """Bind and start serving; return the real URL (with the port the OS chose)."""
        lim = self.limits
        self._runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, keepalive_timeout=lim.keepalive_s,
            max_line_size=lim.max_line_size, max_field_size=lim.max_field_size, max_headers=lim.max_headers,
            logger=_ServerLog(logging.getLogger("aiohttp.server"), {}),
        )
        await self._runner.setup()
        site = _GatedSite(self._runner, self.host, self.port, self.connections, self.tls)
        await site.start()
        self.port = site.port
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=64),
        )
        return self.url

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Transport.start() must run before requests are sent")
        return self._session

    async def _body(self, url: str, chunks: Iterable[memoryview | bytes]) -> AsyncIterator[memoryview | bytes]:
        for chunk in chunks:
            await self.link.throttle(url, len(chunk))
            self.bytes_sent += len(chunk)
            yield chunk  # aiohttp writes buffer views as they are: no copy

    async def request(
        self,
        method: str,
        url: str,
        *,
        chunks: Iterable[memoryview | bytes] = (),
        size: int | None = None,
        timeout_s: float = 30.0,
        max_reply: int | None = None,
    ) -> tuple[int, bytearray, int, dict[str, str]]:
        """Send a (streamed) body; return (status, pooled reply buffer, reply length, headers).

        The caller gives the buffer back to ``self.pool`` when done with it. Raises
        ``LinkDropped``, ``aiohttp.ClientError``, ``TimeoutError`` or ``Oversize``.
        """
        await self.link.before_send(url)
        opts = self.client_options(method, url)
        headers = {"Content-Type": "application/octet-stream", **opts.pop("headers")}
        if size is not None:
            headers["Content-Length"] = str(size)
        data = self._body(url, chunks) if size else None
        async with asyncio.timeout(timeout_s):
            async with self.session.request(method, url, data=data, headers=headers, **opts) as resp:
                length = resp.content_length if method != "HEAD" else 0
                buf, used = await read_stream(resp.content, length, max_reply or self.max_body, self.pool)
                self.bytes_received += used
                return resp.status, buf, used, dict(resp.headers)

    async def read_request(self, request: web.Request, max_size: int | None = None) -> tuple[bytearray, int]:
        """Read a request body into a pooled buffer (see ``read_stream``) under ``self.limits``.

        Raises ``Busy`` when the sender's address (or the server) has too many bodies being read,
        ``Oversize``, ``BodyTimeout``, or ``ClientGone`` when the sender went away. A body not
        read to its end is not drained: the connection is closed after the reply."""
        ip, lim = request.remote or "unknown", self.limits
        if self.bodies_in_flight[ip] >= lim.bodies_per_ip:
            self._hang_up.add(id(request))
            raise Busy(f"{self.bodies_in_flight[ip]} request bodies from {ip} are being read already "
                       f"(at most {lim.bodies_per_ip} at once); retry later")
        if self.bodies_in_flight.total() >= lim.bodies:
            self._hang_up.add(id(request))
            raise Busy(f"{lim.bodies} request bodies are being read already; retry later")
        self.bodies_in_flight[ip] += 1
        length = request.content_length
        try:
            buf, used = await read_stream(
                request.content, length, max_size or self.max_body, self.pool,
                timeout_s=lim.body_deadline_s(length), idle_s=lim.body_idle_s,
            )
        except (ConnectionError, aiohttp.ClientPayloadError, HttpProcessingError) as exc:  # cut off
            self._hang_up.add(id(request))
            raise ClientGone(f"request body cut off: {exc}") from None
        except RemoteProtocolError:
            self._hang_up.add(id(request))
            raise
        finally:
            self.bodies_in_flight[ip] -= 1
            if self.bodies_in_flight[ip] <= 0:
                del self.bodies_in_flight[ip]
        self.bytes_received += used
        return buf, used

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every route: a ``RemoteProtocolError`` becomes a 4xx with its reason; a request whose
        body was refused part-way gets its reply and then loses its connection (not drained).
        The connection's gate learns that the request's head is in, and when it is answered."""
        gate = self.connections.gate(request.protocol)
        if gate is not None:
            gate.request_started()
        try:
            try:
                resp = await handler(request)
            except RemoteProtocolError as exc:
                log.info("refused %s %s from %s: %s: %s", request.method, request.path, request.remote,
                         type(exc).__name__, exc.reason)
                resp = refusal(exc)
            if id(request) not in self._hang_up:
                return resp
            resp.force_close()
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError):
                await resp.prepare(request)
                await resp.write_eof()
            request.protocol.force_close()  # the reply is flushed first; no lingering read of the rest
            return resp
        finally:
            self._hang_up.discard(id(request))
            if gate is not None:
                gate.request_finished()

    async def stream_reply(
        self, request: web.Request, chunks: Iterable[memoryview | bytes], size: int,
        headers: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """Reply with a streamed body of ``size`` bytes, chunk by chunk."""
        resp = web.StreamResponse(status=200, headers=headers)
        resp.content_type = "application/octet-stream"
        resp.content_length = size
        try:
            await resp.prepare(request)
            for chunk in chunks:
                await self.link.throttle(str(request.remote), len(chunk))
                await resp.write(chunk)
                self.bytes_sent += len(chunk)
            await resp.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
            # the asker went away (timed out, or shut down): nothing to answer any more
            log.debug("reply to %s abandoned: %r", request.remote, exc)
        return resp
