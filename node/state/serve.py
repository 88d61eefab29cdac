"""State serving: answer requests for a sealed global fragment and its chunk manifest.

The fetching half, which downloads, resumes and verifies what is served here, is
``node.state.sync``.

Theory of operation. An owner's latest ``FragmentState`` is a ``Sealed`` blob: the envelope
carries the owner's Ed25519 signature over the BLAKE3 digest of the exact message bytes, so anyone
holding the bytes may re-serve them and the receiver still knows they are the owner's.

Serving (``serve_sealed``). The wire form is streamed in <= ``CHUNK`` views of the sealed
parts, never joined. ``Range: bytes=N-`` / ``N-M`` / ``-K`` get a 206 with ``Content-Range``;
multi-ranges and malformed ranges get the whole body (RFC 9110 lets a server ignore Range);
a range past the end, or with a position of more than ``MAX_RANGE_DIGITS`` digits, gets 416
with a reason. The strong ETag ``v<version>-<sha256(envelope)[:16] hex>``
names the exact bytes (the envelope holds the message hash, timestamp and nonce), so replicas
re-serving the same version answer with the same ETag. ``If-Range`` with another ETag gets the
whole new body with 200, so a resume never splices two versions together.

Chunk manifests (``chunk_manifest``, ``serve_manifest``). Optional, for early detection: the
sha256 of every ``chunk_size`` slice of the wire form, served as msgpack ``[etag, size,
chunk_size, hashes]``. The manifest is deliberately *not* signed: whoever serves the bytes
could sign wrong hashes just as well, and only the owner's signature counts. It is a hint:
a chunk that fails its hash is dropped and just that range is re-requested (Range + If-Range);
a chunk that fails twice means the manifest itself is suspect, so it is dropped and the
owner-signed whole-message hash, always checked at the end, decides. A lying manifest thus
costs about two chunks of traffic before it is ignored, never a bad state. ``Manifest.parse``
is what a fetcher uses to read one.

A peer serves these with, e.g. ``serve_sealed(request, transport, owner.latest,
etag=state_etag(owner.latest, owner.version))`` and ``serve_manifest(request, owner.latest,
etag=..., cache=ManifestCache())`` (one cache per node).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgpack
from aiohttp import web

from node.wire.transport import CHUNK, Transport, pieces
from protocol.errors import DecodeError, RemoteProtocolError
from protocol.wire.signing import Sealed

__all__ = [
    "HASH",
    "MAX_MANIFEST_CHUNK",
    "MAX_RANGE_DIGITS",
    "MIN_MANIFEST_CHUNK",
    "Manifest",
    "ManifestCache",
    "RangeNotSatisfiable",
    "chunk_manifest",
    "encode_manifest",
    "etag_version",
    "parse_content_range",
    "parse_range",
    "serve_manifest",
    "serve_sealed",
    "state_etag",
    "unquote_etag",
]

log = logging.getLogger(__name__)

HASH = 32
MIN_MANIFEST_CHUNK = 64 << 10
MAX_MANIFEST_CHUNK = 64 << 20
MAX_RANGE_DIGITS = 19  # 10**19 bytes is past any body; longer numbers are refused unparsed
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
# ASCII digits, at most MAX_RANGE_DIGITS: int() of a longer string costs quadratic time, and
# past 4300 digits raises ValueError instead of answering
_DIGITS = f"([0-9]{{1,{MAX_RANGE_DIGITS}}})"
_ETAG = re.compile(f"v{_DIGITS}-[0-9a-f]+")
_CONTENT_RANGE = re.compile(f"bytes {_DIGITS}-{_DIGITS}/{_DIGITS}")


class RangeNotSatisfiable(RemoteProtocolError):
    """A Range that starts at or past the end of the body."""

    status = 416


# ── serving ──────────────────────────────────────────────────────────────────────────────────
def state_etag(sealed: Sealed, version: int) -> str:
    """The strong ETag (unquoted) naming these exact sealed bytes of ``version``."""
    return f"v{version}-{hashlib.sha256(sealed.envelope).hexdigest()[:32]}"


def etag_version(etag: str | None) -> int | None:
    """The version in a ``state_etag`` (None if it is not one). Unauthenticated: a hint."""
    m = _ETAG.fullmatch(etag or "")
    return int(m.group(1)) if m else None


def parse_range(value: str, size: int) -> tuple[int, int] | None:
    """``(start, end_exclusive)`` for a single-range ``Range`` header, or None to serve the
    whole body (malformed or multi-range). Raises RangeNotSatisfiable past the end."""
    m = _RANGE.fullmatch(value.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    if max(len(m.group(1)), len(m.group(2))) > MAX_RANGE_DIGITS:
        raise RangeNotSatisfiable(
            f"range position of more than {MAX_RANGE_DIGITS} digits (a {size}-byte body)"
        )
    if not m.group(1):  # suffix: the last K bytes
        k = int(m.group(2))
        if k == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range of {k} bytes of a {size}-byte body")
        return max(0, size - k), size
    start = int(m.group(1))
    end = min(size, int(m.group(2)) + 1) if m.group(2) else size
    if start >= size:
        raise RangeNotSatisfiable(f"range starts at {start}, body is {size} bytes")
    return (start, end) if end > start else None


def parse_content_range(value: str) -> tuple[int, int, int] | None:
    """``(start, end_exclusive, total)`` from a 206's ``Content-Range: bytes S-E/T``, or None if
    it is not one (positions of more than ``MAX_RANGE_DIGITS`` digits included)."""
    m = _CONTENT_RANGE.fullmatch(value)
    return (int(m[1]), int(m[2]) + 1, int(m[3])) if m else None


def unquote_etag(etag: str | None) -> str | None:
    """An ETag or If-Range header value without its quotes (None stays None)."""
    return etag.strip().strip('"') if etag is not None else None


def _byte_range(sealed: Sealed, start: int, end: int) -> Iterator[memoryview]:
    """The wire form's bytes ``[start, end)`` as views of at most CHUNK bytes."""
    offset = 0
    for chunk in sealed.iter_chunks(CHUNK):
        lo, hi = max(start - offset, 0), min(end - offset, chunk.nbytes)
        if lo < hi:
            yield chunk[lo:hi]
        offset += chunk.nbytes
        if offset >= end:
            return


async def serve_sealed(
    request: web.Request, transport: Transport, sealed: Sealed, *, etag: str
) -> web.StreamResponse:
    """Stream ``sealed`` honouring Range and If-Range (see the module docstring)."""
    size = sealed.size
    headers = {"ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
    span: tuple[int, int] | None = None
    if_range = unquote_etag(request.headers.get("If-Range"))
    if "Range" in request.headers and if_range in (None, etag):
        try:
            span = parse_range(request.headers["Range"], size)
        except RangeNotSatisfiable as exc:
            return web.json_response(
                {"error": "RangeNotSatisfiable", "reason": exc.reason},
                status=416,
                headers={**headers, "Content-Range": f"bytes */{size}"},
            )
    start, end = span or (0, size)
    with transport.streaming(request):  # Busy (429) when this address has too many being written
        return await _stream(request, transport, sealed, headers, span, start, end, etag)


async def _stream(
    request: web.Request,
    transport: Transport,
    sealed: Sealed,
    headers: dict[str, str],
    span: tuple[int, int] | None,
    start: int,
    end: int,
    etag: str,
) -> web.StreamResponse:
    """Write bytes ``[start, end)`` of ``sealed`` in pieces of at most ``REPLY_PIECE`` bytes (a
    reader that stops pins about one piece in our buffer); the connection's gate cuts off a reply
    that stalls or misses its deadline (``node.wire.connections``), which ends here as a
    ``ConnectionError``."""
    size = sealed.size
    resp = web.StreamResponse(status=206 if span else 200, headers=headers)
    if span:
        resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    resp.content_type = "application/octet-stream"
    resp.content_length = end - start
    sent = 0
    try:
        await resp.prepare(request)
        route = transport.reply_route(request)
        for chunk in pieces(_byte_range(sealed, start, end)) if request.method != "HEAD" else ():
            await transport.link.throttle(str(request.remote), chunk.nbytes)
            await resp.write(chunk)
            sent += chunk.nbytes
            transport.count_sent(route, chunk.nbytes)
        await resp.write_eof()
    except (
        ConnectionError
    ) as e:  # the client went away (or was cut off for not reading); it resumes with a Range
        log.info("%s left after %d/%d bytes of %s: %s", request.remote, sent, end - start, etag, e)
        if request.transport is not None:
            request.transport.close()  # never leave a short body on a live connection
    return resp


# ── manifests ────────────────────────────────────────────────────────────────────────────────
def chunk_manifest(sealed: Sealed, chunk_size: int = CHUNK) -> list[bytes]:
    """sha256 of each ``chunk_size`` slice of the wire form (the last may be short)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out, h, filled = [], hashlib.sha256(), 0
    for piece in sealed.iter_chunks(CHUNK):
        while piece.nbytes:
            take = min(chunk_size - filled, piece.nbytes)
            h.update(piece[:take])
            piece, filled = piece[take:], filled + take
            if filled == chunk_size:
                out.append(h.digest())
                h, filled = hashlib.sha256(), 0
    if filled:
        out.append(h.digest())
    return out


def encode_manifest(hashes: Sequence[bytes], *, etag: str, size: int, chunk_size: int) -> bytes:
    """The manifest's wire form: msgpack ``[etag, size, chunk_size, concatenated hashes]``."""
    return msgpack.packb([etag, size, chunk_size, b"".join(hashes)], use_bin_type=True)


@dataclass(frozen=True, slots=True)
class Manifest:
    """Chunk hashes of the body named by ``etag`` (unsigned: a hint, see the docstring)."""

    etag: str
    size: int
    chunk_size: int
    hashes: bytes

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview, *, max_total: int) -> Manifest:
        """Raises DecodeError for anything but a well-formed manifest of <= ``max_total`` bytes."""
        try:
            raw = msgpack.unpackb(
                data,
                raw=False,
                use_list=False,
                max_str_len=128,
                max_map_len=0,
                max_array_len=4,
                max_ext_len=0,
                max_bin_len=HASH * (max_total // MIN_MANIFEST_CHUNK + 1),
            )
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
            raise DecodeError(f"malformed manifest: {e}") from e
        ok = (
            type(raw) is tuple
            and len(raw) == 4
            and [type(x) for x in raw] == [str, int, int, bytes]
        )
        if (
            not ok
            or not (0 < raw[1] <= max_total)
            or not MIN_MANIFEST_CHUNK <= raw[2] <= MAX_MANIFEST_CHUNK
        ):
            raise DecodeError(
                "manifest must be [etag, 0 < size <= cap, 64 KiB <= chunk <= 64 MiB, hashes]"
            )
        if len(raw[3]) != HASH * -(-raw[1] // raw[2]):
            raise DecodeError(f"manifest has {len(raw[3]) // HASH} hashes for {raw[1]} bytes")
        return cls(*raw)

    def span(self, k: int) -> tuple[int, int]:
        return k * self.chunk_size, min((k + 1) * self.chunk_size, self.size)

    def ok(self, k: int, data: memoryview) -> bool:
        return hashlib.sha256(data).digest() == self.hashes[k * HASH : (k + 1) * HASH]


class ManifestCache:
    """Manifests of the last few versions served, computed once each off the event loop."""

    def __init__(self, chunk_size: int = CHUNK, capacity: int = 16) -> None:
        self.chunk_size, self.capacity = chunk_size, capacity
        self._cache: dict[str, bytes] = {}
        self._lock = asyncio.Lock()

    async def get(self, sealed: Sealed, etag: str) -> bytes:
        async with self._lock:
            if etag not in self._cache:
                hashes = await asyncio.to_thread(chunk_manifest, sealed, self.chunk_size)
                if len(self._cache) >= self.capacity:
                    del self._cache[next(iter(self._cache))]
                self._cache[etag] = encode_manifest(
                    hashes, etag=etag, size=sealed.size, chunk_size=self.chunk_size
                )
            return self._cache[etag]


async def serve_manifest(
    request: web.Request, sealed: Sealed, *, etag: str, cache: ManifestCache
) -> web.Response:
    """Reply with the chunk manifest of ``sealed`` (msgpack, ETag as for the body)."""
    body = await cache.get(sealed, etag)
    return web.Response(
        body=body, content_type="application/msgpack", headers={"ETag": f'"{etag}"'}
    )
