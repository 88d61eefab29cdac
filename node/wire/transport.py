"""HTTP transport: one aiohttp server, one client session, size caps, link emulation.

``Transport`` turns HTTP into bytes and back and nothing more: ``rpc`` decides what the bytes
mean. Bodies travel in chunks of at most ``CHUNK`` bytes and are read into pooled buffers
(``node.wire.bodies``). Every byte sent is counted under its route (``bytes_by_route``). The
server binds port 0 and announces the real port only once bound.

Refusing is cheap (``ServeLimits``). A declared ``Content-Length`` is a claim, not a reason to
allocate: a body's buffer grows with the bytes that actually arrive (a pooled buffer is reused
when one is large enough), and the pool keeps no huge buffer. A body must keep arriving (an idle
timeout between chunks) and be complete within an overall timeout that grows with its declared
size (a route that checks a body's head, ``on_head``, grants that extra time only once the
head is in: until then a body has the time of a small one); a sender that stalls gets a 408 and
its connection is closed. Each address (an IPv6 address by its /64, as for connections) may have
only a few bodies being read at once (429 beyond), header lines and fields are bounded, and a
``RemoteProtocolError`` raised by any route becomes a 4xx with a JSON reason, never a 500.

Connections are counted before anything is parsed (``node.wire.connections``: a cap per address
and in all, and a deadline on every request head); between requests an idle keep-alive
connection is closed after ``keepalive_s``. ``node.wire.link`` emulates slow or lossy links.

Replies are bounded like request bodies: each must be written within ``reply_deadline_s`` of its
size (``reply_timeout_s`` plus ``reply_slack_s_per_mib`` a MiB) and make progress at least every
``reply_idle_s`` (the connection's gate cuts it off otherwise, and a stalled one may be closed to
make room: ``node.wire.connections``). Streamed replies (fragments, versions) are counted per
address (at most ``replies_per_ip`` at once; 429 beyond) and written in pieces of at most
``REPLY_PIECE`` bytes, so a peer that stops reading pins at most about one piece of copied bytes
in our transport's buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

import aiohttp
from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from node.wire.bodies import CHUNK, BodyTimeout, BufferPool, ClientGone, read_stream
from node.wire.connections import Connections, _GatedSite, address_key
from node.wire.direct import DIRECT_MIN, Socket
from node.wire.link import LinkDropped, LinkEmulator, LinkProfile
from node.wire.tls import PinnedKey, client_context, origin
from protocol.errors import RemoteProtocolError

if TYPE_CHECKING:
    from multidict import CIMultiDictProxy  # aiohttp's headers (a dependency of aiohttp's)

__all__ = [
    "CHUNK",
    "BodyTimeout",
    "BufferPool",
    "Busy",
    "ClientGone",
    "Connections",
    "LinkDropped",
    "LinkEmulator",
    "LinkProfile",
    "REPLY_PIECE",
    "Reply",
    "ServeLimits",
    "Transport",
    "address_key",
    "pieces",
    "refusal",
    "read_stream",
]

log = logging.getLogger(__name__)

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
# Writing a reply: complete within REPLY_TIMEOUT_S plus REPLY_SLACK_S_PER_MIB per MiB (as a
# request body), with no REPLY_IDLE_S without progress (the peer reading nothing); streamed
# replies at once per address (a 32-peer local swarm fetches from one owner all from 127.0.0.1),
# each written in pieces of at most REPLY_PIECE bytes.
REPLY_TIMEOUT_S = 30.0
REPLY_SLACK_S_PER_MIB = 1.0
REPLY_IDLE_S = 10.0
MAX_REPLIES_PER_IP = 64
# Request bodies are written in pieces of the same size (``writing_when_empty``): the part of a
# piece the socket does not take at once is what asyncio copies
REPLY_PIECE = 256 << 10


class Busy(RemoteProtocolError):
    """Too many request bodies are being read from this address (or in all); retry later."""

    status = 429


class _Streaming:
    """A streamed reply's place among its address's (``Transport.streaming``)."""

    def __init__(self, counts: Counter[str], key: str) -> None:
        self.counts, self.key = counts, key

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        self.counts[self.key] -= 1
        if self.counts[self.key] <= 0:
            del self.counts[self.key]


@contextlib.contextmanager
def writing_when_empty(transport: asyncio.BaseTransport | None) -> Iterator[None]:
    """While a large body is written to ``transport``: a write waits (``drain``) until the
    transport's buffer is empty, not merely under its low-water mark (16 KiB). asyncio (3.11)
    tries a write on the socket at once only when its buffer is empty; otherwise it appends the
    whole piece to that buffer, a copy of nearly every byte sent (5 % of a 4 x 124M averaging
    round's CPU: ``memmove``). Now only what the socket does not take at once is copied. The
    transport's limits are restored after (a kept-alive connection's next message is small).
    A TLS transport is left as it is: it encrypts every byte into buffers of its own anyway, and
    its flow control, held to an empty buffer, stalled a large body."""
    if (
        not isinstance(transport, asyncio.WriteTransport)
        or transport.is_closing()
        or transport.get_extra_info("sslcontext") is not None
    ):
        yield
        return
    low, high = transport.get_write_buffer_limits()
    transport.set_write_buffer_limits(high=0, low=0)
    try:
        yield
    finally:
        if not transport.is_closing():
            transport.set_write_buffer_limits(high=high, low=low)


class _BodyPayload(aiohttp.AsyncIterablePayload):
    """A request body streamed from an async iterator, written ``writing_when_empty``."""

    def __init__(self, body: AsyncIterator[memoryview | bytes]) -> None:
        # aiohttp's writer takes any buffer; its stubs say bytes
        super().__init__(cast("AsyncIterator[bytes]", body))

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        with writing_when_empty(getattr(writer, "transport", None)):
            await super().write_with_length(writer, content_length)


def pieces(chunks: Iterable[memoryview | bytes], size: int = REPLY_PIECE) -> Iterator[memoryview]:
    """``chunks`` as views of at most ``size`` bytes (no copy)."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for start in range(0, view.nbytes, size):
            yield view[start : start + size]


class EncodedBody(RemoteProtocolError):
    """A request body sent with a ``Content-Encoding``: Atoll's bodies go as they are. aiohttp
    would inflate gzip or deflate before a byte of it was checked, so 200 KB of gzip from a
    stranger became 200 MiB of buffer; it is refused before the body is read."""

    status = 415


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
    reply_timeout_s: float = REPLY_TIMEOUT_S
    reply_slack_s_per_mib: float = REPLY_SLACK_S_PER_MIB
    reply_idle_s: float = REPLY_IDLE_S
    replies_per_ip: int = MAX_REPLIES_PER_IP
    # SO_SNDBUF of accepted sockets; None keeps the kernel's autotuning (up to tcp_wmem's 4 MiB
    # a socket), which long fat links need. A small one bounds what a peer that reads nothing
    # holds in the kernel (tests shrink it so that a reply of a few MiB backs up).
    send_buffer: int | None = None

    def __post_init__(self) -> None:
        timeouts = (
            self.body_timeout_s,
            self.body_idle_s,
            self.head_timeout_s,
            self.reply_timeout_s,
            self.reply_idle_s,
        )
        caps = (self.bodies_per_ip, self.bodies, self.conns_per_ip, self.conns, self.replies_per_ip)
        if (
            min(timeouts) <= 0
            or min(caps) < 1
            or min(self.body_slack_s_per_mib, self.reply_slack_s_per_mib) < 0
        ):
            raise ValueError(
                f"invalid serve limits {self}: timeouts must be > 0, slack >= 0 and caps >= 1"
            )

    def body_deadline_s(self, declared: int | None) -> float:
        """How long a body of ``declared`` bytes (None: unknown) may take in all."""
        return self.body_timeout_s + self.body_slack_s_per_mib * (declared or 0) / (1 << 20)

    def reply_deadline_s(self, size: int | None) -> float:
        """How long a reply of ``size`` bytes (None: unknown) may take to write, from its head on."""
        return self.reply_timeout_s + self.reply_slack_s_per_mib * (size or 0) / (1 << 20)


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log, where a malformed request (a bad request line, an oversized header)
    is one INFO line rather than an ERROR with a traceback: a peer's bad bytes, not our fault,
    and a peer must not be able to flood the log with tracebacks."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError | RequestPayloadError):
            self.info(f"{msg}: %s: %s", *args, type(exc_info).__name__, exc_info, **kw)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kw)


# Headers aiohttp adds that no peer reads (docs/scale_peers.md "Bytes a request"). A client's:
# User-Agent, Accept and Accept-Encoding (our replies are never content-coded), and Content-Type
# (a body is what its route says it is). A server's: Server and Date, and a Content-Type of
# application/octet-stream, the meaning of a body without one (RFC 9110 8.3).
SKIPPED_REQUEST_HEADERS = (hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE)
DROPPED_REPLY_HEADERS = (hdrs.SERVER, hdrs.DATE)
_OCTETS = "application/octet-stream"
# a reply's route, kept on its request until its head goes out (aiohttp >= 3.12 types request keys)
_REPLY_ROUTE: Any = (
    web.RequestKey("atoll_reply_route", str) if hasattr(web, "RequestKey") else "atoll_reply_route"
)


def _head_bytes(first_line: str, headers: Mapping[str, str]) -> int:
    """Bytes of an HTTP/1.1 message head: its first line, each header line, the blank line."""
    return len(first_line) + 2 + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


def _encodings(headers: CIMultiDictProxy[str]) -> list[str]:
    """Every ``Content-Encoding`` of a message, on any of its lines, stripped and lower-cased."""
    return [e.strip().lower() for e in headers.getall(hdrs.CONTENT_ENCODING, ())]


def route_of(path: str) -> str:
    """A request path as a route name: numbers (fragment indices) become ``*``."""
    return re.sub(r"/\d+(?=/|$)", "/*", path)


def refusal(exc: RemoteProtocolError) -> web.Response:
    """The reply to a refused request: its status and a JSON ``{"error", "reason"}``."""
    body = {"error": type(exc).__name__, "reason": exc.reason}
    return web.Response(status=exc.status, text=json.dumps(body), content_type="application/json")


T = TypeVar("T")


@dataclass(slots=True)
class Reply:
    """A reply to ``Transport.reply``: its status, its body (valid inside the ``async with``
    only: the pooled buffer goes back on exit unless ``take``n) and its headers."""

    status: int
    body: memoryview
    headers: dict[str, str]
    buf: bytearray | None = field(default=None, repr=False)  # the pooled buffer, until taken

    def take(self) -> tuple[bytearray, int]:
        """The pooled buffer and the body's length, now the caller's to give back (a verified
        version kept for other peers as the very bytes received: ``Holdings.put``)."""
        if self.buf is None:
            raise RuntimeError("the reply's buffer was taken already (or it has none)")
        buf, self.buf = self.buf, None
        return buf, self.body.nbytes

    async def settle(self, work: Awaitable[T]) -> T:
        """Await ``work`` that reads ``body`` (on a worker thread, say); when the caller is
        cancelled meanwhile, wait for ``work`` to finish before the cancellation goes on, so the
        buffer does not go back to the pool (and get reused) while a thread still reads it."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # retrieved: the cancellation is what propagates
            raise


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
        # Signs each outbound request (``Atoll-Auth`` and ``Atoll-Certificate`` headers), if set:
        # (method, url, the peer id expected there or None) -> headers
        self.authenticate: Callable[[str, str, bytes | None], dict[str, str]] | None = None
        # The peer id expected at a URL (``node.wire.admission.MemberAddresses``), named in our
        # Atoll-Auth so that a captured header is good at that node only; None: first contact
        self.recipient_of: Callable[[str], bytes | None] = lambda _url: None
        self.pins: dict[str, bytes] = {}  # origin -> TLS key pin, from members' certificates
        # told (expected pin, presented pin) when a pinned server shows another key (node.wire.tls)
        self.on_pin_mismatch: Callable[[bytes, bytes], None] | None = None
        self._pinned_tls: dict[bytes, PinnedKey] = {}
        self._unpinned_tls = client_context()
        self.max_body = max_body
        self.link = link or LinkEmulator()
        self.limits = limits or ServeLimits()
        self.app = web.Application(client_max_size=max_body, middlewares=[self._guard])
        self.pool = BufferPool()
        # HTTP bytes this node put on the wire: its requests' and replies' heads and bodies (reply
        # heads that aiohttp completes are estimated within a few bytes; TCP/TLS framing not counted)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.direct_bodies = 0  # bodies (requests and replies) read straight off their socket
        # bytes_sent by what they were: a request's route (a path, or a message type) or
        # "reply <route>"; where a swarm's bytes go, for the report and bench.bandwidth
        self.bytes_by_route: Counter[str] = Counter()
        # requests sent and reply heads written, by the same routes: what each one costs
        self.messages_by_route: Counter[str] = Counter()
        self.bodies_in_flight: Counter[str] = (
            Counter()
        )  # request bodies being read, per address_key
        self.replies_in_flight: Counter[str] = (
            Counter()
        )  # streamed replies being written, per address_key
        self.replies_refused = 0  # streamed replies refused (429): too many to one address at once
        self.app.on_response_prepare.append(self._reply_prepared)
        self.connections = Connections(self.limits)  # open connections, per address and in all
        self._hang_up: set[int] = set()  # ids of requests whose connection closes after the reply
        self._kinds: dict[int, str] = {}  # ids of requests -> what they carry (see ``name_kind``)
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
        headers = (
            self.authenticate(method, url, self.recipient_of(url))
            if self.authenticate is not None
            else {}
        )
        opts: dict[str, Any] = {"headers": headers}
        if url.startswith("https://"):
            # one object per pin (and one context): aiohttp keys its connection pool by them
            pin = self.pins.get(origin(url))
            if pin is None:
                opts["ssl"] = self._unpinned_tls
            else:
                if pin not in self._pinned_tls:
                    self._pinned_tls[pin] = PinnedKey(pin, self._pin_mismatch)
                opts["ssl"] = self._pinned_tls[pin]
        return opts

    def _pin_mismatch(self, expected: bytes, got: bytes) -> None:
        if self.on_pin_mismatch is not None:
            self.on_pin_mismatch(expected, got)

    async def start(self) -> str:
        """Bind and start serving; return the real URL (with the port the OS chose)."""
        lim = self.limits
        self._runner = web.AppRunner(
            # a node that stops does not wait out the long-polls it holds (up to 30 s): 1 s, then cancelled
            self.app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            keepalive_timeout=lim.keepalive_s,
            max_line_size=lim.max_line_size,
            max_field_size=lim.max_field_size,
            max_headers=lim.max_headers,
            logger=_ServerLog(logging.getLogger("aiohttp.server"), {}),
        )
        await self._runner.setup()
        site = _GatedSite(self._runner, self.host, self.port, self.connections, self.tls)
        await site.start()
        self.port = site.port
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=64),
            skip_auto_headers=SKIPPED_REQUEST_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),  # peers set no cookies: none filtered a request
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

    def name_kind(self, request: web.Request, kind: str) -> None:
        """What ``request`` carries (its message type): its reply counts under ``reply path:kind``."""
        self._kinds[id(request)] = kind

    def reply_route(self, request: web.Request) -> str:
        """The route a reply to ``request`` is counted under in ``bytes_by_route``: a request
        for a path no route serves counts under ``reply (no route)``, so a stranger's made-up
        paths do not grow the counters."""
        if request.match_info.http_exception is not None:
            return "reply (no route)"
        kind = self._kinds.get(id(request))
        return f"reply {route_of(request.path)}" + (f":{kind}" if kind else "")

    def count_sent(self, route: str, n: int) -> None:
        """``n`` bytes put on the wire for ``route``."""
        self.bytes_sent += n
        self.bytes_by_route[route] += n

    async def _body(
        self, url: str, route: str, chunks: Iterable[memoryview | bytes]
    ) -> AsyncIterator[memoryview | bytes]:
        for piece in pieces(chunks):
            await self.link.throttle(url, piece.nbytes)
            self.count_sent(route, piece.nbytes)
            yield piece  # aiohttp writes buffer views as they are: no copy

    async def request(
        self,
        method: str,
        url: str,
        *,
        chunks: Iterable[memoryview | bytes] = (),
        size: int | None = None,
        timeout_s: float = 30.0,
        max_reply: int | None = None,
        kind: str = "",
    ) -> tuple[int, bytearray, int, dict[str, str]]:
        """Send a (streamed) body; return (status, pooled reply buffer, reply length, headers).

        The request counts in ``bytes_by_route`` under its URL's path (fragment numbers left out)
        and ``kind`` (what it carries: a message type), as ``path:kind``. The caller gives the buffer back to ``self.pool`` when done with it.
        Raises ``LinkDropped``, ``aiohttp.ClientError``, ``TimeoutError`` or ``Oversize``.
        """
        route = route_of(urlsplit(url).path) + (f":{kind}" if kind else "")
        await self.link.before_send(url)
        opts = self.client_options(method, url)
        headers = dict(opts.pop("headers"))
        if size is not None:
            headers["Content-Length"] = str(size)
        data = _BodyPayload(self._body(url, route, chunks)) if size else None
        async with asyncio.timeout(timeout_s):
            async with self.session.request(
                method, url, data=data, headers=headers, **opts
            ) as resp:
                info = resp.request_info
                self.count_sent(
                    route,
                    _head_bytes(f"{info.method} {info.url.raw_path_qs} HTTP/1.1", info.headers),
                )
                self.messages_by_route[route] += 1
                length = resp.content_length if method != "HEAD" else 0
                buf, used = await read_stream(
                    resp.content,
                    length,
                    max_reply or self.max_body,
                    self.pool,
                    socket=self._reply_socket(resp, length),
                    length_vouched=True,  # the peer we asked, under max_reply
                )
                self.bytes_received += used
                return resp.status, buf, used, dict(resp.headers)

    @contextlib.asynccontextmanager
    async def reply(
        self,
        method: str,
        url: str,
        *,
        chunks: Iterable[memoryview | bytes] = (),
        size: int | None = None,
        timeout_s: float = 30.0,
        max_reply: int | None = None,
        kind: str = "",
    ) -> AsyncIterator[Reply]:
        """``request`` as a context manager: ``async with transport.reply(...) as r`` gives the
        reply (its body a view into a pooled buffer), and gives the buffer back on exit, so no
        caller frees it by hand. Copy out (``bytes(r.body)``) anything kept past the block, or
        ``r.take()`` the buffer itself; read the body off the loop through ``r.settle``."""
        status, buf, used, headers = await self.request(
            method,
            url,
            chunks=chunks,
            size=size,
            timeout_s=timeout_s,
            max_reply=max_reply,
            kind=kind,
        )
        r = Reply(status, memoryview(buf)[:used], headers, buf)
        try:
            yield r
        finally:
            with contextlib.suppress(BufferError):  # a view the caller kept: it stays valid
                r.body.release()
            if r.buf is not None:  # not taken
                self.pool.give(r.buf)

    def _reply_socket(self, resp: aiohttp.ClientResponse, length: int | None) -> Socket | None:
        """The connection a reply's body arrives on, to read its bulk off (and close after:
        ``node.wire.direct``); None for a reply too short to go direct, or one aiohttp decodes
        (a ``Content-Encoding``)."""
        if length is None or length < DIRECT_MIN:
            return None
        conn = resp.connection
        if (
            conn is None
            or conn.transport is None
            or any(e not in ("", "identity") for e in _encodings(resp.headers))
        ):
            return None

        def spent() -> None:
            self.direct_bodies += 1
            resp.close()

        return Socket(conn.transport, spent)

    def streaming(self, request: web.Request) -> _Streaming:
        """Count a streamed reply to ``request``'s address while it is written (``with``); raises
        ``Busy`` (429) when that address has ``replies_per_ip`` being written already."""
        key = address_key(request.remote or "unknown")
        if self.replies_in_flight[key] >= self.limits.replies_per_ip:
            self.replies_refused += 1
            raise Busy(
                f"{self.replies_in_flight[key]} replies to {key} are being written already "
                f"(at most {self.limits.replies_per_ip} at once); retry later"
            )
        self.replies_in_flight[key] += 1
        return _Streaming(self.replies_in_flight, key)

    async def _reply_prepared(self, request: web.Request, resp: web.StreamResponse) -> None:
        """A reply's head goes out (aiohttp's ``on_response_prepare``, after aiohttp filled in
        its headers, before it writes them): the headers no peer reads come off, the head is
        counted as written, and the reply's deadline starts."""
        for name in DROPPED_REPLY_HEADERS:
            resp.headers.popall(name, None)
        if resp.headers.get(hdrs.CONTENT_TYPE) == _OCTETS:  # the default of a body without one
            del resp.headers[hdrs.CONTENT_TYPE]
        route = request.get(_REPLY_ROUTE) or self.reply_route(request)
        self.count_sent(route, _head_bytes(f"HTTP/1.1 {resp.status} {resp.reason}", resp.headers))
        self.messages_by_route[route] += 1
        gate = self.connections.gate(request.protocol)
        if gate is not None:
            gate.reply_started(resp.content_length)

    def serve_status(self) -> dict[str, object]:
        """What the server's limits did: connections open, refused, evicted, cut off, stalled;
        request bodies and streamed replies in flight, replies refused (for ``/v1/status``)."""
        c = self.connections
        return {
            "open": c.total,
            "refused": c.refused,
            "evicted": c.evicted,
            "head_timeouts": c.head_timeouts,
            "handshakes_failed": c.handshakes_failed,
            "reply_timeouts": c.reply_timeouts,
            "stalled_replies": c.stalled,
            "bodies_in_flight": self.bodies_in_flight.total(),
            "replies_in_flight": self.replies_in_flight.total(),
            "replies_refused": self.replies_refused,
        }

    def hang_up(self, request: web.Request) -> None:
        """Close ``request``'s connection after its reply: its body is left unread, not drained."""
        self._hang_up.add(id(request))

    def _spent(self, request: web.Request) -> None:
        """A request's body was read off its socket: its connection closes after the reply."""
        self.direct_bodies += 1
        self._hang_up.add(id(request))

    async def read_request(
        self,
        request: web.Request,
        max_size: int | None = None,
        *,
        on_head: Callable[[memoryview], Awaitable[int | None]] | None = None,
    ) -> tuple[bytearray, int]:
        """Read a request body into a pooled buffer (see ``read_stream``) under ``self.limits``.

        Raises ``Busy`` when the sender's address (or the server) has too many bodies being read,
        ``Oversize``, ``BodyTimeout``, or ``ClientGone`` when the sender went away (a body with a
        ``Content-Encoding`` never gets here: every route's middleware refuses it unread).
        ``on_head`` may refuse a large body from its first bytes, and until it has had its say the
        body has no more time than a small one (see ``read_stream``). A body not
        read to its end is not drained: the connection is closed after the reply."""
        ip, lim = (
            address_key(request.remote or "unknown"),
            self.limits,
        )  # an IPv6 address by its /64
        if self.bodies_in_flight[ip] >= lim.bodies_per_ip:
            self._hang_up.add(id(request))
            raise Busy(
                f"{self.bodies_in_flight[ip]} request bodies from {ip} are being read already "
                f"(at most {lim.bodies_per_ip} at once); retry later"
            )
        if self.bodies_in_flight.total() >= lim.bodies:
            self._hang_up.add(id(request))
            raise Busy(f"{lim.bodies} request bodies are being read already; retry later")
        self.bodies_in_flight[ip] += 1
        length = request.content_length
        try:
            buf, used = await read_stream(
                request.content,
                length,
                max_size or self.max_body,
                self.pool,
                timeout_s=lim.body_deadline_s(length),
                idle_s=lim.body_idle_s,
                on_head=on_head,
                head_timeout_s=lim.body_deadline_s(
                    None
                ),  # a declared size buys time once its head vouches
                socket=None
                if request.transport is None
                else Socket(request.transport, lambda: self._spent(request)),
            )
        except (
            ConnectionError,
            aiohttp.ClientPayloadError,
            HttpProcessingError,
            RequestPayloadError,
        ) as exc:  # cut off
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

    def _refuse_encoded(self, request: web.Request) -> None:
        """Raise ``EncodedBody`` (and hang up after the reply) for a request whose body has a
        ``Content-Encoding`` other than identity, on any of its lines: aiohttp's C parser inflates
        by the last one, ``headers.get`` reads the first."""
        encodings = _encodings(request.headers)
        if any(e != "identity" for e in encodings):
            self._hang_up.add(id(request))
            raise EncodedBody(
                f"request bodies are not content-encoded: Content-Encoding {', '.join(encodings)[:32]!r} "
                f"refused; send the body as it is"
            )

    def _count_reply(self, request: web.Request, resp: web.StreamResponse) -> None:
        """Add the body of a reply not streamed by us to ``bytes_sent`` (streamed bodies are
        counted as they are written, every head as it goes out: ``_reply_prepared``), and keep
        the reply's route for its head, which aiohttp writes after the route has returned."""
        route = self.reply_route(request)
        request[_REPLY_ROUTE] = route
        body = getattr(resp, "body", None) if not resp.prepared else None
        if isinstance(body, bytes | bytearray | memoryview):
            self.count_sent(route, len(body))

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
                self._refuse_encoded(
                    request
                )  # any route, a missing one too: aiohttp would inflate and drain it
                resp = await handler(request)
            except RemoteProtocolError as exc:
                log.info(
                    "refused %s %s from %s: %s: %s",
                    request.method,
                    request.path,
                    request.remote,
                    type(exc).__name__,
                    exc.reason,
                )
                resp = refusal(exc)
            self._count_reply(request, resp)
            if id(request) not in self._hang_up:
                return resp
            resp.force_close()
            with contextlib.suppress(
                ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError
            ):
                await resp.prepare(request)
                await resp.write_eof()
            request.protocol.force_close()  # the reply is flushed first; no lingering read of the rest
            return resp
        finally:
            self._hang_up.discard(id(request))
            self._kinds.pop(id(request), None)
            if gate is not None:
                gate.request_finished()

    async def stream_reply(
        self,
        request: web.Request,
        chunks: Iterable[memoryview | bytes],
        size: int,
        headers: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        """Reply with a streamed body of ``size`` bytes, in pieces of at most ``REPLY_PIECE``
        bytes. Raises ``Busy`` (429, before anything is written) when ``request``'s address has
        too many streamed replies being written (``streaming``)."""
        resp = web.StreamResponse(status=200, headers=headers)
        resp.content_type = "application/octet-stream"
        resp.content_length = size
        with self.streaming(request):
            try:
                await resp.prepare(request)
                route = self.reply_route(request)
                with writing_when_empty(request.transport):
                    await self._write_pieces(resp, request, route, chunks)
                await resp.write_eof()
            except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
                # the asker went away (timed out, shut down, or cut off for not reading): nothing to answer
                log.debug("reply to %s abandoned: %r", request.remote, exc)
        return resp

    async def _write_pieces(
        self,
        resp: web.StreamResponse,
        request: web.Request,
        route: str,
        chunks: Iterable[memoryview | bytes],
    ) -> None:
        for piece in pieces(chunks):
            await self.link.throttle(str(request.remote), piece.nbytes)
            await resp.write(piece)
            self.count_sent(route, piece.nbytes)
