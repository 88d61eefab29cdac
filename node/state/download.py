"""One resumable download of an owner-sealed body (``_Download``), with its retry policy
(``FetchConfig``), what it did (``FetchStats``), the bytes kept for a resume (``PartialDownload``)
and its failure (``DownloadFailed``). ``node.state.fetch`` drives it.

Fetching (``fetch_sealed``). The body goes into one pooled buffer that grows with the bytes
that actually arrive, up to the Content-Length (itself capped before anything is read): a
server that claims a huge body and sends a few bytes costs a chunk, not the claim. As soon as
the envelope (<= 516 bytes) is in, its signature, the signer and the declared size are checked,
so a wrong owner costs a few hundred bytes, not the fragment; once the expected owner has
signed the size, the buffer takes it at once (no doubling). A connection error, a stalled
chunk (``chunk_timeout_s``) or a 5xx keeps the bytes so far and retries with ``Range:
bytes=<have>-`` and ``If-Range: <etag>`` after an exponential backoff; ``retries`` consecutive
failures without a chunk of progress give up with ``DownloadFailed``, whose ``partial`` a later
call (to any peer with the same version) can resume. The whole message is then checked with
``verify_sealed``: a corrupt byte anywhere makes the content hash mismatch, the buffer is
discarded and the download restarts from 0, once; corruption twice is refused with
``DownloadFailed``. A corrupt state is never returned.

Chunk manifests (see ``node.state.serve``) are a hint, for early detection: a chunk that fails
its hash is dropped and just that range is re-requested (Range + If-Range); a chunk that fails
twice means the manifest itself is suspect, so it is dropped and the owner-signed
whole-message hash, always checked at the end, decides. A lying manifest thus costs about two
chunks of traffic before it is ignored, never a bad state.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aiohttp

from node.state.serve import Manifest, etag_version, parse_content_range, unquote_etag
from node.wire.transport import CHUNK, Transport
from protocol.errors import NotAuthorized, Oversize, RemoteProtocolError
from protocol.ids import peer_id_from_public_key
from protocol.wire.signing import (
    MAX_ENVELOPE,
    Opened,
    envelope_length,
    open_envelope,
    verify_sealed,
)

__all__ = ["DownloadFailed", "FetchConfig", "FetchStats", "PartialDownload"]

log = logging.getLogger("node.state.sync")  # the name it logged under before the split

_PREFIX = 4  # the u32 envelope length in front of every sealed message
_TRANSIENT = (aiohttp.ClientError, ConnectionError, TimeoutError)


class DownloadFailed(RemoteProtocolError):
    """A download given up; ``partial`` (if any) holds the bytes so far, for a later resume."""

    status = 502

    def __init__(self, reason: str, partial: PartialDownload | None = None) -> None:
        super().__init__(reason, penalty=0.0)
        self.partial = partial


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """Retry policy: ``retries`` consecutive transient failures without a CHUNK of progress;
    ``restarts`` full restarts after a corrupt body; ``version_changes`` restarts because the
    server's version moved during a resume."""

    retries: int = 4
    backoff_s: float = 0.5
    backoff_cap_s: float = 8.0
    restarts: int = 1
    version_changes: int = 3


@dataclass
class FetchStats:
    """What one download did: every HTTP status in order, bytes, and why it retried."""

    statuses: list[int] = field(default_factory=list)
    ranges: list[str] = field(default_factory=list)  # the Range header sent, "" for none
    bytes_received: int = 0
    restarts: int = 0
    version_changes: int = 0
    refetched_chunks: int = 0
    manifest_used: bool = False
    reasons: list[str] = field(default_factory=list)


@dataclass
class PartialDownload:
    """The first ``have`` bytes of the ``total``-byte body named by ``etag``, in ``buffer``
    (which may be shorter than ``total``: it grows as the rest arrives).

    Not resuming it? Give ``buffer`` back to ``transport.pool``."""

    etag: str
    total: int
    have: int
    buffer: bytearray


class _Transient(Exception):
    """This attempt failed in a way worth retrying with the bytes kept."""


_REFETCH = "refetch"  # abandon this response, ask again at once (from self.have)
_SKIP = "skip"  # the server has nothing newer than the caller holds


class _Download:
    """One resumable download of a sealed body into one pooled buffer (see the docstring)."""

    def __init__(
        self,
        transport: Transport,
        url: str,
        *,
        max_size: int,
        expected_signer: bytes | None,
        chunk_timeout_s: float,
        config: FetchConfig,
        stats: FetchStats,
    ) -> None:
        self.transport, self.url, self.max_size = transport, url, max_size
        self.expected_signer, self.chunk_timeout_s = expected_signer, chunk_timeout_s
        self.cfg, self.stats = config, stats
        self.cap = _PREFIX + MAX_ENVELOPE + max_size
        self.manifest: Manifest | None = None
        self.newer_than: int | None = None
        self.buf: bytearray | None = None
        self.view = memoryview(b"")
        self.etag: str | None = None
        self.total = self.have = self.got = self.verified = 0
        self.env_checked = False
        self.chunk_failures: dict[int, int] = {}

    def resume_from(self, partial: PartialDownload) -> None:
        if not (
            0 <= partial.have <= partial.total <= self.cap and partial.have <= len(partial.buffer)
        ):
            raise ValueError(
                f"inconsistent partial download {partial.have}/{partial.total} "
                f"in a buffer of {len(partial.buffer)} bytes"
            )
        self.buf, self.view = partial.buffer, memoryview(partial.buffer)[: partial.total]
        self.etag, self.total, self.have = partial.etag, partial.total, partial.have

    def release(self) -> None:
        if self.buf is not None:
            self.view = memoryview(b"")
            self.transport.pool.give(self.buf)
            self.buf = None

    def partial(self) -> PartialDownload | None:
        if self.buf is None or not self.etag or not self.have:
            return None
        return PartialDownload(etag=self.etag, total=self.total, have=self.have, buffer=self.buf)

    def _note(self, reason: str) -> None:
        self.stats.reasons.append(reason)
        log.info("%s: %s", self.url, reason)

    # --- the retry loop --------------------------------------------------------------------
    async def run(self) -> Opened | None:
        """The verified message, or None for _SKIP. Raises DownloadFailed, NotAuthorized,
        Oversize or RemoteProtocolError (a 4xx answer)."""
        failures = 0
        while True:
            if not self.total or self.have < self.total:
                self.got = 0
                try:
                    outcome = await self._attempt()
                except (*_TRANSIENT, _Transient) as e:
                    failures = 1 if self.got >= CHUNK else failures + 1
                    self._note(f"attempt failed at {self.have}/{self.total} bytes: {e!r}")
                    if failures > self.cfg.retries:
                        raise DownloadFailed(
                            f"{self.url}: gave up after {failures} failed attempts "
                            f"in a row ({e!r})",
                            self.partial(),
                        ) from e
                    await asyncio.sleep(
                        min(self.cfg.backoff_cap_s, self.cfg.backoff_s * 2 ** (failures - 1))
                    )
                    continue
                if outcome == _SKIP:
                    return None
                if outcome == _REFETCH:
                    continue
            opened = await self._verify()
            if opened is not None:
                return opened

    async def _attempt(self) -> str | None:
        headers = {}
        if self.etag and self.total:  # resuming, or re-fetching a bad chunk (maybe chunk 0)
            headers = {"Range": f"bytes={self.have}-", "If-Range": f'"{self.etag}"'}
        self.stats.ranges.append(headers.get("Range", ""))
        await self.transport.link.before_send(self.url)
        try:
            outcome = await self._exchange(headers)
        except TimeoutError:
            raise _Transient(
                f"nothing arrived for {self.chunk_timeout_s:.1f} s "
                f"(at {self.have}/{self.total} bytes)"
            ) from None
        if outcome is not None:
            return outcome
        if self.have != self.total:
            raise _Transient(f"body ended at {self.have}/{self.total} bytes")
        return None

    async def _exchange(self, headers: dict[str, str]) -> str | None:
        """One request; its body fed in as it arrives, with at most ``chunk_timeout_s`` between
        chunks. Raises TimeoutError past that."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.chunk_timeout_s) as deadline:
            opts = self.transport.client_options("GET", self.url)
            opts["headers"].update(headers)
            async with self.transport.session.get(self.url, **opts) as resp:
                outcome = self._on_response(resp)
                if outcome is None:
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        deadline.reschedule(loop.time() + self.chunk_timeout_s)
                        outcome = self._feed(chunk)
                        if outcome is not None:
                            break
                if outcome is not None:
                    resp.close()  # drop the connection rather than drain the rest
                return outcome

    # --- one response ----------------------------------------------------------------------
    def _on_response(self, resp: aiohttp.ClientResponse) -> str | None:
        status, etag = resp.status, unquote_etag(resp.headers.get("ETag"))
        self.stats.statuses.append(status)
        if status == 206:
            self._on_partial_content(resp.headers.get("Content-Range", ""), etag)
            return None
        if status == 416 or status >= 500:
            self._reset(f"server answered {status}")
            raise _Transient(f"server answered {status}")
        if status != 200:
            raise RemoteProtocolError(f"{self.url} answered {status}")
        total = resp.content_length
        if total is None or total > self.cap:
            raise Oversize(
                f"{self.url}: body of {total} bytes (cap {self.cap}, Content-Length required)"
            )
        version = etag_version(etag)
        if self.newer_than is not None and version is not None and version <= self.newer_than:
            self._note(f"server's version {version} is not newer than the {self.newer_than} held")
            return _SKIP
        if self.have:
            self.stats.version_changes += 1
            self._note(f"whole body sent again (ETag {self.etag} -> {etag}): restarting from 0")
            if self.stats.version_changes > self.cfg.version_changes:
                raise DownloadFailed(
                    f"{self.url}: version changed {self.stats.version_changes} "
                    "times during the download"
                )
        self._begin(total, etag)
        return None

    def _on_partial_content(self, content_range: str, etag: str | None) -> None:
        span = parse_content_range(content_range)
        if etag != self.etag or span != (self.have, self.total, self.total):
            self._reset(f"inconsistent 206 (Content-Range {content_range!r}, ETag {etag!r})")
            raise _Transient("inconsistent 206")

    def _begin(self, total: int, etag: str | None) -> None:
        if self.buf is None:  # the claimed total is only an upper bound: _feed grows the buffer
            self.buf = self.transport.pool.take(total, fresh=CHUNK)
        self.view = memoryview(self.buf)[:total]
        self.total, self.etag = total, etag
        self._reset(None)
        m = self.manifest
        if m is not None and (m.etag != etag or m.size != total):
            self._note(f"manifest is for {m.etag}, body is {etag}: manifest dropped")
            self.manifest = None

    def _reset(self, reason: str | None) -> None:
        """Forget the bytes held: the next request asks for the whole body."""
        if reason is not None:
            self._note(f"{reason}: discarding {self.have} bytes")
            self.etag = None
        self.have = self.verified = 0
        self.env_checked = False
        self.chunk_failures.clear()

    def _feed(self, chunk: bytes) -> str | None:
        end = self.have + len(chunk)
        if end > self.total:
            raise _Transient(f"body longer than the {self.total} bytes declared")
        self._reserve(end)
        self.view[self.have : end] = chunk
        self.have, self.got = end, self.got + len(chunk)
        self.stats.bytes_received += len(chunk)
        self.transport.bytes_received += len(chunk)
        outcome = None if self.env_checked else self._check_envelope()
        if outcome is None and self.manifest is not None:
            outcome = self._check_chunks(self.manifest)
        return outcome

    def _reserve(self, need: int) -> None:
        """Make the buffer hold at least ``need`` bytes (doubling, up to ``total``), keeping the
        bytes so far."""
        if need > len(self.view):
            assert self.buf is not None
            self.view = memoryview(b"")  # no view of the old buffer once the pool has it back
            self.buf = self.transport.pool.grow(self.buf, self.have, need, self.total)
            self.view = memoryview(self.buf)[: self.total]

    def _check_envelope(self) -> str | None:
        """Signature, signer and size from the first ~200 bytes, before the rest arrives."""
        if self.have < _PREFIX:
            return None
        try:
            end = _PREFIX + envelope_length(self.view)
        except RemoteProtocolError as e:
            return self._restart(f"bad envelope prefix: {e.reason}")
        if self.have < end:
            return None
        try:
            env = open_envelope(self.view[_PREFIX:end], max_size=self.max_size)
        except Oversize:
            raise  # authentic: the signature verified before the size was checked
        except RemoteProtocolError as e:
            return self._restart(f"envelope refused: {e.reason}")
        self._check_signer(peer_id_from_public_key(env.public_key))
        if end + env.size != self.total:
            return self._restart(
                f"envelope declares {end + env.size} bytes, server sends {self.total}"
            )
        self.env_checked = True
        if (
            self.expected_signer is not None
        ):  # the owner signed this size: no need to creep up to it
            self._reserve(self.total)
        return None

    def _check_chunks(self, m: Manifest) -> str | None:
        while self.verified * m.chunk_size < m.size and self.have >= m.span(self.verified)[1]:
            k = self.verified
            a, b = m.span(k)
            if m.ok(k, self.view[a:b]):
                self.verified += 1
                continue
            self.stats.refetched_chunks += 1
            self.chunk_failures[k] = self.chunk_failures.get(k, 0) + 1
            if self.chunk_failures[k] > 1:
                self._note(
                    f"chunk {k} failed its manifest hash twice: manifest dropped, "
                    "the owner-signed hash decides"
                )
                self.manifest = None
                return None
            self._note(f"chunk {k} [{a}, {b}) failed its manifest hash: re-fetching from {a}")
            self.have = a
            return _REFETCH
        return None

    def _restart(self, reason: str) -> str:
        """A corrupt body: start again from 0, or give up once the restarts are spent."""
        self.stats.restarts += 1
        if self.stats.restarts > self.cfg.restarts:
            raise DownloadFailed(
                f"{self.url}: {reason}; refused after {self.stats.restarts} downloads"
            )
        self.manifest = None  # it vouched for corrupt bytes, or was beside the point
        self._reset(f"{reason}; restarting from 0")
        return _REFETCH

    def _check_signer(self, peer_id: bytes) -> None:
        if self.expected_signer is not None and peer_id != self.expected_signer:
            raise NotAuthorized(
                f"{self.url}: state signed by {peer_id.hex()[:16]}, "
                f"not the expected owner {self.expected_signer.hex()[:16]}"
            )

    async def _verify(self) -> Opened | None:
        try:
            opened = await asyncio.to_thread(verify_sealed, self.view, max_size=self.max_size)
        except RemoteProtocolError as e:
            self._restart(f"verification failed: {e.reason}")
            return None
        self._check_signer(opened.peer_id)
        return opened
