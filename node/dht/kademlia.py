"""The DHT node: drives ``protocol.dht`` (routing, lookup, records) over the shared transport.

Theory of operation (Maymounkov & Mazières, "Kademlia", IPTPS 2002, sections 2.3-2.5). This module
is the serving side, routing, maintenance and lifecycle; the client side (calls, lookups, store,
get) is ``DHTClient`` in ``node.dht.lookups``, mixed into ``DHTNode``.

Serving. ``DHTRouter`` (``node.dht.route``) mounts nodes on one POST route of
a ``Transport`` and verifies each request over its exact bytes with the addressed node's replay
window. ``DHTNode.handle`` then checks that the message's ``sender`` is the envelope's signer
(``check_sender``), meters Store per requester IP (records) and per signing key (requests)
(``StoreLimits``; ``RateLimited``, 429), passes the sender to routing (below), and answers from
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
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from node.dht.lookups import _REFUSED, DHTClient, _Failure, _OwnRecord, _Request
from node.wire.transport import Transport
from protocol.dht.messages import (
    MAX_REPLY_PEERS,
    MAX_REPLY_RECORDS,
    FindNode,
    FindValue,
    NodesReply,
    Ping,
    Pong,
    Store,
    StoreReply,
    ValueReply,
    check_sender,
)
from protocol.dht.records import (
    DEFAULT_MAX_VALUE_BYTES,
    RateLimited,
    RecordStore,
    StoreLimits,
    unknown_to,
)
from protocol.dht.routing import ClaimQueue, PingCandidate, RoutingTable
from protocol.errors import LocalProtocolError, NotAuthorized, RemoteProtocolError
from protocol.wire.codec import encode
from protocol.wire.messages import Message, PeerInfo
from protocol.wire.signing import Opened, ReplayWindow, Signer, seal

__all__ = ["DHTConfig", "DHTMetrics", "DHTNode", "Maintenance", "RateLimited"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DHTConfig:
    """Kademlia parameters, timeouts and caps of one node."""

    k: int = 20  # bucket size and replication factor
    alpha: int = 3  # lookup queries in flight
    request_timeout_s: float = 5.0
    lookup_timeout_s: float = 30.0
    refresh_interval_s: float = 3600.0  # refresh a bucket idle this long (paper: an hour)
    republish_interval_s: float = 3600.0  # re-sign our records this often (or at half their ttl)
    maintenance_period_s: float = 60.0  # how often run() wakes; 0: start() does not spawn it
    record_ttl_cap_s: float = 24 * 3600.0
    store_rate: float = 10.0  # Store requests a second per signing key, after...
    store_burst: float = 50.0  # ...a burst of this many
    store_ip_rate: float = 100.0  # records stored a second per requester IP (IPv6: per /64)...
    store_ip_burst: float = 1000.0  # ...after a burst of this many
    max_store_bytes: int = 64 << 20  # values plus 1 KiB a record (RECORD_OVERHEAD_BYTES)
    max_subkeys_per_key: int = 1_000
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_request: int = 1 << 20  # bytes of a sealed request (Store is at most 64 records)
    max_reply: int = 8 << 20  # bytes of a sealed reply (a ValueReply of many subkeys)
    max_failures: int = 3  # RPC failures before a contact is evicted
    replacement_cache: int = 10
    max_background_pings: int = 16
    ping_fresh_s: float = 60.0  # a full bucket's oldest contact heard from this recently is alive
    max_claims: int = 64  # senders' claimed addresses waiting for our ping...
    claim_rate: float = 10.0  # ...pinged at this many a second, after...
    claim_burst: float = 50.0  # ...a burst of this many...
    max_claim_pings: int = 8  # ...with at most this many in flight
    claim_retry_s: float = 60.0  # an address that did not answer is not pinged again this soon
    store_lookup_reuse_s: float = (
        60.0  # a Store reuses the nodes a lookup found this long (0: look up every time)
    )


@dataclass(slots=True)
class DHTMetrics:
    """Counters of one node. ``refusals``: inbound requests or records refused, by error class;
    ``failures``: outbound calls that failed, by kind; ``claims``: what became of addresses that
    senders claimed (queued, dropped, answered, unanswered); hops: completed lookups by hop
    count. The record store counts its own evictions (``records.counts``)."""

    rpcs_in: Counter[str] = field(default_factory=Counter)
    rpcs_out: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    claims: Counter[str] = field(default_factory=Counter)  # senders' claimed addresses, by outcome
    node_hops: Counter[int] = field(default_factory=Counter)
    value_hops: Counter[int] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class Maintenance:
    """What one ``maintain`` pass did."""

    refreshed: int
    republished: int
    pruned: int


# ── the node ────────────────────────────────────────────────────────────────────────────────


class DHTNode(DHTClient):
    """One Kademlia node with key ``signer``, dialled at ``address`` ("" when not dialable)."""

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
        )
        self.limits = StoreLimits(
            source_rate=cfg.store_ip_rate,
            source_burst=cfg.store_ip_burst,
            key_rate=cfg.store_rate,
            key_burst=cfg.store_burst,
        )
        self.claims = ClaimQueue(
            max_pending=cfg.max_claims,
            rate=cfg.claim_rate,
            burst=cfg.claim_burst,
            max_in_flight=cfg.max_claim_pings,
            retry_after_s=cfg.claim_retry_s,
        )
        self._claimed = asyncio.Event()  # the claim queue changed: the verifier looks again
        self.replay, self._reply_replay = (
            ReplayWindow(salt=os.urandom(16)),
            ReplayWindow(salt=os.urandom(16)),
        )
        self.metrics = DHTMetrics()
        self.rng = random.Random(int.from_bytes(self.peer_id[:8], "big"))
        self._own: dict[bytes, _OwnRecord] = {}
        self._handlers: dict[type[Message], Callable[[Any, str], Message]] = {
            Ping: self._on_ping,
            FindNode: self._on_find_node,
            FindValue: self._on_find_value,
            Store: self._on_store,
        }
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pings = 0
        self._heard: dict[bytes, float] = {}  # contacts in the table: when last heard from
        self._near: dict[
            bytes, tuple[float, list[PeerInfo]]
        ] = {}  # key -> (when, nodes a lookup found nearest)

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
        """``msg`` sealed by this node's key with the current wall time and a fresh nonce, for
        the peer id ``recipient`` (empty: anyone; only a Ping to a bare address goes so)."""
        return seal(
            encode(msg), self.signer, now=time.time(), nonce=os.urandom(16), recipient=recipient
        ).tobytes()

    def handle(self, opened: Opened, source: str = "") -> Message:
        """Answer one verified request that came from the IP address ``source``.

        Raises ``NotAuthorized`` (not a DHT request, or sender is not the signer) and
        ``RateLimited`` (Store over the requester IP's or the signing key's budget).
        """
        msg = opened.message
        if not isinstance(msg, _Request):
            raise NotAuthorized(f"no DHT handler for {type(msg).__name__}")
        check_sender(msg.sender, opened.public_key)
        if isinstance(msg, Store):
            self.limits.admit(
                source=source, signer=opened.peer_id, records=len(msg.records), now=self.clock()
            )
        self.metrics.rpcs_in[type(msg).__name__] += 1
        self._claim(msg.sender, source)
        return self._handlers[type(msg)](msg, source)

    def _on_ping(self, msg: Ping, source: str) -> Pong:
        return Pong(sender=self.me)

    def _on_find_node(self, msg: FindNode, source: str) -> NodesReply:
        return NodesReply(peers=tuple(self._nearest(msg.target)))

    def _on_find_value(self, msg: FindValue, source: str) -> ValueReply:
        records, omitted = unknown_to(self.records.get(msg.key, self.clock()), msg.known)
        # A holder answers a delta read (one that names records: the asker has read the key
        # before) with the value instead of contacts, as Kademlia's FIND_VALUE does; a first read
        # still gets contacts, so a reader that knows few nodes finds enough holders.
        holder = msg.known and (records or omitted)
        return ValueReply(
            records=tuple(records[:MAX_REPLY_RECORDS]),
            peers=() if holder else tuple(self._nearest(msg.key)),
            omitted=omitted,
        )

    def _on_store(self, msg: Store, source: str) -> StoreReply:
        now, accepted, reasons = self.clock(), 0, []
        for rec in msg.records:
            try:
                put = self.records.put(rec, now, source)
            except RemoteProtocolError as exc:
                self.metrics.refusals[f"record {type(exc).__name__}"] += 1
                reasons.append(f"{_REFUSED}{type(exc).__name__}: {exc.reason}")
                continue
            accepted += put.stored
            if not put.stored:
                reasons.append(put.reason)
        return StoreReply(accepted=accepted, reasons=tuple(reasons))

    def _nearest(self, target: bytes) -> list[PeerInfo]:
        return self.routing.closest(target, min(self.config.k, MAX_REPLY_PEERS))

    # ── routing table upkeep ────────────────────────────────────────────────────────────────

    def _claim(self, sender: PeerInfo, source: str) -> None:
        """A request's sender: seen if the table holds it at that address, else a claim to ping."""
        if not sender.address:
            return
        if self.routing.holds(sender):
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
        reply = await self._call(
            contact.address, Ping(sender=self.me), contact.peer_id, charge=False
        )
        answered = not isinstance(reply, _Failure)  # _call saw it: it is in the table now
        self.claims.done(contact, answered, self.clock())
        self.metrics.claims["answered" if answered else "unanswered"] += 1
        self._claimed.set()

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
            reply = await self._call(oldest.address, Ping(sender=self.me), oldest.peer_id)
        finally:
            self._pings -= 1
        alive = not isinstance(reply, _Failure)
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
            await self.find_node(target)
        due = [(k, o) for k, o in self._own.items() if now >= o.due_at]
        for key, own in due:
            await self._publish(key, (self._sign(key, own.record.value, own.ttl_s),))
        self._heard = {p: t for p, t in self._heard.items() if p in self.routing}
        return Maintenance(
            refreshed=len(targets), republished=len(due), pruned=self.records.prune(self.clock())
        )
