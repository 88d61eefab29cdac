"""Versions spread peer to peer: the I/O around ``protocol.diloco.spread``.

Holder side: ``Holdings`` keeps, per fragment, the newest sealed version this peer fetched, as
the very bytes the owner signed (the pooled receive buffer itself, not a copy), and serves it at
``GET /v1/fragments/{p}/held?after=A&wait=W`` (``serve_held``): it waits up to W for a version
above A, then asks its ``Fanout`` whether to upload it or to point the requester at the peers it
served. A buffer being streamed is given back to the pool only once its last reader is done.
A holder uploads one version at most ``holder_max_uploads(fanout)`` times (its fanout plus
``HOLDER_SPARE_UPLOADS`` for repeats, fallbacks and requesters it cannot point others at),
whoever asks: past that it points at the peers it served, or answers 429.

Owner side: ``answer`` turns a ``Fanout`` decision for a version the owner publishes into the
reply: the sealed bytes, a pointer (303, a msgpack list of at most ``MAX_POINTERS`` peer ids;
never addresses: the learner looks the ids up in its own view of the members, so a hostile
holder cannot aim learners at an arbitrary address), or 429.

Learner side: ``parse_pointer`` reads a pointer strictly; ``IslandNet.fetch`` tries the holders
in order, follows their pointers (bounded), checks that the owner signed what it got, and falls
back to the owner with ``fallback=1`` when none served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import msgpack
from aiohttp import web

from node.wire.admission import ADMITTED
from node.wire.transport import BufferPool, Transport
from protocol.diloco.spread import MAX_POINTERS, Fanout, PointTo, Refuse, SpreadDecision
from protocol.errors import DecodeError
from protocol.ids import ID_BYTES, peer_id_from_public_key
from protocol.wire.codec import chunk_views

__all__ = [
    "DECLINED_STATUS",
    "HOLDER_SPARE_UPLOADS",
    "FINAL_HELD_STATUS",
    "POINTER_STATUS",
    "REPLICA_HELD_STATUS",
    "UPDATE_NOT_HELD_STATUS",
    "VERSION_HEADER",
    "pointed_version",
    "Holdings",
    "SpreadStats",
    "Spreading",
    "answer",
    "encode_pointer",
    "holder_max_uploads",
    "parse_pointer",
    "requester",
]

log = logging.getLogger(__name__)

POINTER_STATUS = 303  # "See Other": fetch this version from the holders named in the body
FINAL_HELD_STATUS = (
    304  # "Not Modified": the final version is the one the learner named (after, digest)
)
UPDATE_NOT_HELD_STATUS = 409  # the holder holds the version as an update over another one only
REPLICA_HELD_STATUS = 208  # "Already Reported": the requester is the replica that took this version
# "Reset Content": validation declined the candidate holding the requester's work on the base in
# VERSION_HEADER; no version will hold it, go on from the version held (``FragmentOwner.wait_after``)
DECLINED_STATUS = 205
MAX_POINTER_BODY = 16 + MAX_POINTERS * (ID_BYTES + 4)
MAX_HELD_WAIT_S = 15.0
VERSION_HEADER = (
    "Atoll-Version"  # on a pointer: the version the holders were served; declined: the base
)
# A holder's uploads of one version beyond its fanout: a repeat of a broken download, a fallback,
# a requester it cannot point others at (anonymous, or a member its view could not find). Without
# a budget those were unbounded: every requester its bounded view lacked got a full upload.
HOLDER_SPARE_UPLOADS = 2


def holder_max_uploads(fanout: int) -> float:
    """A holder's upload budget per version, in multiples of its size (0: spreading off, where
    no learner is pointed at a holder)."""
    return float(fanout + HOLDER_SPARE_UPLOADS) if fanout else 0.0


def pointed_version(headers: Mapping[str, str]) -> int | None:
    """The version a pointer names (None when absent or not a small non-negative integer)."""
    text = headers.get(VERSION_HEADER, "")
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 15 else None


@dataclass
class SpreadStats:
    """What this peer uploaded of versions, and how it spread them."""

    owner_bytes: int = (
        0  # versions uploaded as their owner to other peers (next, final; not joins' latest)
    )
    held_bytes: int = 0  # versions re-served as a holder
    pointers: int = 0  # requests pointed at other holders (owner and holder side)
    refused: int = 0  # requests refused (their share of a version was spent)
    over_budget: int = (
        0  # owner side: requests past a version's upload budget (pointed elsewhere or refused)
    )
    fallbacks_asked: int = 0  # learner side: the holders failed, the owner was asked again
    refusals: int = (
        0  # learner side: a version refused for now (429; the owner's budget for it spent)
    )
    from_holders: int = 0  # learner side: versions fetched from a holder, not the owner
    bad_from_holders: int = 0  # learner side: a holder served bytes that failed the checks
    holders_unknown: int = 0  # learner side: a pointed holder skipped, not found in our view
    holders_found: int = 0  # learner side: a pointed holder our view lacked, found by a lookup
    holders_busy: int = 0  # learner side: a holder refused (429: its upload budget spent)
    holders_empty: int = 0  # learner side: a holder had no version for us within the wait (204)
    holders_failed: int = 0  # learner side: a holder unreachable, or its reply broke or was late
    holders_exhausted: int = 0  # learner side: HOLDERS_TRIED holders asked, more were named
    holders_ran_out: int = 0  # learner side: a fetch asked every holder named, none served
    holders_other_form: int = 0  # learner side: a holder held the version as an update over another
    held_versions_bytes: int = 0  # holder side: the size of each version re-served, once
    held_uploads_max: int = 0  # holder side: the most uploads of one version (not a sum)
    requesters_found: int = 0  # holder side: a signer our view lacked, found by a lookup
    replica_held: int = (
        0  # owner side: learners told they hold the version as its replica (nothing sent)
    )
    published_bytes: int = (
        0  # owner side: sealed size of every distinct version published or served as owner
    )
    _versions: set[tuple[int, int]] = field(default_factory=set, repr=False)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def owned_version(self, fragment: int, version: int, size: int) -> None:
        """Count a version this peer publishes or serves as its owner (once: a successor serves
        versions it took over, not only those it merged)."""
        if (fragment, version) not in self._versions:
            self._versions.add((fragment, version))
            self.published_bytes += size
            if len(self._versions) > 100_000:
                self._versions.clear()  # only lets a very old version count twice


def encode_pointer(holders: tuple[bytes, ...]) -> bytes:
    return msgpack.packb([bytes(h) for h in holders[:MAX_POINTERS]], use_bin_type=True)


def parse_pointer(body: memoryview | bytes) -> list[bytes]:
    """The peer ids a pointer names. Raises ``DecodeError`` for anything but a short list of ids."""
    if len(body) > MAX_POINTER_BODY:
        raise DecodeError(f"pointer of {len(body)} bytes (at most {MAX_POINTER_BODY})")
    try:
        ids = msgpack.unpackb(
            bytes(body),
            raw=False,
            strict_map_key=True,
            max_bin_len=ID_BYTES,
            max_array_len=MAX_POINTERS,
            max_str_len=0,
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise DecodeError(f"malformed pointer: {exc}") from None
    if not isinstance(ids, list) or not all(
        isinstance(i, bytes) and len(i) == ID_BYTES for i in ids
    ):
        raise DecodeError(f"a pointer is a list of at most {MAX_POINTERS} {ID_BYTES}-byte peer ids")
    return ids


def requester(request: web.Request, url_of: Callable[[bytes], str | None]) -> bytes | None:
    """The peer id of a request's signer when it is a member others can fetch from, else None."""
    admitted = request.get(ADMITTED)
    if admitted is None or not admitted.public_key:
        return None
    peer_id = peer_id_from_public_key(admitted.public_key)
    return peer_id if url_of(peer_id) else None


async def answer(
    request: web.Request,
    transport: Transport,
    decision: SpreadDecision,
    chunks: Callable[[], Iterator[memoryview]],
    size: int,
    stats: SpreadStats,
    *,
    version: int,
) -> web.StreamResponse:
    """The reply a ``Fanout`` decision calls for (``chunks`` streams ``version`` when served; a
    pointer names it in ``VERSION_HEADER``, so a learner asking for a final version knows which)."""
    if isinstance(decision, PointTo):
        stats.pointers += 1
        return web.Response(  # no Content-Type: a 303 from this route is a pointer (35 bytes)
            status=POINTER_STATUS,
            body=encode_pointer(decision.holders),
            headers={VERSION_HEADER: str(version)},
        )
    if isinstance(decision, Refuse):
        stats.refused += 1
        log.info("version refused to %s: %s", request.remote, decision.reason)
        return web.json_response({"error": "Busy", "reason": decision.reason}, status=429)
    return await transport.stream_reply(request, chunks(), size)


def _owner_query(request: web.Request) -> bytes | None:
    text = request.query.get("owner")
    if text is None:
        return None
    if len(text) != 2 * ID_BYTES or not all(c in "0123456789abcdef" for c in text):
        raise DecodeError(f"owner must be a {ID_BYTES}-byte peer id in lower-case hex")
    return bytes.fromhex(text)


@dataclass
class _Held:
    version: int
    buf: bytearray
    used: int
    signer: bytes  # the owner whose signature the bytes carry
    base: int | None = None  # an update over this version (None: the full version)
    readers: int = 0
    replaced: bool = False
    uploads: int = 0  # times served (200) as a holder


class Holdings:
    """The newest sealed version of each fragment this peer fetched, served to other learners."""

    def __init__(self, fragments: int, pool: BufferPool, *, fanout: int) -> None:
        self.pool = pool
        self._held: list[_Held | None] = [None] * fragments
        self.fanouts = [
            Fanout(fanout, max_uploads=holder_max_uploads(fanout)) for _ in range(fragments)
        ]
        self._changed = asyncio.Condition()
        self._closed = False
        self._fetching = True  # False once this peer fetches no more versions

    async def done_fetching(self) -> None:
        """This peer holds its final versions and fetches no more: a poll for a version it does
        not hold is answered (204) at once instead of waiting for one that will not come (at a
        swarm's end, a learner pointed here would wait ``HOLDER_WAIT_S`` before asking the owner
        again). What it holds is still served."""
        self._fetching = False
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        """This peer is stopping: every ``wait_after`` returns None (204) at once, and later ones
        do not wait."""
        self._closed = True
        async with self._changed:
            self._changed.notify_all()

    def version(self, p: int) -> int | None:
        held = self._held[p]
        return None if held is None else held.version

    async def put(
        self,
        p: int,
        version: int,
        buf: bytearray,
        used: int,
        signer: bytes,
        *,
        base: int | None = None,
    ) -> None:
        """Keep ``buf[:used]`` (verified, signed by the owner ``signer``) as fragment ``p``'s
        ``version``, an update over version ``base`` when given; this takes the buffer over (an
        older or equal version is given straight back to the pool)."""
        old = self._held[p]
        if old is not None and version <= old.version:
            self.pool.give(buf)
            return
        self._held[p] = _Held(version, buf, used, signer, base)
        if old is not None:
            old.replaced = True
            self._release(old)
        async with self._changed:
            self._changed.notify_all()

    def _release(self, held: _Held) -> None:
        if held.replaced and held.readers == 0:
            self.pool.give(held.buf)

    async def wait_after(
        self, p: int, after: int, wait_s: float, signer: bytes | None = None
    ) -> _Held | None:
        """The held version of ``p`` once it is above ``after`` (and signed by ``signer``, when
        given: the owner the asker sees; views of ownership differ while it moves)."""

        def held() -> _Held | None:
            h = self._held[p]
            ok = h is not None and h.version > after and (signer is None or h.signer == signer)
            return h if ok else None

        async with self._changed:
            try:
                async with asyncio.timeout(min(wait_s, MAX_HELD_WAIT_S)):
                    await self._changed.wait_for(
                        lambda: self._closed or not self._fetching or held() is not None
                    )
            except TimeoutError:
                return None
        return None if self._closed else held()

    async def serve(
        self,
        request: web.Request,
        transport: Transport,
        p: int,
        after: int,
        wait_s: float,
        who: bytes | None,
        stats: SpreadStats,
    ) -> web.StreamResponse:
        """Answer ``GET /v1/fragments/{p}/held?after=A&wait=W[&owner=HEX]``: 204 when nothing above
        ``after`` (signed by ``owner``) came in time. Raises ``DecodeError`` for a bad ``owner``."""
        if not 0 <= p < len(self._held):
            raise web.HTTPNotFound(text=f"no fragment {p}")
        held = await self.wait_after(p, after, wait_s, _owner_query(request))
        if held is None:
            return web.Response(status=204)
        if held.base is not None and (held.base != after or request.query.get("update") != "1"):
            return web.json_response(
                {
                    "error": "UpdateNotHeld",
                    "reason": f"version {held.version} of fragment {p} "
                    f"is held as an update over version {held.base} only; ask its owner",
                },
                status=UPDATE_NOT_HELD_STATUS,
            )
        decision = self.fanouts[p].decide(
            held.version,
            who,
            fallback=request.query.get("fallback") == "1",
            size=held.used,
            unit=held.used,
        )
        held.readers += 1
        try:
            resp = await answer(
                request,
                transport,
                decision,
                lambda: chunk_views([memoryview(held.buf)[: held.used]], 1 << 20),
                held.used,
                stats,
                version=held.version,
            )
        finally:
            held.readers -= 1
            self._release(held)
        if resp.status == 200:
            stats.held_bytes += held.used
            held.uploads += 1
            stats.held_versions_bytes += held.used if held.uploads == 1 else 0
            stats.held_uploads_max = max(stats.held_uploads_max, held.uploads)
        return resp


@dataclass(frozen=True, slots=True)
class Spreading:
    """A learner's part in spreading versions peer to peer: ``holdings`` keeps each version it
    fetches for other learners (None: kept for nobody); ``stats`` counts what its fetches from
    holders did (the peer's one ``SpreadStats``, which its serving side counts into too)."""

    holdings: Holdings | None = None
    stats: SpreadStats = field(default_factory=SpreadStats)
