"""Fetching one owner-sealed message: ``fetch_sealed``, with a chunk manifest if one is served.

How a download proceeds (resume, early envelope check, chunk hashes, the final check of the
whole message) is told and done in ``node.state.download``.
"""

from __future__ import annotations

import logging

from node.state.download import (
    _TRANSIENT,
    DownloadFailed,
    FetchConfig,
    FetchStats,
    PartialDownload,
    _Download,
)
from node.state.serve import HASH, MIN_MANIFEST_CHUNK, Manifest, etag_version
from node.wire.transport import Transport
from protocol.errors import DecodeError, Oversize
from protocol.wire.signing import Opened

__all__ = ["fetch_sealed"]

log = logging.getLogger("node.state.sync")  # the name it logged under before the split


# ── manifests ────────────────────────────────────────────────────────────────────────────────
async def _fetch_manifest(
    transport: Transport, url: str, max_total: int, timeout_s: float
) -> Manifest | None:
    cap = 256 + HASH * (max_total // MIN_MANIFEST_CHUNK + 1)
    try:
        async with transport.reply("GET", url, timeout_s=timeout_s, max_reply=cap) as r:
            return Manifest.parse(r.body, max_total=max_total) if r.status == 200 else None
    except (*_TRANSIENT, Oversize) as e:
        log.info("no manifest from %s (%s); relying on the whole-message hash", url, e)
        return None
    except DecodeError as e:
        log.info("ignoring manifest from %s: %s", url, e.reason)
        return None


async def _fetch(
    transport: Transport,
    url: str,
    *,
    max_size: int,
    expected_signer: bytes | None,
    resume: PartialDownload | None,
    chunk_timeout_s: float,
    manifest_url: str | None,
    newer_than: int | None,
    config: FetchConfig | None,
    stats: FetchStats | None,
) -> tuple[Opened, bytearray] | None:
    """``fetch_sealed`` returning the buffer too (the caller owns it), or None if not newer."""
    dl = _Download(
        transport,
        url,
        max_size=max_size,
        expected_signer=expected_signer,
        chunk_timeout_s=chunk_timeout_s,
        config=config or FetchConfig(),
        stats=stats if stats is not None else FetchStats(),
    )
    dl.newer_than = newer_than
    if manifest_url is not None:
        dl.manifest = await _fetch_manifest(transport, manifest_url, dl.cap, chunk_timeout_s)
        dl.stats.manifest_used = dl.manifest is not None
        version = etag_version(dl.manifest.etag) if dl.manifest else None
        if newer_than is not None and version is not None and version <= newer_than:
            dl._note(f"manifest names version {version}, not newer than the {newer_than} held")
            return None
    if resume is not None:
        dl.resume_from(resume)
    try:
        opened = await dl.run()
    except DownloadFailed as e:
        if e.partial is None:
            dl.release()
        raise
    except BaseException:
        dl.release()
        raise
    if opened is None or dl.buf is None:
        dl.release()
        return None
    return opened, dl.buf


async def fetch_sealed(
    transport: Transport,
    url: str,
    *,
    max_size: int,
    expected_signer: bytes | None,
    resume: PartialDownload | None = None,
    chunk_timeout_s: float = 30.0,
    manifest_url: str | None = None,
    config: FetchConfig | None = None,
    stats: FetchStats | None = None,
) -> Opened:
    """Download and verify the sealed message at ``url`` (see ``node.state.download``).

    ``expected_signer`` is the owner's peer id (None: any signer). ``resume`` continues an
    earlier ``DownloadFailed.partial`` (its buffer is taken over). ``manifest_url`` serves a
    chunk manifest; without one, only the whole-message hash is checked. ``stats`` is filled
    in. The returned message's blobs are views of a buffer it alone owns.

    Raises NotAuthorized (wrong signer), Oversize (over ``max_size``), RemoteProtocolError
    (a 4xx answer) and DownloadFailed (retries or restarts spent; ``partial`` may resume).
    """
    result = await _fetch(
        transport,
        url,
        max_size=max_size,
        expected_signer=expected_signer,
        resume=resume,
        chunk_timeout_s=chunk_timeout_s,
        manifest_url=manifest_url,
        newer_than=None,
        config=config,
        stats=stats,
    )
    if result is None:
        raise RuntimeError("unreachable: a download without newer_than is never skipped")
    return result[0]
