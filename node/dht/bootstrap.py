"""``atoll bootstrap``: a DHT-only node, a stable entry point for a swarm.

It trains nothing and owns nothing: it answers the DHT (so joining peers find each other and
the member records), dials joining peers back (``/v1/dialback``) so they learn whether they can
be reached, and lists a swarm's members (``/v1/members?swarm=NAME``) for ``atoll join``.
Peers serve the same two routes with the same classes.

Both routes are cheap to refuse. ``DialBacks`` dials only the requester's own address (the
connection's peer address; the port from the query), so a node cannot be made to probe other
hosts; one dial-back runs at a time per address, and each address gets a burst then one a
second (429 beyond). ``MemberListings`` answers from a cache refreshed at most every
``MEMBERS_TTL_S`` per swarm, for a bounded number of swarms: a peer lists only its own swarm,
and a bootstrap node looks up swarms it has not cached at a bounded rate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.membership import MemberRecord, members_key, roster_key
from node.dht.route import DHTRouter
from node.dht.swarm import SwarmCredentials
from node.wire.connections import address_key
from node.wire.tls import server_context
from node.wire.transport import Busy, Transport
from protocol.dht.ratelimit import RateLimiter, TokenBucket
from protocol.errors import DecodeError, NotAuthorized, RemoteProtocolError
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer

__all__ = [
    "BootstrapNode",
    "DialBacks",
    "MemberListings",
    "UnknownSwarm",
    "member_list",
    "run_bootstrap",
]

# Dial-backs: a burst per address, then one a second (a local swarm's peers all join through
# peer 0 from 127.0.0.1 at once); one at a time per address, the others wait their turn up to
# DIALBACK_WAIT_S; at most MAX_DIALBACKS in flight in all; a host name in ``url=`` is resolved
# for at most RESOLVE_S.
DIALBACK_PER_S = 1.0
DIALBACK_BURST = 16
DIALBACK_WAIT_S = 15.0
MAX_DIALBACKS = 32
RESOLVE_S = 2.0
ADDRESSES_KEPT = 4096
# Member listings: cached this long per swarm, for at most this many swarms; a bootstrap node
# looks up swarms it has not cached at most NEW_SWARMS_PER_S a second after a burst.
MEMBERS_TTL_S = 2.0
MAX_SWARMS_CACHED = 64
NEW_SWARMS_PER_S = 1.0
NEW_SWARMS_BURST = 8
MAX_SWARM_NAME = 128


class UnknownSwarm(RemoteProtocolError):
    """A member listing asked of a node that does not list that swarm."""

    status = 404


async def member_list(dht: DHTNode, swarm: str) -> list[dict[str, Any]]:
    """The live member records of ``swarm`` as JSON-ready dicts (records that fail to decode are skipped)."""
    out = []
    records = [*await dht.get(roster_key(swarm)), *await dht.get(members_key(swarm))]
    for rec in records:
        with contextlib.suppress(DecodeError):
            m = MemberRecord.decode(rec.value)
            out.append(
                {
                    "peer_id": rec.subkey.hex(),
                    "url": m.url,
                    "roles": list(m.roles),
                    "reachable": m.reachable,
                    "learning": m.learning,
                    "step": m.step,
                    "manifest": m.manifest,
                    "expires_at": rec.expires_at,
                }
            )
    return out


class _Turns:
    """One ``asyncio.Lock`` per key, forgotten once nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: collections.Counter[str] = collections.Counter()

    @contextlib.asynccontextmanager
    async def turn(self, key: str, wait_s: float | None = None) -> AsyncIterator[None]:
        """Hold ``key``'s lock for the block; raises ``TimeoutError`` after ``wait_s`` waiting."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._users[key] += 1
        try:
            async with asyncio.timeout(wait_s):
                await lock.acquire()
            try:
                yield
            finally:
                lock.release()
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._locks[key]


def _requester(request: web.Request) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        ip = ipaddress.ip_address(request.remote or "")
    except ValueError:
        raise DecodeError(f"cannot dial back {request.remote!r}: not an IP address") from None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


class DialBacks:
    """``GET /v1/dialback?port=P`` (or ``?url=http://MY-HOST:P``): ping the requester's DHT node
    at its own address and answer whether it replied, and as whom (see the module docstring)."""

    def __init__(
        self,
        *,
        rate: float = DIALBACK_PER_S,
        burst: float = DIALBACK_BURST,
        wait_s: float = DIALBACK_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limiter = RateLimiter(rate, burst, max_peers=ADDRESSES_KEPT)
        self._turns = _Turns()
        self.wait_s, self.clock = wait_s, clock
        self.in_flight = 0
        self.dialled = 0

    async def answer(self, request: web.Request, dht: DHTNode) -> web.Response:
        """Raises ``DecodeError`` (bad query), ``NotAuthorized`` (``url=`` names another host)
        or ``Busy`` (rate, turn or overall cap): the transport answers them 4xx with the reason."""
        ip = _requester(request)
        scheme, host, port = _target(request.query)
        if not self._limiter.allow(
            address_key(str(ip)), self.clock()
        ):  # an IPv6 address by its /64
            raise Busy(
                f"dial-backs to {ip} are limited to {self._limiter.rate:g} a second "
                f"after a burst of {self._limiter.burst:g}; retry later"
            )
        if host is not None and not await _is_address_of(host, ip):
            raise NotAuthorized(
                f"url names host {host[:64]!r}, not this request's address {ip}: "
                "a node dials back only the address a request came from"
            )
        if self.in_flight >= MAX_DIALBACKS:
            raise Busy(f"{self.in_flight} dial-backs in flight already; retry later")
        try:
            async with self._turns.turn(str(ip), self.wait_s):
                self.in_flight += 1
                try:
                    self.dialled += 1
                    address = f"{scheme}://{_url_host(ip)}:{port}"
                    contact = await dht.ping(address + "/v1/dht")
                finally:
                    self.in_flight -= 1
        except TimeoutError:
            raise Busy(f"another dial-back to {ip} is still running; retry later") from None
        return web.json_response(
            {
                "reachable": contact is not None,
                "address": address,
                "peer_id": contact.peer_id.hex() if contact else None,
            }
        )


def _target(query: Any) -> tuple[str, str | None, int]:
    """(scheme, host named in ``url=`` or None, port) from a dial-back query; raises DecodeError."""
    raw_port, url = query.get("port"), query.get("url")
    if raw_port is not None:
        scheme, host, port_text = "http", None, raw_port
    elif url is not None:
        try:
            parts = urlsplit(url[:512])  # raises ValueError on a bad [IPv6] host
        except ValueError:
            raise DecodeError("url has an invalid host") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DecodeError(
                "url must be http(s)://HOST:PORT with HOST the requester's own address"
            )
        try:
            port_text = str(parts.port or (443 if parts.scheme == "https" else 80))
        except ValueError:
            raise DecodeError("url has an invalid port") from None
        scheme, host = parts.scheme, parts.hostname
    else:
        raise DecodeError("say which port to dial back: ?port=P (or ?url=http://YOUR-ADDRESS:P)")
    if not (
        port_text.isascii()
        and port_text.isdigit()
        and len(port_text) <= 5
        and 0 < int(port_text) < 65536
    ):
        raise DecodeError(f"port must be 1..65535, not {port_text[:16]!r}")
    return scheme, host, int(port_text)


async def _is_address_of(host: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``host`` (an IP literal, or a name resolved for at most RESOLVE_S) is ``ip``."""
    with contextlib.suppress(ValueError):
        named = ipaddress.ip_address(host)
        return (getattr(named, "ipv4_mapped", None) or named) == ip
    try:
        async with asyncio.timeout(RESOLVE_S):
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, None, type=socket.SOCK_STREAM
            )
    except (OSError, TimeoutError, UnicodeError):
        return False
    return any(str(info[4][0]) == str(ip) for info in infos)


def _url_host(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    return f"[{ip}]" if ip.version == 6 else str(ip)


class MemberListings:
    """``GET /v1/members?swarm=NAME``: a swarm's live member records from a short cache (see the
    module docstring). ``only``: the one swarm listed here (a peer's own); None lists any."""

    def __init__(
        self,
        *,
        only: str | None = None,
        default: str = "atoll-local",
        ttl_s: float = MEMBERS_TTL_S,
        max_swarms: int = MAX_SWARMS_CACHED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.only, self.default = only, only or default
        self.ttl_s, self.max_swarms, self.clock = ttl_s, max_swarms, clock
        self._cache: collections.OrderedDict[str, tuple[float, list[dict[str, Any]]]] = (
            collections.OrderedDict()
        )
        self._turns = _Turns()
        self._new_swarms = TokenBucket(NEW_SWARMS_PER_S, NEW_SWARMS_BURST)
        self.lookups = 0

    async def answer(self, request: web.Request, dht: DHTNode) -> web.Response:
        """Raises ``DecodeError`` (bad name), ``UnknownSwarm`` or ``Busy``: answered 4xx."""
        swarm = request.query.get("swarm", self.default)
        if not (0 < len(swarm) <= MAX_SWARM_NAME and swarm.isprintable()):
            raise DecodeError(f"swarm must be a printable name of 1..{MAX_SWARM_NAME} characters")
        if self.only is not None and swarm != self.only:
            raise UnknownSwarm(
                f"this node lists only swarm {self.only!r}'s members, not {swarm[:64]!r}'s"
            )
        return web.json_response({"swarm": swarm, "members": await self.listing(swarm, dht)})

    async def listing(self, swarm: str, dht: DHTNode) -> list[dict[str, Any]]:
        """The cached listing of ``swarm``, looked up (once for all concurrent askers) when stale."""
        if (fresh := self._fresh(swarm)) is not None:
            return fresh
        if (
            self.only is None
            and swarm not in self._cache
            and not self._new_swarms.allow(self.clock())
        ):
            raise Busy(
                f"too many member listings of new swarms asked for; {swarm[:64]!r} is not cached, retry later"
            )
        async with self._turns.turn(swarm):
            if (fresh := self._fresh(swarm)) is not None:
                return fresh
            self.lookups += 1
            members = await member_list(dht, swarm)
            self._cache[swarm] = (self.clock(), members)
            self._cache.move_to_end(swarm)
            while len(self._cache) > self.max_swarms:
                self._cache.popitem(last=False)
            return members

    def _fresh(self, swarm: str) -> list[dict[str, Any]] | None:
        hit = self._cache.get(swarm)
        if hit is None or self.clock() - hit[0] >= self.ttl_s:
            return None
        self._cache.move_to_end(swarm)
        return hit[1]


class BootstrapNode:
    """With ``credentials`` it serves one certified swarm: HTTPS when the swarm is certified, and
    every request checked against the manifest like a peer's."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        public_address: str | None = None,
        *,
        signer: Signer | None = None,
        credentials: SwarmCredentials | None = None,
        routes: Callable[[Transport], None] | None = None,
    ) -> None:
        self.signer = signer or Signer.from_seed(os.urandom(32))
        certified = credentials is not None and credentials.certified
        self.transport = Transport(
            host, port, tls=server_context(self.signer) if certified else None
        )
        if credentials is not None:
            credentials.install(self.transport)
        self.credentials = credentials
        self.router = DHTRouter(self.transport)
        self.public_address = public_address
        self.dht: DHTNode | None = None
        self.dialbacks = DialBacks()
        self.listings = MemberListings(
            only=credentials.swarm_id if credentials is not None else None
        )
        app = self.transport.app
        app.router.add_get("/v1/members", self._members)
        app.router.add_get("/v1/dialback", self._dialback)
        app.router.add_get("/v1/status", self._status)
        if routes is not None:  # more routes (a founder's: the recipe's artifacts)
            routes(self.transport)

    @property
    def url(self) -> str:
        return self.public_address or self.transport.url

    async def start(self, initial_peers: list[str]) -> str:
        await self.transport.start()
        self.dht = DHTNode(
            self.signer, self.transport, self.url + "/v1/dht", DHTConfig(maintenance_period_s=30.0)
        )
        self.router.mount(self.dht)
        await self.dht.start()
        if initial_peers:
            await self.dht.bootstrap([u.rstrip("/") + "/v1/dht" for u in initial_peers])
        return self.url

    async def close(self) -> None:
        if self.dht is not None:
            await self.dht.close()
        await self.transport.close()

    async def _members(self, request: web.Request) -> web.Response:
        assert self.dht is not None
        return await self.listings.answer(request, self.dht)

    async def _dialback(self, request: web.Request) -> web.Response:
        assert self.dht is not None
        return await self.dialbacks.answer(request, self.dht)

    async def _status(self, _request: web.Request) -> web.Response:
        assert self.dht is not None
        return web.json_response(
            {
                "role": "bootstrap",
                "peer_id": self.signer.peer_id.hex(),
                "url": self.url,
                "dht_contacts": len(self.dht.routing),
                "dht_keys": len(self.dht.records),
                "admission": self.credentials.status() if self.credentials else None,
            }
        )


def join_hint(url: str, manifest: SwarmManifest | None) -> str:
    """How to join through this node, as ``atoll bootstrap`` prints it: an ``atoll join`` that runs
    as printed once the joiner has made its key and got what the swarm asks for, and how to."""
    if manifest is None:  # a node of no one swarm: the joiner names its swarm by its manifest
        return (
            f"join with: atoll join --initial-peers {url} --manifest swarm.toml --key peer.key\n"
            "  (swarm.toml: your swarm's manifest, from its founder; "
            "peer.key: atoll keygen --out peer.key)"
        )
    command = f"atoll join --initial-peers {url} --swarm {manifest.swarm_id} --key peer.key"
    if manifest.admission == "certified":
        return (
            f"join with: {command} --cert peer.cert\n  (peer.key: atoll keygen --out peer.key; "
            "peer.cert: your certificate, from your lab's authority)"
        )
    return (
        f"join with: {command}\n  (peer.key: atoll keygen --out peer.key; to own fragments too, "
        "add --cert peer.cert, a certificate from your lab's authority)"
    )


async def run_bootstrap(
    host: str,
    port: int,
    public_address: str | None,
    initial_peers: list[str],
    *,
    signer: Signer | None = None,
    credentials: SwarmCredentials | None = None,
    routes: Callable[[Transport], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; ``routes`` adds routes to the node's server."""
    node = BootstrapNode(
        host, port, public_address, signer=signer, credentials=credentials, routes=routes
    )
    url = await node.start(initial_peers)
    print(f"atoll bootstrap node listening at {url}", flush=True)
    print(join_hint(url, credentials.manifest if credentials else None), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await node.close()
