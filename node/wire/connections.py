"""Connections, counted before anything is parsed: the server's own accept loop and a deadline
on every request head.

``_GatedSite`` runs the accept loop: each accepted socket is counted under its remote address
before a TLS handshake or an HTTP byte is read, as long-polls are (``PrefixCounts``): an IPv4
address itself, an IPv6 one at its /64, /56 and /48, each held to ``PREFIX_SHARES`` times
``conns_per_ip``. Beyond that for any of its prefixes, or ``conns`` in all (``ServeLimits``), the
oldest connection in that prefix (or anywhere) without a request in progress is closed to make
room, and the newcomer is reset only when there is none (``Connections``). So many addresses of
one /48 hold at most 16 addresses' worth, never every slot. An admitted socket gets a ``_Gate`` in front of aiohttp's request
handler, which gives up its place when the connection closes (whichever way) and holds a header
deadline: the first request head (TLS handshake included) must be complete within
``head_timeout_s`` of the accept, and every later one within ``head_timeout_s`` of its first
byte, or the connection gets a 408 and is closed.

Replies have deadlines too, since a client that asks for a fragment and never reads would hold a
busy connection for ever (128 of them per address, 512 in all, let four addresses lock every
newcomer out). The gate is the transport's protocol, so it hears when the reply's writes back up
(``pause_writing``: the peer reads nothing, or too little): a reply that makes no progress for
``reply_idle_s`` is cut off, and one that is not written in ``reply_deadline_s(size)`` from its
head on (``reply_started``) is cut off too, whether the route streams it or aiohttp writes it
after the route returned. A connection whose reply is stalled this way may be closed to make room
like a pending or idle one (after them, the longest-stalled first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
from collections import Counter
from collections.abc import Callable
from typing import Literal, Protocol

from aiohttp import web

from protocol.dht.netgroups import PrefixCounts, counted_prefixes, sender_key

__all__ = ["Connections", "address_key"]

log = logging.getLogger("node.wire.transport")


_HEAD_TIMEOUT_BODY = (
    b'{"error": "HeadTimeout", "reason": "the request head did not arrive in time"}'
)
_HEAD_TIMEOUT_REPLY = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY)
)
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset and keeps no TIME_WAIT
# A connection is pending (no complete request head yet, TLS handshake included), busy (a
# request is being handled), idle (kept alive between requests) or closed.
_Phase = Literal["pending", "busy", "idle", "closed"]


address_key = sender_key  # what an address is counted under (IPv6 by its /64; see netgroups)


class ConnectionLimits(Protocol):
    """The caps and deadlines connections are held to (``node.wire.transport.ServeLimits``)."""

    @property
    def conns_per_ip(self) -> int: ...
    @property
    def conns(self) -> int: ...
    @property
    def head_timeout_s(self) -> float: ...
    @property
    def reply_idle_s(self) -> float: ...
    @property
    def send_buffer(self) -> int | None: ...
    def reply_deadline_s(self, size: int | None) -> float: ...


class Connections:
    """The server's open connections, per address prefix (``PrefixCounts``) and in all.

    At a cap, room is made by closing the oldest connection of that address (or, when the
    server is full, of any) that is *pending* (no complete request head yet: most likely a
    slow or idle stranger, since an honest client sends its request at once), else *idle*
    (kept alive between requests), else *stalled* (its reply's writes backed up: the peer does
    not read; longest-stalled first). A newcomer is refused only when every connection there is
    busy with a request that is not stalled. So a flood from one address holds at most the cap,
    and an honest client (even one behind the same address) still gets in."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.by_prefix = PrefixCounts(limits.conns_per_ip)
        self.total = 0
        self.refused = 0  # reset at accept: no room
        self.evicted = 0  # closed to make room for a newer connection
        self.head_timeouts = 0  # closed with a 408: the request head did not arrive in time
        self.handshakes_failed = 0  # TLS handshakes that failed or did not finish in time
        self.reply_timeouts = (
            0  # closed: a reply made no progress for reply_idle_s, or missed its deadline
        )
        self._pending: dict[_Gate, None] = {}  # oldest first
        self._idle: dict[_Gate, None] = {}  # oldest first
        self._stalled: dict[
            _Gate, None
        ] = {}  # replies whose writes backed up, longest-stalled first
        self._gates: dict[object, _Gate] = {}  # aiohttp's request handler -> its gate

    @property
    def open(self) -> Counter[str]:
        """Open connections per counted key: an IPv4 address; an IPv6 /64, /56 and /48."""
        return self.by_prefix.held

    def admit(self, ip: str) -> bool:
        """Count a new connection from ``ip`` (making room if need be); False when there is no
        room."""
        if not self._room_in_prefixes(ip) or (
            self.total >= self.limits.conns and not self._evict(None)
        ):
            self.refused += 1
            return False
        self.by_prefix.add(ip)
        self.total += 1
        return True

    def _room_in_prefixes(self, ip: str) -> bool:
        """Whether ``ip`` may open one more, after closing a connection in each full prefix of
        it if one can be closed (one per prefix at most: each frees room in the narrower too)."""
        for prefix, share in counted_prefixes(ip):
            if self.by_prefix.held[prefix] >= self.by_prefix.cap * share and not self._evict(
                prefix
            ):
                return False
        return True

    def gate(self, handler: object) -> _Gate | None:
        """The gate in front of aiohttp's request handler ``handler`` (``request.protocol``)."""
        return self._gates.get(handler)

    @property
    def stalled(self) -> int:
        """Connections whose reply's writes are backed up now (the peer is not reading)."""
        return len(self._stalled)

    def _evict(self, key: str | None) -> bool:
        for group in (self._pending, self._idle, self._stalled):
            victim = next((g for g in group if key is None or key in g.prefixes), None)
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
            self._stalled.pop(gate, None)
            self.total -= 1
            self.by_prefix.remove(gate.ip)


class _Gate(asyncio.Protocol):
    """An admitted connection, in front of aiohttp's request handler (made once the connection,
    TLS included, is up): keeps its place in ``Connections`` until it closes, and closes it with
    a 408 when a request head misses its deadline. ``Transport._guard`` says when a request
    starts and ends; ``opening`` is the task that opens it (a TLS handshake), until it is open."""

    def __init__(
        self,
        conns: Connections,
        ip: str,
        make_handler: Callable[[], asyncio.Protocol],
        deadline: float,
    ) -> None:
        self.conns, self.ip, self.make_handler = conns, ip, make_handler
        self.prefixes = frozenset(key for key, _ in counted_prefixes(ip))  # where it is counted
        self.deadline = deadline  # the first request head must be complete by then (loop time)
        self.loop = asyncio.get_running_loop()
        self.opening: asyncio.Task[None] | None = None
        self.handler: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.held, self.busy = True, False
        self._timer: asyncio.TimerHandle | None = None  # the request head's deadline
        self._write_timer: asyncio.TimerHandle | None = (
            None  # armed while the reply's writes are backed up
        )
        self._reply_timer: asyncio.TimerHandle | None = None  # the reply's whole deadline
        conns._state(self, "pending")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.handler = self.make_handler()
        self.conns._gates[self.handler] = self
        self._timer = self.loop.call_at(self.deadline, self._expire)
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self._timer is None:  # the first byte of a next request
            self._timer = self.loop.call_at(
                self.loop.time() + self.conns.limits.head_timeout_s, self._expire
            )
            self.conns._state(self, "pending")
        assert self.handler is not None
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.held and self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.conns.limits.reply_idle_s, self._cut_off, "stalled"
            )
            self.conns._stalled[self] = None
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        if self.handler is not None:
            self.handler.resume_writing()

    def reply_started(self, size: int | None) -> None:
        """A reply's head is being written: the reply (``size`` bytes; None: unknown) must be
        written within ``reply_deadline_s(size)``."""
        if self._reply_timer is not None:
            self._reply_timer.cancel()
        if self.held:
            self._reply_timer = self.loop.call_later(
                self.conns.limits.reply_deadline_s(size), self._cut_off, "late"
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        if self.handler is not None:
            self.conns._gates.pop(self.handler, None)
            self.handler.connection_lost(exc)

    def request_started(self) -> None:
        self.busy = True
        self._disarm()
        if self._reply_timer is not None:  # the last reply is out: its deadline is moot
            self._reply_timer.cancel()
            self._reply_timer = None
        if self.held:
            self.conns._state(self, "busy")

    def request_finished(self) -> None:
        self.busy = False
        if self.held:
            self.conns._state(self, "idle")

    def release(self) -> None:
        """Give up this connection's place (once, however often called)."""
        self._disarm()
        self._cancel_write_timer()
        if self._reply_timer is not None:
            self._reply_timer.cancel()
            self._reply_timer = None
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

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        self.conns._stalled.pop(self, None)

    def _cut_off(self, why: str) -> None:
        """A reply's deadline passed: ``stalled`` (no progress for ``reply_idle_s``) or ``late``
        (not written in ``reply_deadline_s``). A reply that is out already (nothing left to write,
        no request in progress) keeps its connection."""
        if why == "stalled":
            self._write_timer = None
        else:
            self._reply_timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if why == "late" and not self.busy and transport.get_write_buffer_size() == 0:
            return
        self.conns.reply_timeouts += 1
        lim = self.conns.limits
        log.info(
            "cutting off a reply to %s: %s",
            transport.get_extra_info("peername"),
            f"no progress for {lim.reply_idle_s:.1f} s (the peer does not read)"
            if why == "stalled"
            else "not written within its deadline",
        )
        self.release()
        transport.abort()

    def _expire(self) -> None:
        self._timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        self.conns.head_timeouts += 1
        log.debug(
            "closing a connection from %s: no request head within %.1f s",
            self.transport.get_extra_info("peername"),
            self.conns.limits.head_timeout_s,
        )
        self.transport.write(_HEAD_TIMEOUT_REPLY)
        self.transport.close()


class _GatedSite(web.BaseSite):
    """aiohttp's ``TCPSite`` with our own accept loop, which admits each socket to
    ``Connections`` (or resets it) before a TLS handshake or an HTTP byte is read."""

    __slots__ = ("_host", "_port", "_conns", "_sockets", "_task", "_unopened")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        conns: Connections,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
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
                except (
                    OSError
                ):  # nothing waiting (BlockingIOError), or an error the next await sees
                    break

    def _admit(self, conn: socket.socket, ip: str, tg: asyncio.TaskGroup) -> None:
        if not self._conns.admit(ip):
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            conn.close()
            return
        if self._conns.limits.send_buffer is not None:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._conns.limits.send_buffer)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        gate = _Gate(self._conns, ip, server, loop.time() + self._conns.limits.head_timeout_s)
        self._unopened.add(conn)
        tg.create_task(self._open(conn, gate))

    async def _open(self, conn: socket.socket, gate: _Gate) -> None:
        self._unopened.discard(conn)
        if not gate.held:  # it made room for a newer connection before this task started
            conn.close()
            return
        gate.opening = asyncio.current_task()
        head_s = self._conns.limits.head_timeout_s
        tls = (
            {"ssl_handshake_timeout": head_s, "ssl_shutdown_timeout": head_s}
            if self._ssl_context
            else {}
        )
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: gate, conn, ssl=self._ssl_context, **tls
            )
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
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(
                (addr[0], sockets[0].getsockname()[1] if len(sockets) > 1 else port, *addr[2:])
            )
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
