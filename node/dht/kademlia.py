"""The DHT node: drives ``protocol.dht`` (routing, lookup, records) over the shared transport.

Theory of operation (Maymounkov & Mazières, "Kademlia", IPTPS 2002, sections 2.3-2.5). ``DHTNode``
is the serving side, routing upkeep, maintenance and lifecycle; it holds the client side, a
``Caller`` (one outbound call) and a ``DHTClient`` (lookups, store, get; ``node.dht.lookups``),
and offers the client's API as its own.

Serving. ``DHTRouter`` (``node.dht.route``) mounts nodes on one POST route of
a ``Transport`` and verifies each request over its exact bytes with the addressed node's replay
window. ``DHTNode.handle`` then checks that the message's ``sender`` is the envelope's signer
(``check_sender``), meters Store per requester IP (records) and per signing key (requests)
(``StoreLimits``) and the records FindValue answers carry per requester IP (``ReadLimits``; both
``RateLimited``, 429), passes the sender to routing (below), and answers from
the explicit handler table; records are stored charged to the requester's IP (``RecordStore``'s
byte cap and fair-share eviction). The reply is sealed with the node's own key. A peer's
misbehaviour is a ``RemoteProtocolError``: 4xx, counted in ``metrics.refusals``. A named path
with no node mounted (never mounted, or killed) answers 404, the default path while its node is
down 503 (``node.dht.route``).

Routing. A verified reply to one of our calls proves its signer at the address we dialled: it
is ``RoutingTable.on_seen`` at once. A request's ``sender`` only *claims* an address: unless the
table already holds that very contact, the claim goes to a ``ClaimQueue`` and the ``_verifier``
task pings the address (paced, bounded, one per peer and per address); the sender enters the
table only when the reply comes back signed by its key (``metrics.claims`` counts the outcomes;
a node not started yet only queues claims). A flood of claims costs at most ``claim_rate`` pings a
second, one per address per ``claim_retry_s`` when it does not answer, and fills at most its
IP's fair share of the ``max_claims`` queue; honest peers also enter by answering our lookups.
A claim that answered our ping stays proven for ``claim_retry_s`` (at most ``PROVEN_KEPT``): its
requests count as seen without another ping, though its bucket had no room for it.
When a full bucket asks for a ``PingCandidate`` the node pings the bucket's oldest contact in its
own ``TaskGroup`` and reports ``on_ping_result``, unless it heard from that contact within
``ping_fresh_s`` (the lazy probing of section 4.1: it is alive, no ping needed). With no task
group running (not started, or too many pings in flight) it keeps the old contact, as the paper
prefers. Transport failures (timeout, refused connection, 5xx, a 404 for an address with no
node, a bad reply) are ``on_failed``; another 4xx refusal proves the peer alive and is only
counted. A node without an address (behind NAT) never reaches anyone's routing table:
``on_seen`` skips it, and it is never mounted.

Maintenance. ``maintain`` (looped by ``run``) refreshes buckets idle for ``refresh_interval_s``
(a fresh node's first pass is the paper's join refresh), re-signs and republishes our own records
before they expire, and prunes the store.

Time. ``clock`` (wall time, default ``time.time``) drives records, routing and rate limits;
tests pass a fake one. Envelopes always carry real wall time, since peers check it for skew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from node.dht.dht_config import DHTConfig, DHTMetrics
from node.dht.lookups import REFUSED, Caller, DHTClient, DHTRequest, Failure
from node.wire.transport import Transport
from protocol.dht.lookup import LookupResult
from protocol.dht.messages import (
    MAX_REPLY_PEERS,
    MAX_REPLY_RECORDS,
    FindNode,
    FindValue,
    NodesReply,
    Ping,
    Pong,
    Refresh,
    Store,
    StoreReply,
    ValueReply,
    check_sender,
)
from protocol.dht.records import (
    PutResult,
    RateLimited,
    ReadLimits,
    RecordStore,
    SignedRecord,
    StoreLimits,
    answer,
    only_subkeys,
)
from protocol.dht.routing import ClaimQueue, PingCandidate, RoutingTable
from protocol.errors import LocalProtocolError, NotAuthorized, RemoteProtocolError
from protocol.wire.messages import Message, PeerInfo
from protocol.wire.signing import Opened, ReplayWindow, Signer
from protocol.wire.verified import VerifiedSignatures

T = TypeVar("T")

__all__ = ["DHTConfig", "DHTMetrics", "DHTNode", "Maintenance", "RateLimited"]

log = logging.getLogger(__name__)

PROVEN_KEPT = 4096  # claims remembered as proven (bounded: one entry per peer id)


@dataclass(frozen=True, slots=True)
class Maintenance:
    """What one ``maintain`` pass did."""

    refreshed: int
    republished: int
    pruned: int


# ── the node ────────────────────────────────────────────────────────────────────────────────


class DHTNode:
    """One Kademlia node with key ``signer``, dialled at ``address`` ("" when not dialable).

    Serves requests (``handle``), keeps its routing table, and runs lookups through its
    ``client`` (whose API it offers: ``ping``, ``bootstrap``, ``find_node``, ``find_value``,
    ``store``, ``get``, ``held_near``, ``forget``)."""

    def __init__(
        self,
        signer: Signer,
        transport: Transport,
        address: str,
        config: DHTConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.signer, self.transport, self.clock = signer, transport, clock
        self.config = cfg = config or DHTConfig()
        self.peer_id = signer.peer_id
        self.me = PeerInfo(peer_id=self.peer_id, address=address)
        self.routing = RoutingTable(
            self.peer_id,
            k=cfg.k,
            replacement_cache=cfg.replacement_cache,
            max_failures=cfg.max_failures,
        )
        self.records = RecordStore(
            max_bytes=cfg.max_store_bytes,
            max_subkeys_per_key=cfg.max_subkeys_per_key,
            max_value_bytes=cfg.max_value_bytes,
            max_ttl_s=cfg.record_ttl_cap_s,
            verified=VerifiedSignatures(),  # the node's own: a record seen again is not re-verified
        )
        self.limits = StoreLimits(
            source_rate=cfg.store_ip_rate,
            source_burst=cfg.store_ip_burst,
            key_rate=cfg.store_rate,
            key_burst=cfg.store_burst,
        )
        self.read_limits = ReadLimits(source_rate=cfg.read_ip_rate, source_burst=cfg.read_ip_burst)
        self.claims = ClaimQueue(
            max_pending=cfg.max_claims,
            rate=cfg.claim_rate,
            burst=cfg.claim_burst,
            max_in_flight=cfg.max_claim_pings,
            retry_after_s=cfg.claim_retry_s,
        )
        self._claimed = asyncio.Event()  # the claim queue changed: the verifier looks again
        self.replay = ReplayWindow(salt=os.urandom(16))  # requests' nonces
        self.metrics = DHTMetrics()
        self.rng = random.Random(int.from_bytes(self.peer_id[:8], "big"))
        self.caller = Caller(
            signer,
            transport,
            cfg,
            metrics=self.metrics,
            routing=self.routing,
            seen=self._seen,
            clock=clock,
        )
        self.client = DHTClient(
            self.caller,
            self.me,
            cfg,
            routing=self.routing,
            records=self.records,
            metrics=self.metrics,
            clock=clock,
        )
        self._handlers: dict[type[Message], Callable[[Any, str], Message]] = {
            Ping: self._on_ping,
            FindNode: self._on_find_node,
            FindValue: self._on_find_value,
            Store: self._on_store,
            Refresh: self._on_refresh,
        }
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pings = 0
        self._heard: dict[bytes, float] = {}  # contacts in the table: when last heard from
        # claims that answered our ping: peer id -> (address, when); in a swarm larger than the
        # table holds, those that did not fit would otherwise be pinged at every request
        self._proven: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    # ── lifecycle ───────────────────────────────────────────────────────────────────────────

    async def start(self) -> None:
        """Open the node's task group; spawn ``run`` unless ``maintenance_period_s`` is 0.

        The calling task is the group's parent: call ``close`` from it. Background tasks catch
        every failure they expect, so one that raises is a bug and cancels the parent.
        """
        if self._tg is not None:
            raise LocalProtocolError("DHT node already started")
        tg = asyncio.TaskGroup()
        await tg.__aenter__()
        self._tg = tg
        self._spawn(self._verifier())
        if self.config.maintenance_period_s > 0:
            self._spawn(self.run())

    async def close(self) -> None:
        """Cancel every background task and wait for all of them. Idempotent."""
        tg, self._tg = self._tg, None
        if tg is None:
            return
        for task in list(self._tasks):
            task.cancel()
        await tg.__aexit__(None, None, None)

    async def __aenter__(self) -> DHTNode:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> bool:
        if self._tg is None:
            coro.close()
            return False
        task = self._tg.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    # ── serving ─────────────────────────────────────────────────────────────────────────────

    def seal(self, msg: Message, recipient: bytes = b"") -> bytes:
        """``msg`` sealed by this node's key for the peer id ``recipient`` (``Caller.seal``)."""
        return self.caller.seal(msg, recipient)

    def handle(self, opened: Opened, source: str = "") -> Message:
        """Answer one verified request that came from the IP address ``source``.

        Raises ``NotAuthorized`` (not a DHT request, or sender is not the signer) and
        ``RateLimited`` (Store over the requester IP's or the signing key's budget).
        """
        msg = opened.message
        if not isinstance(msg, DHTRequest):
            raise NotAuthorized(f"no DHT handler for {type(msg).__name__}")
        check_sender(msg.sender, opened.public_key)
        if isinstance(msg, Store | Refresh):
            n = len(msg.records) if isinstance(msg, Store) else len(msg.refreshes)
            self.limits.admit(source=source, signer=opened.peer_id, records=n, now=self.clock())
        self.metrics.rpcs_in[type(msg).__name__] += 1
        self._claim(msg.sender, source)
        return self._handlers[type(msg)](msg, source)

    def _on_ping(self, msg: Ping, source: str) -> Pong:
        return Pong(sender=self.me)

    def _on_find_node(self, msg: FindNode, source: str) -> NodesReply:
        return NodesReply(peers=tuple(self._nearest(msg.target)))

    def _on_find_value(self, msg: FindValue, source: str) -> ValueReply:
        self.read_limits.admit(source=source, now=self.clock())  # before anything is built
        held = only_subkeys(self.records.get(msg.key, self.clock()), msg.only)
        got = answer(held, known=msg.known, same=msg.same, renew=msg.renew)
        # A holder answers a delta read (one that names records: the asker has read the key
        # before) or a lookup by subkey with the value instead of contacts, as Kademlia's
        # FIND_VALUE does; a first read still gets contacts, so a reader that knows few nodes
        # finds enough holders.
        named = msg.known or msg.same or msg.renew or msg.only
        holder = named and (got.records or got.refreshes or got.omitted)
        refreshes = tuple(got.refreshes[:MAX_REPLY_RECORDS])
        records = tuple(got.records[: MAX_REPLY_RECORDS - len(refreshes)])
        self.read_limits.charge(
            source=source, records=len(records) + len(refreshes), now=self.clock()
        )
        return ValueReply(
            records=records,
            peers=() if holder else tuple(self._nearest(msg.key)),
            omitted=got.omitted,
            refreshes=refreshes,
        )

    def _on_store(self, msg: Store, source: str) -> StoreReply:
        return self._put_each(
            msg.records, "record", lambda rec, now: self.records.put(rec, now, source)
        )

    def _on_refresh(self, msg: Refresh, source: str) -> StoreReply:
        return self._put_each(
            msg.refreshes,
            "refresh",
            lambda ref, now: self.records.refresh(msg.key, ref, now, source),
        )

    def _put_each(
        self, items: Sequence[T], what: str, put: Callable[[T, float], PutResult]
    ) -> StoreReply:
        """Store (or renew) each of ``items``; what was refused and why goes into the reply."""
        now, accepted, reasons = self.clock(), 0, []
        for item in items:
            try:
                done = put(item, now)
            except RemoteProtocolError as exc:
                self.metrics.refusals[f"{what} {type(exc).__name__}"] += 1
                reasons.append(f"{REFUSED}{type(exc).__name__}: {exc.reason}")
                continue
            accepted += done.stored
            if not done.stored:
                reasons.append(done.reason)
        return StoreReply(accepted=accepted, reasons=tuple(reasons))

    def _nearest(self, target: bytes) -> list[PeerInfo]:
        return self.routing.closest(target, min(self.config.k, MAX_REPLY_PEERS))

    # ── routing table upkeep ────────────────────────────────────────────────────────────────

    def _claim(self, sender: PeerInfo, source: str) -> None:
        """A request's sender: seen if the table holds it at that address, else a claim to ping."""
        if not sender.address:
            return
        if self.routing.holds(sender) or self._proven_lately(sender):
            self._seen(sender)
            return
        outcome = self.claims.offer(sender, source, self.clock())
        self.metrics.claims[outcome.kind] += 1
        if outcome.queued:
            self._claimed.set()

    async def _verifier(self) -> None:
        """Ping claimed addresses as the claim queue allows, until cancelled (``close``)."""
        while True:
            self._claimed.clear()
            while (contact := self.claims.next(self.clock())) is not None:
                if not self._spawn(self._verify(contact)):
                    self.claims.done(contact, False, self.clock())
            wait = self.claims.wait_s(self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(60.0 if wait is None else min(max(wait, 0.01), 60.0)):
                    await self._claimed.wait()

    async def _verify(self, contact: PeerInfo) -> None:
        """Ping ``contact.address``: a reply signed by ``contact``'s key puts it in the table."""
        reply = await self.caller.call(
            contact.address, Ping(sender=self.me), contact.peer_id, charge=False
        )
        answered = not isinstance(reply, Failure)  # the caller saw it: it is in the table now
        self.claims.done(contact, answered, self.clock())
        if answered:
            self._proven[contact.peer_id] = (contact.address, self.clock())
            self._proven.move_to_end(contact.peer_id)
            while len(self._proven) > PROVEN_KEPT:
                self._proven.popitem(last=False)
        self.metrics.claims["answered" if answered else "unanswered"] += 1
        self._claimed.set()

    def _proven_lately(self, sender: PeerInfo) -> bool:
        """Whether ``sender`` answered our ping at this address within ``claim_retry_s``."""
        proven = self._proven.get(sender.peer_id)
        return (
            proven is not None
            and proven[0] == sender.address
            and self.clock() - proven[1] < self.config.claim_retry_s
        )

    def _seen(self, contact: PeerInfo) -> None:
        now = self.clock()
        candidate = self.routing.on_seen(contact, now)
        if contact.peer_id in self.routing:
            self._heard[contact.peer_id] = now
        if candidate is not None:
            self._ping_oldest(candidate, now)

    def _ping_oldest(self, cand: PingCandidate, now: float) -> None:
        """Probe the oldest contact of a full bucket, lazily (paper section 4.1)."""
        if self._heard.get(cand.oldest.peer_id, -float("inf")) >= now - self.config.ping_fresh_s:
            self.routing.on_ping_result(cand.oldest.peer_id, True, now)
            return
        if self._pings < self.config.max_background_pings and self._spawn(self._probe(cand.oldest)):
            self._pings += 1
            return
        self.metrics.failures["ping skipped, kept oldest"] += 1
        self.routing.on_ping_result(cand.oldest.peer_id, True, now)

    async def _probe(self, oldest: PeerInfo) -> None:
        try:
            reply = await self.caller.call(oldest.address, Ping(sender=self.me), oldest.peer_id)
        finally:
            self._pings -= 1
        alive = not isinstance(reply, Failure)
        self.routing.on_ping_result(oldest.peer_id, alive, self.clock())

    # ── maintenance ─────────────────────────────────────────────────────────────────────────

    async def run(self) -> None:
        """``maintain`` every ``maintenance_period_s`` until cancelled."""
        period = self.config.maintenance_period_s or self.config.refresh_interval_s
        while True:
            await self.maintain()
            await asyncio.sleep(period)

    async def maintain(self) -> Maintenance:
        """One pass: refresh idle buckets, republish our records that are due, prune the store."""
        now = self.clock()
        targets = self.routing.stale_buckets(now, self.config.refresh_interval_s, self.rng)
        for target in targets:
            await self.client.find_node(target)
        republished = await self.client.republish_due(now)
        self._heard = {p: t for p, t in self._heard.items() if p in self.routing}
        return Maintenance(
            refreshed=len(targets), republished=republished, pruned=self.records.prune(self.clock())
        )

    # ── the client's API ────────────────────────────────────────────────────────────────────

    @property
    def dialable(self) -> bool:
        return self.client.dialable

    async def ping(self, address: str) -> PeerInfo | None:
        """``DHTClient.ping``."""
        return await self.client.ping(address)

    async def bootstrap(self, addresses: Sequence[str]) -> int:
        """``DHTClient.bootstrap``: how many of ``addresses`` answered (0: the join failed)."""
        return await self.client.bootstrap(addresses)

    async def find_node(self, target: bytes) -> LookupResult:
        """``DHTClient.find_node``."""
        return await self.client.find_node(target)

    async def find_value(
        self, key: bytes, *, quorum: int = 1, known: tuple[bytes, ...] = ()
    ) -> LookupResult:
        """``DHTClient.find_value``."""
        return await self.client.find_value(key, quorum=quorum, known=known)

    async def store(
        self,
        key: bytes,
        value: bytes,
        ttl_s: float,
        *,
        replicas: int | None = None,
        on_held: Callable[[], None] | None = None,
    ) -> int:
        """``DHTClient.store``: how many nodes hold the record (``on_held``: called as each
        takes it)."""
        return await self.client.store(key, value, ttl_s, replicas=replicas, on_held=on_held)

    async def get(
        self,
        key: bytes,
        *,
        quorum: int = 1,
        known: tuple[bytes, ...] = (),
        only: tuple[bytes, ...] = (),
        held: Sequence[SignedRecord] = (),
        renew_before: float = 0.0,
    ) -> list[SignedRecord]:
        """``DHTClient.get``."""
        return await self.client.get(
            key, quorum=quorum, known=known, only=only, held=held, renew_before=renew_before
        )

    def held_near(self, key: bytes, replicas: int | None = None) -> list[SignedRecord] | None:
        """``DHTClient.held_near``."""
        return self.client.held_near(key, replicas)

    def forget(self, key: bytes) -> None:
        """``DHTClient.forget``."""
        self.client.forget(key)
