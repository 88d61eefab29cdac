"""State sync: a joining or restarted peer downloads every global fragment, resumably.

Theory of operation. An owner's latest ``FragmentState`` is a ``Sealed`` blob: the envelope
carries the owner's Ed25519 signature over the BLAKE3 digest of the exact message bytes, so anyone
holding the bytes may re-serve them and the receiver still knows they are the owner's. The
serving half (``serve_sealed``, ``serve_manifest``, ETags, Range parsing, chunk manifests)
lives in ``node.state.serve``, and is re-exported here.

The fetching half, ``fetch_sealed`` (one resumable, verified download), lives in
``node.state.fetch``; how a download proceeds (resume, early envelope check, chunk manifests,
the whole-message check) is told in ``node.state.download``. Both are re-exported here.

``sync_fragments`` runs one such download per fragment concurrently (bounded), against
``{owner_url}/v1/fragments/{p}/latest`` (manifest: that URL + ``/manifest``; a 404 there just
means no manifest). A version the peer already holds is skipped as early as the manifest's or
the body's ETag says so (a hint: at worst a lying server makes us skip, which it could by not
answering), and in any case after verification. Signer, swarm and fragment are checked, then
the state is decompressed with ``flat_from_tensors``. An owner serving an *older* version than
the one held is skipped with a logged reason: the peer keeps what it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import torch

from node.diloco.flat import flat_from_tensors
from node.state.download import DownloadFailed, FetchConfig, FetchStats, PartialDownload
from node.state.fetch import _fetch, fetch_sealed
from node.state.serve import (
    Manifest,
    ManifestCache,
    RangeNotSatisfiable,
    chunk_manifest,
    encode_manifest,
    etag_version,
    parse_range,
    serve_manifest,
    serve_sealed,
    state_etag,
)
from node.wire.transport import Transport
from protocol.errors import DecodeError, RemoteProtocolError
from protocol.wire.messages import FragmentState

__all__ = [
    "DownloadFailed",
    "FetchConfig",
    "FetchStats",
    "Manifest",
    "ManifestCache",
    "PartialDownload",
    "RangeNotSatisfiable",
    "SyncFailed",
    "chunk_manifest",
    "encode_manifest",
    "etag_version",
    "fetch_sealed",
    "parse_range",
    "serve_manifest",
    "serve_sealed",
    "state_etag",
    "sync_fragments",
]

log = logging.getLogger(__name__)


class SyncFailed(RemoteProtocolError):
    """Some fragments could not be synced; ``fetched`` holds the ones that were."""

    def __init__(
        self,
        failures: dict[int, str],
        fetched: dict[int, tuple[int, torch.Tensor]],
        n_fragments: int,
    ) -> None:
        detail = "; ".join(f"fragment {p}: {r}" for p, r in sorted(failures.items()))
        super().__init__(f"{len(failures)}/{n_fragments} fragments failed: {detail}", 0.0)
        self.failures, self.fetched = failures, fetched


# ── sync ─────────────────────────────────────────────────────────────────────────────────────
async def sync_fragments(
    transport: Transport,
    owner_of: Callable[[int], tuple[bytes, str] | None],
    n_fragments: int,
    shapes: Sequence[Sequence[tuple[int, ...]]],
    *,
    swarm: str,
    held_versions: Sequence[int],
    max_size: int,
    concurrency: int = 4,
    use_manifest: bool = True,
    chunk_timeout_s: float = 30.0,
    config: FetchConfig | None = None,
    stats: dict[int, FetchStats] | None = None,
) -> dict[int, tuple[int, torch.Tensor]]:
    """Fetch every fragment's latest version newer than ``held_versions[p]`` (-1: none held).

    Returns ``{p: (version, flat fp32)}`` for the fragments that had something newer; the rest
    are skipped. ``stats`` (if given) gets each fragment's ``FetchStats``. Raises SyncFailed
    (carrying what did sync) if any fragment failed, ValueError on mismatched arguments.
    """
    if len(held_versions) != n_fragments or len(shapes) != n_fragments or concurrency < 1:
        raise ValueError(
            f"{n_fragments} fragments need as many held versions and shape lists "
            f"(got {len(held_versions)}, {len(shapes)}) and concurrency >= 1"
        )
    gate = asyncio.Semaphore(concurrency)
    fetched: dict[int, tuple[int, torch.Tensor]] = {}
    failures: dict[int, str] = {}

    async def one(p: int) -> None:
        fs = FetchStats()
        if stats is not None:
            stats[p] = fs
        async with gate:
            try:
                got = await _sync_one(
                    transport,
                    p,
                    owner_of(p),
                    shapes[p],
                    swarm=swarm,
                    held=held_versions[p],
                    max_size=max_size,
                    use_manifest=use_manifest,
                    chunk_timeout_s=chunk_timeout_s,
                    config=config,
                    stats=fs,
                )
            except RemoteProtocolError as e:
                failures[p] = e.reason
                return
        if got is not None:
            fetched[p] = got

    async with asyncio.TaskGroup() as tg:
        for p in range(n_fragments):
            tg.create_task(one(p))
    if failures:
        raise SyncFailed(failures, dict(sorted(fetched.items())), n_fragments)
    return dict(sorted(fetched.items()))


async def _sync_one(
    transport: Transport,
    p: int,
    owner: tuple[bytes, str] | None,
    shapes: Sequence[tuple[int, ...]],
    *,
    swarm: str,
    held: int,
    max_size: int,
    use_manifest: bool,
    chunk_timeout_s: float,
    config: FetchConfig | None,
    stats: FetchStats,
) -> tuple[int, torch.Tensor] | None:
    if owner is None:
        raise RemoteProtocolError("no owner known", penalty=0.0)
    owner_id, base = owner
    url = f"{base}/v1/fragments/{p}/latest"
    try:
        result = await _fetch(
            transport,
            url,
            max_size=max_size,
            expected_signer=owner_id,
            resume=None,
            chunk_timeout_s=chunk_timeout_s,
            manifest_url=f"{url}/manifest" if use_manifest else None,
            newer_than=held,
            config=config,
            stats=stats,
        )
    except DownloadFailed as e:
        if e.partial is not None:
            transport.pool.give(e.partial.buffer)
        raise
    if result is None:
        return None
    opened, buf = result
    try:
        state = opened.message
        if not isinstance(state, FragmentState) or state.swarm != swarm or state.fragment != p:
            raise DecodeError(
                f"{url} sent {type(state).__name__} "
                f"{getattr(state, 'swarm', '?')}/{getattr(state, 'fragment', '?')}, "
                f"not FragmentState {swarm}/{p}"
            )
        if state.version <= held:
            stats.reasons.append(f"version {state.version} is not newer than the {held} held")
            log.info("fragment %d: %s", p, stats.reasons[-1])
            return None
        flat = await asyncio.to_thread(flat_from_tensors, state.tensors, shapes)
        return state.version, flat
    finally:
        transport.pool.give(buf)
