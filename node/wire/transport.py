"""HTTP transport: one aiohttp server, one client session, size caps, link emulation.

``Transport`` turns HTTP into bytes and back and nothing more: ``rpc`` decides what the bytes
mean. Bodies travel in chunks of at most ``CHUNK`` bytes and are read into pooled buffers, so a
fragment of hundreds of MB is never concatenated or copied twice (fresh memory is slow to fill
on small machines). The server binds port 0 and announces the real port only once bound.

Kernel traffic shaping is not available on every machine, so ``LinkEmulator`` adds latency,
a bandwidth cap and a drop rate to this node's outbound requests, per destination.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from protocol.errors import Oversize

__all__ = ["CHUNK", "BufferPool", "LinkDropped", "LinkEmulator", "LinkProfile", "Transport"]

log = logging.getLogger(__name__)

CHUNK = 1 << 20


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
    """Reusable bytearrays, so receiving a fragment does not fault in fresh memory each time."""

    def __init__(self, max_buffers: int = 8) -> None:
        self._free: list[bytearray] = []
        self._max = max_buffers

    def take(self, size: int) -> bytearray:
        best = min((b for b in self._free if len(b) >= size), key=len, default=None)
        if best is not None:
            self._free.remove(best)
            return best
        return bytearray(max(size, CHUNK))

    def give(self, buf: bytearray) -> None:
        if len(self._free) < self._max:
            self._free.append(buf)


async def read_stream(
    content: aiohttp.StreamReader, length: int | None, max_size: int, pool: BufferPool
) -> tuple[bytearray, int]:
    """Read a body into a pooled buffer; return (buffer, used bytes). Caller gives it back.

    Raises ``Oversize`` as soon as the body (declared or actual) exceeds ``max_size``.
    """
    if length is not None and length > max_size:
        raise Oversize(f"body of {length} bytes exceeds the cap of {max_size}")
    buf = pool.take(length if length is not None else CHUNK)
    used = 0
    try:
        async for chunk in content.iter_chunked(CHUNK):
            end = used + len(chunk)
            if end > max_size:
                raise Oversize(f"body exceeds the cap of {max_size} bytes")
            if end > len(buf):
                grown = bytearray(min(max(end, 2 * len(buf)), max_size))
                grown[:used] = memoryview(buf)[:used]
                pool.give(buf)
                buf = grown
            buf[used:end] = chunk
            used = end
    except BaseException:
        pool.give(buf)
        raise
    return buf, used


class Transport:
    """One aiohttp server bound to ``host:port`` (port 0 picks a free one) and one client session."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_body: int = 512 << 20,
        link: LinkEmulator | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.max_body = max_body
        self.link = link or LinkEmulator()
        self.app = web.Application(client_max_size=max_body)
        self.pool = BufferPool()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Bind and start serving; return the real URL (with the port the OS chose)."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
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
        headers = {"Content-Type": "application/octet-stream"}
        if size is not None:
            headers["Content-Length"] = str(size)
        data = self._body(url, chunks) if size else None
        async with asyncio.timeout(timeout_s):
            async with self.session.request(method, url, data=data, headers=headers) as resp:
                buf, used = await read_stream(
                    resp.content, resp.content_length, max_reply or self.max_body, self.pool
                )
                self.bytes_received += used
                return resp.status, buf, used, dict(resp.headers)

    async def read_request(self, request: web.Request, max_size: int | None = None) -> tuple[bytearray, int]:
        """Read a request body into a pooled buffer (see ``read_stream``)."""
        buf, used = await read_stream(
            request.content, request.content_length, max_size or self.max_body, self.pool
        )
        self.bytes_received += used
        return buf, used

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
