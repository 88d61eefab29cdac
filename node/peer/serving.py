"""Serving global versions over HTTP (``VersionServer``): an owner's ``latest``, ``next`` and
``final`` routes and their long-polls, with the spread-or-serve decision of
``protocol.diloco.spread`` for every version (``node.diloco.spread``), and the ``held`` route
any peer answers with the versions it fetched.

Long-polls are capped per signing key (two per fragment) and per anonymous address; outside a
certified swarm (where a key costs nothing) also per address whatever the key, an IPv6 sender at
its /64, /56 and /48 (``protocol.dht.netgroups.PrefixCounts``), so fresh keys do not buy more
(loopback excepted: a local swarm's peers all poll from 127.0.0.1).
The next one gets 429 at once, never a queue. A ``final`` long-poll waits on events, not a timer
(``node.peer.finals``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web

from node.config import RunConfig
from node.dht.swarm import SwarmCredentials
from node.diloco.owner import Declined, FragmentOwner
from node.diloco.spread import (
    DECLINED_STATUS,
    FINAL_HELD_STATUS,
    REPLICA_HELD_STATUS,
    VERSION_HEADER,
    Holdings,
    SpreadStats,
    answer,
    requester,
)
from node.peer.finals import FinalVersions
from node.state.serve import ManifestCache, serve_manifest, serve_sealed, state_etag
from node.wire.admission import ADMITTED
from node.wire.connections import address_key
from node.wire.transport import Busy, Transport
from protocol.dht.netgroups import PrefixCounts
from protocol.diloco.spread import Fanout, Serve, SpreadDecision
from protocol.errors import DecodeError
from protocol.ids import peer_id_from_public_key

__all__ = [
    "MAX_ANONYMOUS_POLLS_PER_IP",
    "MAX_POLLS_PER_ADDRESS",
    "MAX_WAIT_S",
    "REQUESTER_WAIT_S",
    "Askers",
    "Published",
    "ServingConfig",
    "VersionServer",
]

MAX_WAIT_S = 30.0  # the longest a long-poll (/v1/fragments/p/next, /final) is held
# how long a holder looks up a requester its view lacks before it decides (one DHT request by id)
REQUESTER_WAIT_S = 3.0
MAX_ANONYMOUS_POLLS_PER_IP = 64  # long-polls held at once for requests that name no key
# long-polls held at once per address, keys or not, outside certified swarms: under the 128
# connections an address may hold (a local swarm's peers all poll from 127.0.0.1)
MAX_POLLS_PER_ADDRESS = 96
_AFTER = re.compile(r"-1|[0-9]{1,19}")


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.partition("%")[0]).is_loopback
    except ValueError:
        return False


def _holds_same(request: web.Request, owner: FragmentOwner, version: int) -> bool:
    """Whether the ``digest`` a request names (hex) is ``owner``'s state of ``version``."""
    text = request.query.get("digest", "")
    try:
        digest = bytes.fromhex(text) if len(text) == 64 else None
    except ValueError:
        digest = None
    return digest is not None and digest in owner.digests.get(version, set())


def _signer_of(request: web.Request) -> bytes | None:
    """The peer id of the admitted member that signed ``request`` (None: unsigned)."""
    admitted = request.get(ADMITTED)
    if admitted is None or not admitted.public_key:
        return None
    return peer_id_from_public_key(admitted.public_key)


def _long_poll_query(request: web.Request) -> tuple[int, float]:
    """``after`` (-1 or a version) and ``wait`` (finite seconds >= 0, clamped to ``MAX_WAIT_S``)
    from a long-poll's query. Raises ``DecodeError`` with a reason for anything else."""
    after, wait = request.query.get("after", "-1"), request.query.get("wait", "0")
    if not _AFTER.fullmatch(after):
        raise DecodeError(f"after must be -1 or a version of at most 19 digits, not {after[:24]!r}")
    try:
        wait_s = float(wait) if len(wait) <= 24 else math.nan
    except ValueError:
        wait_s = math.nan
    if not (math.isfinite(wait_s) and wait_s >= 0):
        raise DecodeError(f"wait must be a finite number of seconds >= 0, not {wait[:24]!r}")
    return int(after), min(wait_s, MAX_WAIT_S)


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """The swarm's config, its plan's fragment count, and this peer's id (its own learner's
    fetches never leave the machine, nor count against a fanout)."""

    run: RunConfig
    n_fragments: int
    peer_id: bytes


@dataclass(frozen=True, slots=True)
class Published:
    """What this peer's owners publish: the ``owners`` (read only), the ``finals`` a ``final``
    long-poll waits on, and per fragment the version a replica took from us and which replica
    (``replica_took``: its learner needs no download)."""

    owners: Mapping[int, FragmentOwner]
    finals: FinalVersions
    replica_took: Mapping[int, tuple[int, bytes]]


@dataclass(frozen=True, slots=True)
class Askers:
    """How the server tells who asks: ``member_url`` is a member's address (a signer without one
    is no peer others can fetch from); ``credentials`` the swarm's admission (None in a
    development swarm, where a key costs nothing); ``members`` how many members there are,
    ourselves included, by a whole view (0: unknown), which decides whether an owner serves the
    swarm whole (``RunConfig.owner_serves_all``); ``find`` looks a signer the view lacks up
    before a holder decides on its request (``VersionServer._held_requester``)."""

    member_url: Callable[[bytes], str | None]
    credentials: SwarmCredentials | None
    members: Callable[[], int] = lambda: 0
    # look members up now, into the view ``member_url`` reads (``HolderLookup.find``; None: never)
    find: Callable[[Sequence[bytes]], Awaitable[None]] | None = None


class VersionServer:
    """The version routes of a peer: what its owners publish (``published``), what its learner
    holds (``holdings``), with the spread counters (``spread``) and who asks (``askers``)."""

    def __init__(
        self,
        config: ServingConfig,
        transport: Transport,
        published: Published,
        holdings: Holdings,
        spread: SpreadStats,
        askers: Askers,
    ) -> None:
        self.cfg, self.n_fragments, self.peer_id = config.run, config.n_fragments, config.peer_id
        self.transport, self.holdings, self.spread = transport, holdings, spread
        self.owners, self.finals, self.replica_took = (
            published.owners,
            published.finals,
            published.replica_took,
        )
        self._member_url, self.credentials = askers.member_url, askers.credentials
        self._members, self._find = askers.members, askers.find
        self.model_bytes_served: collections.Counter[str] = (
            collections.Counter()
        )  # key hex -> bytes
        self._long_polls: collections.Counter[str] = collections.Counter()  # poller -> polls held
        self._polls_by_address = PrefixCounts(MAX_POLLS_PER_ADDRESS)
        self._fanouts: dict[int, Fanout] = {}  # fragment -> this owner's serve-or-point decisions
        self._manifests = ManifestCache()

    @staticmethod
    def _fragment_index(request: web.Request) -> int:
        text = request.match_info["p"]
        if not (text.isascii() and text.isdigit() and len(text) <= 9):  # int() also reads "٣" as 3
            raise web.HTTPBadRequest(
                text="fragment index must be a non-negative integer in ASCII digits"
            )
        return int(text)

    def _fragment_owner(self, request: web.Request) -> FragmentOwner:
        p = self._fragment_index(request)
        owner = self.owners.get(p)
        if owner is None:
            raise web.HTTPNotFound(text=f"fragment {p} is not owned here")
        return owner

    async def on_fetch(self, request: web.Request) -> web.StreamResponse:
        kind = request.match_info["kind"]
        if kind == "held":  # any peer re-serves the versions it fetched (signed by their owners)
            return await self._on_held(request)
        owner = self._fragment_owner(request)
        if kind == "latest":
            self._count_served(request, owner.latest.size)
            return await serve_sealed(
                request, self.transport, owner.latest, etag=state_etag(owner.latest, owner.version)
            )
        after, wait_s = _long_poll_query(request)  # DecodeError: the transport answers 400
        if kind not in ("final", "next"):
            return web.json_response(
                {"error": "DecodeError", "reason": f"unknown kind {kind!r}"}, status=404
            )
        with self._long_poll(request):
            sealed = (
                await self.finals.wait(owner, wait_s)
                if kind == "final"
                else await owner.wait_after(after, wait_s, asker=_signer_of(request))
            )
        if isinstance(sealed, Declined):  # the asker's work is in no version: it goes on
            return web.Response(status=DECLINED_STATUS, headers={VERSION_HEADER: str(sealed.base)})
        if sealed is None:
            return web.Response(status=204)
        update_ok = request.query.get("update") == "1"
        if (
            kind == "final"
            and update_ok
            and owner.version == after
            and _holds_same(request, owner, after)
        ):
            return web.Response(
                status=FINAL_HELD_STATUS
            )  # the learner holds the final version already
        if update_ok:  # a learner holding version ``after`` may take the update over it
            sealed = owner.sealed_after(
                after, update_ok=True, full_every=0 if kind == "final" else self.cfg.full_every
            )
        p, asker = owner.fragment.index, requester(request, self._member_url)
        if (
            kind == "next"
            and asker is not None
            and self.replica_took.get(p) == (owner.version, asker)
            and owner.download_codec == "none"
            and request.query.get("fallback") != "1"
        ):
            # the replica that took this version holds what its learner would download
            self.spread.replica_held += 1
            return web.Response(
                status=REPLICA_HELD_STATUS, headers={VERSION_HEADER: str(owner.version)}
            )
        decision: SpreadDecision = Serve("our own learner")
        if asker != self.peer_id:  # our own learner's fetch never leaves the machine
            fanout = self._fanouts.get(p)
            if fanout is None:
                fanout = self._fanouts[p] = Fanout(
                    self.cfg.owner_fanout if self.cfg.spread_fanout else 0,
                    max_uploads=self.cfg.owner_max_uploads,
                    whole_swarm=self.cfg.owner_serves_all,
                )
            spent, owed = fanout.over_budget, owner.owes_resync(asker)
            decision = fanout.decide(
                owner.version,
                asker,
                fallback=request.query.get("fallback") == "1",
                size=sealed.size,
                unit=owner.latest.size,
                must=kind == "final",
                direct=owed,
                learners=max(self._members() - 1, 0),  # our own learner never asks
            )
            self.spread.over_budget += fanout.over_budget - spent
            if isinstance(decision, Serve):
                self.spread.owner_bytes += sealed.size
                self.spread.owned_version(p, owner.version, sealed.size)
        if isinstance(decision, Serve):
            self._count_served(request, sealed.size)
        return await answer(
            request,
            self.transport,
            decision,
            sealed.iter_chunks,
            sealed.size,
            self.spread,
            version=owner.version,
        )

    async def _on_held(self, request: web.Request) -> web.StreamResponse:
        p = self._fragment_index(request)
        after, wait_s = _long_poll_query(request)
        with self._long_poll(request):
            started = time.monotonic()
            who = await self._held_requester(request)
            return await self.holdings.serve(
                request,
                self.transport,
                p,
                after,
                max(0.0, wait_s - (time.monotonic() - started)),
                who,
                self.spread,
            )

    async def _held_requester(self, request: web.Request) -> bytes | None:
        """Who asks for a held version, as its ``Fanout`` counts it: a member we can point others
        at, or None. A signer our bounded view lacks (most learners pointed here) is looked up
        first, at most ``REQUESTER_WAIT_S``: as anonymous it would be served and never pointed at,
        and this holder's budget would go to dead ends instead of the tree. The lookup overlaps
        nothing the poll needs: a version already held is served after it, one that is not is
        waited for with what is left of the poll's wait."""
        who, signer = requester(request, self._member_url), _signer_of(request)
        if who is not None or signer is None or signer == self.peer_id or self._find is None:
            return who
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REQUESTER_WAIT_S):
                await self._find([signer])
        who = requester(request, self._member_url)
        self.spread.requesters_found += who is not None
        return who

    @contextlib.contextmanager
    def _long_poll(self, request: web.Request) -> Iterator[None]:
        """Count a held long-poll against its key (or address) and, outside certified swarms,
        its address whatever the key; ``Busy`` (429) past a cap."""
        who = self._poller(request)
        if self._long_polls[who] >= self._long_poll_cap(who):
            raise Busy(
                f"{self._long_polls[who]} long-polls from {who[:24]} are held already "
                f"(at most {self._long_poll_cap(who)}: two per fragment); retry later"
            )
        ip = (
            None
            if self.credentials is not None and self.credentials.certified
            else (request.remote or "unknown")
        )
        if ip is not None and _loopback(ip):  # a local swarm: every peer polls from 127.0.0.1
            ip = None
        full = self._polls_by_address.refusal(ip) if ip is not None else None
        if full is not None:  # a key costs nothing here: fresh keys must not buy more long-polls
            raise Busy(f"long-polls: {full}, whatever keys they name; retry later")
        self._long_polls[who] += 1
        if ip is not None:
            self._polls_by_address.add(ip)
        try:
            yield
        finally:
            self._long_polls[who] -= 1
            if self._long_polls[who] <= 0:
                del self._long_polls[who]
            if ip is not None:
                self._polls_by_address.remove(ip)

    @staticmethod
    def _poller(request: web.Request) -> str:
        """Who holds a long-poll: its signing key when it sent one, else its address."""
        admitted = request.get(ADMITTED)
        if admitted is not None and admitted.public_key:
            return "key:" + admitted.public_key.hex()
        return "ip:" + address_key(request.remote or "unknown")  # an IPv6 address by its /64

    def _long_poll_cap(self, who: str) -> int:
        # a learner polls each fragment once (and its final version once): a key gets two per
        # fragment; an address may stand for many anonymous learners of an open swarm
        per_key = 2 * self.n_fragments + 2
        return per_key if who.startswith("key:") else MAX_ANONYMOUS_POLLS_PER_IP

    def _count_served(self, request: web.Request, size: int) -> None:
        admitted = request.get(ADMITTED)
        key = (
            admitted.public_key.hex()
            if admitted is not None and admitted.public_key
            else "anonymous"
        )
        if key in self.model_bytes_served or len(self.model_bytes_served) < 4096:
            self.model_bytes_served[key] += size

    async def on_manifest(self, request: web.Request) -> web.Response:
        owner = self._fragment_owner(request)
        return await serve_manifest(
            request,
            owner.latest,
            etag=state_etag(owner.latest, owner.version),
            cache=self._manifests,
        )
