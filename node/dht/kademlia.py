"""The DHT node: drives ``protocol.dht`` (routing, lookup, records) over the shared transport.

Theory of operation (Maymounkov & Mazières, "Kademlia", IPTPS 2002, sections 2.3-2.5).

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

Client. ``find_node`` feeds a ``Lookup`` with ``alpha`` queries in flight, each bounded by
``request_timeout_s``, the whole by ``lookup_timeout_s``. ``store`` signs a record in our own
subkey, looks up the ``k`` nodes nearest the key and stores it on all of them (and locally when
this node is itself among them); a republication within ``store_lookup_reuse_s`` reuses that
lookup's nodes, merged with the nearest the routing table has learned since, and looks up again
when fewer than half took it. ``get`` runs a FIND_VALUE lookup, verifies every record returned,
keeps the newest expiry per subkey and caches the result at the nearest node that answered
without it (section 2.3's caching); a delta ``get`` (``known``) names the records the caller
holds, so responders send only newer ones, and caches nothing. ``maintain`` (looped by ``run``) refreshes buckets
idle for ``refresh_interval_s`` (a fresh node's first pass is the paper's join refresh),
re-signs and republishes our own records before they expire, and prunes the store.

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
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from node.wire.rpc import open_off_loop
from node.wire.transport import Transport
from protocol.dht.lookup import Lookup, LookupResult
from protocol.dht.messages import (
    MAX_REPLY_PEERS,
    MAX_REPLY_RECORDS,
    MAX_STORE_RECORDS,
    REPLY_TO,
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
    SignedRecord,
    StoreLimits,
    sign_record,
    unknown_to,
    verify_record,
)
from protocol.dht.routing import ClaimQueue, PingCandidate, RoutingTable
from protocol.errors import (
    DecodeError,
    LocalProtocolError,
    NotAuthorized,
    RemoteProtocolError,
)
from protocol.ids import ID_BYTES, xor_distance
from protocol.wire.codec import encode
from protocol.wire.messages import Message, PeerInfo
from protocol.wire.signing import Opened, ReplayWindow, Signer, seal, split_sealed

__all__ = ["DHTConfig", "DHTMetrics", "DHTNode", "Maintenance", "RateLimited"]

log = logging.getLogger(__name__)

_Request = Ping | FindNode | FindValue | Store
_REFUSED = "refused: "  # StoreReply reasons with this prefix are refusals, others "already held"


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
    store_lookup_reuse_s: float = 60.0  # a Store reuses the nodes a lookup found this long (0: look up every time)


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


@dataclass(frozen=True, slots=True)
class _Failure:
    reason: str
    unreachable: bool  # counts against the peer in the routing table


@dataclass(slots=True)
class _OwnRecord:
    record: SignedRecord
    ttl_s: float
    due_at: float


# ── the node ────────────────────────────────────────────────────────────────────────────────


class DHTNode:
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
        self.routing = RoutingTable(self.peer_id, k=cfg.k, replacement_cache=cfg.replacement_cache,
                                    max_failures=cfg.max_failures)
        self.records = RecordStore(max_bytes=cfg.max_store_bytes, max_subkeys_per_key=cfg.max_subkeys_per_key,
                                  max_value_bytes=cfg.max_value_bytes, max_ttl_s=cfg.record_ttl_cap_s)
        self.limits = StoreLimits(source_rate=cfg.store_ip_rate, source_burst=cfg.store_ip_burst,
                                  key_rate=cfg.store_rate, key_burst=cfg.store_burst)
        self.claims = ClaimQueue(max_pending=cfg.max_claims, rate=cfg.claim_rate, burst=cfg.claim_burst,
                                 max_in_flight=cfg.max_claim_pings, retry_after_s=cfg.claim_retry_s)
        self._claimed = asyncio.Event()  # the claim queue changed: the verifier looks again
        self.replay, self._reply_replay = ReplayWindow(salt=os.urandom(16)), ReplayWindow(salt=os.urandom(16))
        self.metrics = DHTMetrics()
        self.rng = random.Random(int.from_bytes(self.peer_id[:8], "big"))
        self._own: dict[bytes, _OwnRecord] = {}
        self._handlers: dict[type[Message], Callable[[Any, str], Message]] = {
            Ping: self._on_ping, FindNode: self._on_find_node,
            FindValue: self._on_find_value, Store: self._on_store,
        }
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pings = 0
        self._heard: dict[bytes, float] = {}  # contacts in the table: when last heard from
        self._near: dict[bytes, tuple[float, list[PeerInfo]]] = {}  # key -> (when, nodes a lookup found nearest)

    @property
    def dialable(self) -> bool:
        return bool(self.me.address)

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
        return seal(encode(msg), self.signer, now=time.time(), nonce=os.urandom(16),
                    recipient=recipient).tobytes()

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
            self.limits.admit(source=source, signer=opened.peer_id, records=len(msg.records), now=self.clock())
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
        return ValueReply(records=tuple(records[:MAX_REPLY_RECORDS]),
                          peers=() if holder else tuple(self._nearest(msg.key)), omitted=omitted)

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
        reply = await self._call(contact.address, Ping(sender=self.me), contact.peer_id, charge=False)
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

    # ── one outbound call ───────────────────────────────────────────────────────────────────

    async def _call(self, address: str, msg: _Request, peer_id: bytes | None = None, *,
                    charge: bool = True) -> Opened | _Failure:
        """Send ``msg`` to ``address``; the verified reply, or why not (never raises).

        A reply must be signed by ``peer_id`` when given; a failure counts against ``peer_id``'s
        routing entry only when ``charge`` (a claimed address that fails is no fault of the entry).
        """
        charged = peer_id if charge else None
        self.metrics.rpcs_out[type(msg).__name__] += 1
        sealed = self.seal(msg, peer_id or b"")
        try:
            status, buf, used, _ = await self.transport.request(
                "POST", address, chunks=[sealed], size=len(sealed),
                timeout_s=self.config.request_timeout_s, max_reply=self.config.max_reply, kind=type(msg).__name__,
            )
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, RemoteProtocolError) as exc:
            return self._failed(charged, f"unreachable ({type(exc).__name__})", unreachable=True)
        give_back = True
        try:
            if status != 200:
                # 404: no DHT node at that address (a name unmounted), as dead as a 5xx
                return self._failed(charged, f"status {status}", unreachable=status >= 500 or status == 404)
            opened = await self._open_reply(buf, used, msg, peer_id)
        except RemoteProtocolError as exc:
            return self._failed(charged, f"bad reply ({type(exc).__name__})", unreachable=True)
        except asyncio.CancelledError:
            give_back = False  # a decoding thread may still read it: not back to the pool
            raise
        finally:
            if give_back:
                self.transport.pool.give(buf)
        self._seen(PeerInfo(peer_id=opened.peer_id, address=address))
        return opened

    async def _open_reply(self, buf: bytearray, used: int, msg: _Request, peer_id: bytes | None) -> Opened:
        envelope, body = split_sealed(memoryview(buf)[:used], max_size=self.config.max_reply,
                                      expected_recipient=self.peer_id)
        opened = await open_off_loop(envelope, body, replay=self._reply_replay)  # big replies: off the loop
        reply, expected = opened.message, REPLY_TO[type(msg)]
        if type(reply) is not expected:
            raise DecodeError(f"got {type(reply).__name__} for {type(msg).__name__}")
        if peer_id is not None and opened.peer_id != peer_id:
            raise NotAuthorized(f"reply signed by {opened.peer_id.hex()[:16]}, not the peer asked")
        if isinstance(reply, Pong):
            check_sender(reply.sender, opened.public_key)
        return opened

    def _failed(self, peer_id: bytes | None, reason: str, *, unreachable: bool) -> _Failure:
        self.metrics.failures[reason] += 1
        if unreachable and peer_id is not None:
            self.routing.on_failed(peer_id, self.clock())
        return _Failure(reason, unreachable)

    # ── lookups ─────────────────────────────────────────────────────────────────────────────

    async def _lookup(self, target: bytes, *, find_value: bool, quorum: int = 1,
                      known: tuple[bytes, ...] = ()) -> LookupResult:
        cfg = self.config
        _check_id(target)
        self.routing.touch(target, self.clock())
        lookup = Lookup(target, self.routing.closest(target), k=cfg.k, alpha=cfg.alpha,
                        find_value=find_value, min_values=quorum, own_id=self.peer_id)
        known = known[:MAX_REPLY_RECORDS]  # a FindValue names at most this many: the rest come in full
        try:
            async with asyncio.timeout(cfg.lookup_timeout_s):
                await self._drive(lookup, known)
        except TimeoutError:
            self.metrics.failures["lookup timed out"] += 1
        result = lookup.result()
        hops = self.metrics.value_hops if find_value else self.metrics.node_hops
        hops[result.hops] += 1
        return result

    async def _drive(self, lookup: Lookup, known: tuple[bytes, ...] = ()) -> None:
        async with asyncio.TaskGroup() as tg:
            pending: set[asyncio.Task[tuple[PeerInfo, Opened | _Failure]]] = set()
            while not lookup.done:
                for contact in lookup.next_queries(self.clock()):
                    pending.add(tg.create_task(self._query(lookup, contact, known)))
                if not pending:
                    break
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._feed(lookup, *task.result())
            for task in pending:
                task.cancel()

    async def _query(self, lookup: Lookup, contact: PeerInfo,
                     known: tuple[bytes, ...] = ()) -> tuple[PeerInfo, Opened | _Failure]:
        msg: _Request = (
            FindValue(sender=self.me, key=lookup.target, known=known)
            if lookup.find_value
            else FindNode(sender=self.me, target=lookup.target)
        )
        return contact, await self._call(contact.address, msg, contact.peer_id)

    def _feed(self, lookup: Lookup, contact: PeerInfo, reply: Opened | _Failure) -> None:
        now = self.clock()
        if isinstance(reply, _Failure):
            lookup.on_failure(contact.peer_id, now)
            return
        msg = reply.message
        assert isinstance(msg, NodesReply | ValueReply)  # checked against REPLY_TO in _call
        if isinstance(msg, ValueReply):
            records = self._valid(msg.records, lookup.target)
            lookup.on_response(contact.peer_id, msg.peers, now, value=records, omitted=msg.omitted)
        else:
            lookup.on_response(contact.peer_id, msg.peers, now)

    def _valid(self, records: Iterable[SignedRecord], key: bytes) -> list[SignedRecord]:
        now, good = self.clock(), []
        for rec in records:
            try:
                if rec.key != key:
                    raise DecodeError("record for another key")
                verify_record(rec, now=now, max_ttl=self.config.record_ttl_cap_s,
                              max_value_bytes=self.config.max_value_bytes)
            except RemoteProtocolError as exc:
                self.metrics.failures[f"bad record ({type(exc).__name__})"] += 1
                continue
            good.append(rec)
        return good

    # ── the public client API ───────────────────────────────────────────────────────────────

    async def ping(self, address: str) -> PeerInfo | None:
        """Ping ``address``; the peer that answered (its id now learned), or None."""
        reply = await self._call(address, Ping(sender=self.me))
        return None if isinstance(reply, _Failure) else PeerInfo(peer_id=reply.peer_id, address=address)

    async def bootstrap(self, addresses: Sequence[str]) -> int:
        """Join through ``addresses``: ping them, then look up our own id (section 2.3).

        Returns how many of them answered; 0 means the join failed. The paper's refresh of the
        farther buckets is the first ``maintain`` pass (every bucket of a new node is stale).
        """
        replies = await asyncio.gather(*(self.ping(a) for a in addresses))
        reached = sum(r is not None for r in replies)
        if reached:
            await self.find_node(self.peer_id)
        return reached

    async def find_node(self, target: bytes) -> LookupResult:
        """The ``k`` live nodes nearest ``target`` (32 bytes) that answered, nearest first."""
        return await self._lookup(target, find_value=False)

    async def find_value(self, key: bytes, *, quorum: int = 1, known: tuple[bytes, ...] = ()) -> LookupResult:
        """FIND_VALUE until ``quorum`` peers returned records (or said that every record they
        hold is among ``known``, ``protocol.dht.records.known_tags``); records are verified."""
        return await self._lookup(key, find_value=True, quorum=quorum, known=known)

    async def store(self, key: bytes, value: bytes, ttl_s: float) -> int:
        """Sign ``value`` under ``key`` (32 bytes) in our subkey and store it on the ``k`` nodes
        nearest the key; keep republishing it. Returns how many nodes hold it (this one counts
        when it is among the nearest). Raises LocalProtocolError for a bad key, ttl or size."""
        _check_id(key)
        cfg = self.config
        if not 0 < ttl_s <= cfg.record_ttl_cap_s or len(value) > cfg.max_value_bytes:
            raise LocalProtocolError(
                f"need 0 < ttl <= {cfg.record_ttl_cap_s}s and value <= {cfg.max_value_bytes} "
                f"bytes; got {ttl_s}s, {len(value)} bytes"
            )
        rec = self._sign(key, value, ttl_s)
        return await self._publish(key, (rec,))

    async def get(self, key: bytes, *, quorum: int = 1, known: tuple[bytes, ...] = ()) -> list[SignedRecord]:
        """Verified records under ``key``: the newest expiry per subkey, ordered by subkey.

        With ``known`` (``known_tags`` of the records the caller holds), a delta read: responders
        leave those out, so what comes back is only what is newer, and nothing is cached (a
        partial set would make the cache a source that lacks records). Without it, caches what
        it found at the nearest node that answered without it.
        """
        result = await self.find_value(key, quorum=quorum, known=known)
        local = self.records.get(key, self.clock()) if self.dialable else []
        records = _newest_per_subkey([*local, *result.value], self.clock())
        cache = result.closest_without_value
        if result.found and cache is not None and not known:
            batch = tuple(sorted(records, key=lambda r: -r.expires_at)[:MAX_STORE_RECORDS])
            await self._call(cache.address, Store(sender=self.me, records=batch), cache.peer_id)
        return records

    def held_near(self, key: bytes) -> list[SignedRecord] | None:
        """The records this node holds under ``key`` when it is among the ``k`` nodes nearest
        the key that it knows of (publishers store there, so a read from here needs no
        request); None when it is not, or holds none. Raises LocalProtocolError for a bad key."""
        _check_id(key)
        if not self.dialable:
            return None
        nearest = self.routing.closest(key, self.config.k)
        if len(nearest) >= self.config.k and xor_distance(self.peer_id, key) > xor_distance(nearest[-1].peer_id, key):
            return None
        return self.records.get(key, self.clock()) or None

    def forget(self, key: bytes) -> None:
        """Stop republishing our record under ``key`` (it expires at its ttl)."""
        self._own.pop(key, None)

    def _sign(self, key: bytes, value: bytes, ttl_s: float) -> SignedRecord:
        now = self.clock()
        rec = sign_record(self.signer, key, value, now + ttl_s)
        due = now + min(self.config.republish_interval_s, ttl_s / 2)
        self._own[key] = _OwnRecord(rec, ttl_s, due)
        return rec

    async def _publish(self, key: bytes, records: tuple[SignedRecord, ...]) -> int:
        targets = await self._store_targets(key)
        msg = Store(sender=self.me, records=records)
        replies = await asyncio.gather(*(self._call(c.address, msg, c.peer_id) for c in targets))
        held = sum(_holds(r) for r in replies)
        if 2 * held < len(targets):
            self._near.pop(key, None)  # the neighbourhood moved on: look it up again next time
        return held + self._store_locally(key, records, targets)

    async def _store_targets(self, key: bytes) -> list[PeerInfo]:
        """The ``k`` nodes nearest ``key`` to store on: a lookup's answer, reused for
        ``store_lookup_reuse_s`` (members republish every few seconds, and the nodes nearest a
        key rarely change), merged with the nearest contacts the routing table learned since."""
        now, cfg = self.clock(), self.config
        near = self._near.get(key)
        if near is None or now - near[0] >= cfg.store_lookup_reuse_s:
            closest = (await self.find_node(key)).closest
            if len(self._near) >= 64:
                self._near.pop(next(iter(self._near)))
            self._near[key] = (now, closest)
            return closest
        merged = {c.peer_id: c for c in self.routing.closest(key, cfg.k)}
        merged.update((c.peer_id, c) for c in near[1] if c.peer_id in self.routing)
        return sorted(merged.values(), key=lambda c: xor_distance(c.peer_id, key))[:cfg.k]

    def _store_locally(self, key: bytes, records: Sequence[SignedRecord], nearest: list[PeerInfo]) -> int:
        """Hold ``records`` here too when this node is among the ``k`` nearest ``key``."""
        near = len(nearest) < self.config.k or (
            xor_distance(self.peer_id, key) < xor_distance(nearest[-1].peer_id, key))
        if not (self.dialable and near):
            return 0
        try:
            for rec in records:
                self.records.put(rec, self.clock())
        except RemoteProtocolError as exc:  # our own store is full
            self.metrics.failures[f"local store ({type(exc).__name__})"] += 1
            return 0
        return 1

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
        return Maintenance(refreshed=len(targets), republished=len(due),
                           pruned=self.records.prune(self.clock()))


# ── helpers ─────────────────────────────────────────────────────────────────────────────────


def _check_id(value: bytes) -> None:
    if len(value) != ID_BYTES:
        raise LocalProtocolError(f"DHT keys and targets are {ID_BYTES} bytes, got {len(value)}")


def _holds(reply: Opened | _Failure) -> bool:
    """Whether a Store reply says the peer now holds the record (stored, or held already)."""
    if isinstance(reply, _Failure):
        return False
    msg = reply.message
    assert isinstance(msg, StoreReply)
    return msg.accepted > 0 or (bool(msg.reasons) and not any(r.startswith(_REFUSED) for r in msg.reasons))


def _newest_per_subkey(records: Iterable[SignedRecord], now: float) -> list[SignedRecord]:
    best: dict[bytes, SignedRecord] = {}
    for rec in records:
        held = best.get(rec.subkey)
        if rec.expires_at > now and (held is None or rec.expires_at > held.expires_at):
            best[rec.subkey] = rec
    return [best[s] for s in sorted(best)]
