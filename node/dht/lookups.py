"""A DHT node's client side (Maymounkov & Mazières, "Kademlia", IPTPS 2002, sections 2.3-2.5):
``Caller`` makes one outbound call, ``DHTClient`` runs lookups, store and get with it. ``DHTNode``
(``node.dht.kademlia``) builds both and serves the other side.

Client. ``find_node`` feeds a ``Lookup`` with ``alpha`` queries in flight, each bounded by
``request_timeout_s``, the whole by ``lookup_timeout_s``. ``store`` signs a record in our own
subkey, looks up the ``k`` nodes nearest the key and stores it on all of them (and locally when
this node is itself among them); a republication within ``store_lookup_reuse_s`` reuses that
lookup's nodes, merged with the nearest the routing table has learned since, and looks up again
when fewer than half took it. ``get`` runs a FIND_VALUE lookup, verifies every record returned,
keeps the newest expiry per subkey and caches the result at the nearest node that answered
without it (section 2.3's caching); a delta ``get`` (``known``) names the records the caller
holds, so responders send only newer ones, and caches nothing.

Every outbound call goes through ``Caller.call``, which never raises: a verified reply is its
signer seen at the address dialled (the ``seen`` callback the node gives it), anything else a
``Failure`` (counted, and charged to the contact's routing entry).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from node.dht.dht_config import DHTConfig, DHTMetrics
from node.wire.rpc import open_off_loop
from node.wire.transport import Transport
from protocol.dht.lookup import Lookup, LookupResult
from protocol.dht.messages import (
    MAX_REPLY_RECORDS,
    MAX_STORE_RECORDS,
    REPLY_TO,
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
    RecordRefresh,
    RecordStore,
    SignedRecord,
    content_tag,
    only_subkeys,
    renewed,
    sign_record,
    verify_record,
)
from protocol.dht.routing import RoutingTable
from protocol.errors import DecodeError, LocalProtocolError, NotAuthorized, RemoteProtocolError
from protocol.ids import ID_BYTES, xor_distance
from protocol.wire.codec import encode
from protocol.wire.messages import Message, PeerInfo
from protocol.wire.signing import Opened, ReplayWindow, Signer, seal, split_sealed

__all__ = ["REFUSED", "Caller", "DHTClient", "DHTRequest", "Failure"]

DHTRequest = Ping | FindNode | FindValue | Store | Refresh
REFUSED = "refused: "  # StoreReply reasons with this prefix are refusals, others "already held"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an outbound call got no verified reply."""

    reason: str
    unreachable: bool  # counts against the peer in the routing table


@dataclass(frozen=True, slots=True)
class _Ask:
    """What one FIND_VALUE lookup names: expiry tags (``known``), subkey prefixes (``only``),
    content tags (``same``, ``renew``) and the held records the refreshes apply to."""

    known: tuple[bytes, ...] = ()
    only: tuple[bytes, ...] = ()
    same: tuple[bytes, ...] = ()
    renew: tuple[bytes, ...] = ()
    held: dict[bytes, SignedRecord] = field(default_factory=dict)  # subkey -> record

    @property
    def named(self) -> bool:
        """A delta read or a lookup by id (not a first read of the key)."""
        return bool(self.known or self.only or self.same or self.renew)

    @classmethod
    def of(
        cls,
        known: tuple[bytes, ...],
        only: tuple[bytes, ...],
        held: Sequence[SignedRecord],
        renew_before: float,
    ) -> _Ask:
        """Content tags for ``held`` (newest per subkey, at most ``MAX_REPLY_RECORDS`` less
        ``known``): ``renew`` for those expiring before ``renew_before``, ``same`` for the rest."""
        kept = _newest_per_subkey(held, -math.inf)[: MAX_REPLY_RECORDS - len(known)]
        return cls(
            known=known,
            only=only,
            same=tuple(content_tag(r) for r in kept if r.expires_at >= renew_before),
            renew=tuple(content_tag(r) for r in kept if r.expires_at < renew_before),
            held={r.subkey: r for r in kept},
        )


@dataclass(slots=True)
class _OwnRecord:
    record: SignedRecord
    ttl_s: float
    due_at: float
    replicas: int  # stored on this many of the nodes nearest its key
    holders: set[bytes] = field(default_factory=set)  # nodes known to hold this value


# ── one outbound call ───────────────────────────────────────────────────────────────────────


class Caller:
    """Outbound calls of the node with key ``signer``: seal, send, verify the reply.

    ``seen(contact)`` hears of every peer that answered at the address dialled (the node's
    routing upkeep); a failure is counted in ``metrics`` and charged to ``routing``."""

    def __init__(
        self,
        signer: Signer,
        transport: Transport,
        config: DHTConfig,
        *,
        metrics: DHTMetrics,
        routing: RoutingTable,
        seen: Callable[[PeerInfo], None],
        clock: Callable[[], float],
    ) -> None:
        self.signer, self.transport, self.config = signer, transport, config
        self.metrics, self.routing, self.seen, self.clock = metrics, routing, seen, clock
        self.replay = ReplayWindow(salt=os.urandom(16))  # replies' nonces

    def seal(self, msg: Message, recipient: bytes = b"") -> bytes:
        """``msg`` sealed by our key with the current wall time and a fresh nonce, for the peer
        id ``recipient`` (empty: anyone; only a Ping to a bare address goes so)."""
        return seal(
            encode(msg), self.signer, now=time.time(), nonce=os.urandom(16), recipient=recipient
        ).tobytes()

    async def call(
        self, address: str, msg: DHTRequest, peer_id: bytes | None = None, *, charge: bool = True
    ) -> Opened | Failure:
        """Send ``msg`` to ``address``; the verified reply, or why not (never raises).

        A reply must be signed by ``peer_id`` when given; a failure counts against ``peer_id``'s
        routing entry only when ``charge`` (a claimed address that fails is no fault of the entry).
        """
        charged = peer_id if charge else None
        self.metrics.rpcs_out[type(msg).__name__] += 1
        sealed = self.seal(msg, peer_id or b"")
        try:
            async with self.transport.reply(
                "POST",
                address,
                chunks=[sealed],
                size=len(sealed),
                timeout_s=self.config.request_timeout_s,
                max_reply=self.config.max_reply,
                kind=type(msg).__name__,
            ) as r:
                if r.status != 200:
                    # 404: no DHT node at that address (a name unmounted), as dead as a 5xx
                    return self._failed(
                        charged,
                        f"status {r.status}",
                        unreachable=r.status >= 500 or r.status == 404,
                    )
                try:
                    # a big reply is verified on a worker thread: ``settle`` lets it finish
                    opened = await r.settle(self._open(r.body, msg, peer_id))
                except RemoteProtocolError as exc:
                    return self._failed(
                        charged, f"bad reply ({type(exc).__name__})", unreachable=True
                    )
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, RemoteProtocolError) as exc:
            return self._failed(charged, f"unreachable ({type(exc).__name__})", unreachable=True)
        self.seen(PeerInfo(peer_id=opened.peer_id, address=address))
        return opened

    async def _open(self, body: memoryview, msg: DHTRequest, peer_id: bytes | None) -> Opened:
        envelope, payload = split_sealed(
            body, max_size=self.config.max_reply, expected_recipient=self.signer.peer_id
        )
        opened = await open_off_loop(envelope, payload, replay=self.replay)  # big: off the loop
        reply, expected = opened.message, REPLY_TO[type(msg)]
        if type(reply) is not expected:
            raise DecodeError(f"got {type(reply).__name__} for {type(msg).__name__}")
        if peer_id is not None and opened.peer_id != peer_id:
            raise NotAuthorized(f"reply signed by {opened.peer_id.hex()[:16]}, not the peer asked")
        if isinstance(reply, Pong):
            check_sender(reply.sender, opened.public_key)
        return opened

    def _failed(self, peer_id: bytes | None, reason: str, *, unreachable: bool) -> Failure:
        self.metrics.failures[reason] += 1
        if unreachable and peer_id is not None:
            self.routing.on_failed(peer_id, self.clock())
        return Failure(reason, unreachable)


# ── lookups, store and get ──────────────────────────────────────────────────────────────────


class DHTClient:
    """Lookups and the client API (ping, bootstrap, find_node, find_value, store, get) of the
    node ``me``, calling out through ``caller``; keeps our own records republished."""

    def __init__(
        self,
        caller: Caller,
        me: PeerInfo,
        config: DHTConfig,
        *,
        routing: RoutingTable,
        records: RecordStore,
        metrics: DHTMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.caller, self.me, self.config = caller, me, config
        self.peer_id = me.peer_id
        self.routing, self.records, self.metrics, self.clock = routing, records, metrics, clock
        self._own: dict[bytes, _OwnRecord] = {}
        # key -> (when, the nodes a lookup found nearest, how many it looked for)
        self._near: dict[bytes, tuple[float, list[PeerInfo], int]] = {}

    @property
    def dialable(self) -> bool:
        return bool(self.me.address)

    async def _call(
        self, address: str, msg: DHTRequest, peer_id: bytes | None = None
    ) -> Opened | Failure:
        return await self.caller.call(address, msg, peer_id)

    # ── lookups ─────────────────────────────────────────────────────────────────────────────

    async def _lookup(
        self,
        target: bytes,
        *,
        find_value: bool,
        quorum: int = 1,
        ask: _Ask | None = None,
        k: int | None = None,
    ) -> LookupResult:
        cfg = self.config
        _check_id(target)
        self.routing.touch(target, self.clock())
        ask = ask or _Ask()
        lookup = Lookup(
            target,
            self.routing.closest(target),
            k=cfg.k if k is None else k,
            # a delta read or a lookup by id asks as many holders as it needs at a time: every
            # holder answers it with the same records (three in flight tripled a read's bytes)
            alpha=min(cfg.alpha, max(quorum, 1)) if ask.named else cfg.alpha,
            find_value=find_value,
            min_values=quorum,
            own_id=self.peer_id,
        )
        try:
            async with asyncio.timeout(cfg.lookup_timeout_s):
                await self._drive(lookup, ask)
        except TimeoutError:
            self.metrics.failures["lookup timed out"] += 1
        result = lookup.result()
        hops = self.metrics.value_hops if find_value else self.metrics.node_hops
        hops[result.hops] += 1
        return result

    async def _drive(self, lookup: Lookup, ask: _Ask) -> None:
        async with asyncio.TaskGroup() as tg:
            pending: set[asyncio.Task[tuple[PeerInfo, Opened | Failure]]] = set()
            while not lookup.done:
                for contact in lookup.next_queries(self.clock()):
                    pending.add(tg.create_task(self._query(lookup, contact, ask)))
                if not pending:
                    break
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._feed(lookup, *task.result(), ask)
            for task in pending:
                task.cancel()

    async def _query(
        self, lookup: Lookup, contact: PeerInfo, ask: _Ask
    ) -> tuple[PeerInfo, Opened | Failure]:
        msg: DHTRequest = (
            FindValue(
                sender=self.me,
                key=lookup.target,
                known=ask.known,
                only=ask.only,
                same=ask.same,
                renew=ask.renew,
            )
            if lookup.find_value
            else FindNode(sender=self.me, target=lookup.target)
        )
        return contact, await self._call(contact.address, msg, contact.peer_id)

    def _feed(self, lookup: Lookup, contact: PeerInfo, reply: Opened | Failure, ask: _Ask) -> None:
        now = self.clock()
        if isinstance(reply, Failure):
            lookup.on_failure(contact.peer_id, now)
            return
        msg = reply.message
        assert isinstance(msg, NodesReply | ValueReply)  # checked against REPLY_TO in _call
        if isinstance(msg, ValueReply):
            rebuilt, wasted = renewed(msg.refreshes, ask.held)
            self.metrics.refreshes["received"] += len(msg.refreshes)
            if wasted:
                self.metrics.failures["refresh of no record held, or not newer"] += wasted
            records = self._valid([*msg.records, *rebuilt], lookup.target)
            lookup.on_response(contact.peer_id, msg.peers, now, value=records, omitted=msg.omitted)
        else:
            lookup.on_response(contact.peer_id, msg.peers, now)

    def _valid(self, records: Iterable[SignedRecord], key: bytes) -> list[SignedRecord]:
        now, good = self.clock(), []
        for rec in records:
            try:
                if rec.key != key:
                    raise DecodeError("record for another key")
                verify_record(
                    rec,
                    now=now,
                    max_ttl=self.config.record_ttl_cap_s,
                    max_value_bytes=self.config.max_value_bytes,
                    verified=self.records.verified,
                )
            except RemoteProtocolError as exc:
                self.metrics.failures[f"bad record ({type(exc).__name__})"] += 1
                continue
            good.append(rec)
        return good

    # ── the public client API ───────────────────────────────────────────────────────────────

    async def ping(self, address: str) -> PeerInfo | None:
        """Ping ``address``; the peer that answered (its id now learned), or None."""
        reply = await self._call(address, Ping(sender=self.me))
        return (
            None if isinstance(reply, Failure) else PeerInfo(peer_id=reply.peer_id, address=address)
        )

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

    async def find_node(self, target: bytes, *, k: int | None = None) -> LookupResult:
        """The ``k`` (default the node's) live nodes nearest ``target`` (32 bytes) that
        answered, nearest first. A smaller ``k`` ends the lookup once that many answered."""
        return await self._lookup(target, find_value=False, k=k)

    async def find_value(
        self,
        key: bytes,
        *,
        quorum: int = 1,
        known: tuple[bytes, ...] = (),
        only: tuple[bytes, ...] = (),
    ) -> LookupResult:
        """FIND_VALUE until ``quorum`` peers returned records (or said that every record they
        hold is among ``known``, ``protocol.dht.records.known_tags``); records are verified.
        ``only``: subkey prefixes, for the records of those subkeys alone."""
        return await self._lookup(
            key,
            find_value=True,
            quorum=quorum,
            ask=_Ask(known=known[:MAX_REPLY_RECORDS], only=only),
        )

    async def store(
        self,
        key: bytes,
        value: bytes,
        ttl_s: float,
        *,
        replicas: int | None = None,
        on_held: Callable[[], None] | None = None,
    ) -> int:
        """Sign ``value`` under ``key`` (32 bytes) in our subkey and store it on the ``replicas``
        nodes nearest the key (default ``k``), and here too when this node is among them; keep
        republishing it. Returns how many nodes hold
        it (this one counts when it is among the nearest). ``on_held`` is called as each node
        takes it, before the slowest has answered (an owner's lease runs from the first).
        Raises LocalProtocolError for a bad key, ttl, size or replica count."""
        _check_id(key)
        cfg = self.config
        if not 0 < ttl_s <= cfg.record_ttl_cap_s or len(value) > cfg.max_value_bytes:
            raise LocalProtocolError(
                f"need 0 < ttl <= {cfg.record_ttl_cap_s}s and value <= {cfg.max_value_bytes} "
                f"bytes; got {ttl_s}s, {len(value)} bytes"
            )
        n = cfg.k if replicas is None else replicas
        if not 1 <= n <= cfg.k:
            raise LocalProtocolError(f"need 1 <= replicas <= k = {cfg.k}; got {replicas}")
        rec = self._sign(key, value, ttl_s, n)
        return await self._publish(key, (rec,), n, on_held)

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
        """Verified records under ``key``: the newest expiry per subkey, ordered by subkey.

        With ``known`` (``known_tags`` of the records the caller holds), a delta read: responders
        leave those out, so what comes back is only what is newer, and nothing is cached (a
        partial set would make the cache a source that lacks records). With ``held`` (the
        caller's records under ``key``), a delta read by content (``protocol.dht.delta_reads``):
        responders leave out the held values, and send for those held that expire before
        ``renew_before`` only their newer expiry; nothing cached either. Without either, caches
        what it found at the nearest node that answered without it. With ``only`` (subkey
        prefixes), the records of those subkeys alone, and nothing cached either.
        """
        ask = _Ask.of(known[:MAX_REPLY_RECORDS], only, held, renew_before)
        result = await self._lookup(key, find_value=True, quorum=quorum, ask=ask)
        local = self.records.get(key, self.clock()) if self.dialable else []
        found = only_subkeys([*local, *result.value], only)
        records = _newest_per_subkey(found, self.clock())
        cache = result.closest_without_value
        if result.found and records and cache is not None and not ask.named:
            batch = tuple(sorted(records, key=lambda r: -r.expires_at)[:MAX_STORE_RECORDS])
            await self._call(cache.address, Store(sender=self.me, records=batch), cache.peer_id)
        return records

    def held_near(self, key: bytes, replicas: int | None = None) -> list[SignedRecord] | None:
        """The records this node holds under ``key`` when it is among the ``replicas`` (default
        ``k``) nodes nearest the key that it knows of (publishers store there, so a read from
        here needs no request); None when it is not, or holds none. Raises LocalProtocolError
        for a bad key."""
        _check_id(key)
        if not self.dialable:
            return None
        n = self.config.k if replicas is None else replicas
        nearest = self.routing.closest(key, n)
        if len(nearest) >= n and xor_distance(self.peer_id, key) > xor_distance(
            nearest[-1].peer_id, key
        ):
            return None
        return self.records.get(key, self.clock()) or None

    def forget(self, key: bytes) -> None:
        """Stop republishing our record under ``key`` (it expires at its ttl)."""
        self._own.pop(key, None)

    async def republish_due(self, now: float) -> int:
        """Re-sign and store again each of our records due at ``now``; how many were."""
        due = [(k, o) for k, o in self._own.items() if now >= o.due_at]
        for key, own in due:
            rec = self._sign(key, own.record.value, own.ttl_s, own.replicas)
            await self._publish(key, (rec,), own.replicas)
        return len(due)

    def _sign(self, key: bytes, value: bytes, ttl_s: float, replicas: int) -> SignedRecord:
        now = self.clock()
        rec = sign_record(self.caller.signer, key, value, now + ttl_s)
        due = now + min(self.config.republish_interval_s, ttl_s / 2)
        old = self._own.get(key)
        # the nodes that hold this very value (and an unexpired copy) can take a refresh
        holders = old.holders if old is not None and old.record.value == value else set()
        if old is not None and old.record.expires_at <= now:
            holders = set()
        self._own[key] = _OwnRecord(rec, ttl_s, due, replicas, holders)
        return rec

    async def _publish(
        self,
        key: bytes,
        records: tuple[SignedRecord, ...],
        replicas: int,
        on_held: Callable[[], None] | None = None,
    ) -> int:
        targets = await self._store_targets(key, replicas)
        local = self._store_locally(key, records, targets, replicas)
        if local and on_held is not None:
            on_held()

        async def put(to: PeerInfo) -> bool:
            held = await self._put(key, records, to)
            if held and on_held is not None:
                on_held()
            return held

        replies = await asyncio.gather(*(put(c) for c in targets))
        held = sum(replies)
        if 2 * held < len(targets):
            self._near.pop(key, None)  # the neighbourhood moved on: look it up again next time
        return held + local

    async def _put(self, key: bytes, records: tuple[SignedRecord, ...], to: PeerInfo) -> bool:
        """Store ``records`` at ``to``; whether it holds them. Our own record, republished with
        its value unchanged, goes as a ``Refresh`` (expiry and signature) to a node that holds
        that value, and whole when the refresh is refused (the node lost it)."""
        own = self._own.get(key)
        mine = own is not None and records == (own.record,)
        if mine and own is not None and to.peer_id in own.holders:
            refresh = Refresh(sender=self.me, key=key, refreshes=(RecordRefresh.of(own.record),))
            if _holds(await self._call(to.address, refresh, to.peer_id)):
                self.metrics.refreshes["sent"] += 1
                return True
            self.metrics.refreshes["refused, stored whole"] += 1
        held = _holds(
            await self._call(to.address, Store(sender=self.me, records=records), to.peer_id)
        )
        if mine and own is not None:
            if len(own.holders) >= 4 * self.config.k:  # nodes no longer among the targets
                own.holders.clear()
            (own.holders.add if held else own.holders.discard)(to.peer_id)
        return held

    async def _store_targets(self, key: bytes, n: int) -> list[PeerInfo]:
        """The ``n`` nodes nearest ``key`` to store on: a lookup's answer (one for ``n`` nodes:
        it ends once they answered), reused for ``store_lookup_reuse_s`` (members republish
        every few seconds, and the nodes nearest a key rarely change), merged with the nearest
        contacts the routing table learned since."""
        now, cfg = self.clock(), self.config
        near = self._near.get(key)
        if near is None or now - near[0] >= cfg.store_lookup_reuse_s or near[2] < n:
            closest = (await self.find_node(key, k=n)).closest[:n]
            if len(self._near) >= 64:
                self._near.pop(next(iter(self._near)))
            self._near[key] = (now, closest, n)
            return closest
        merged = {c.peer_id: c for c in self.routing.closest(key, n)}
        merged.update((c.peer_id, c) for c in near[1] if c.peer_id in self.routing)
        return sorted(merged.values(), key=lambda c: xor_distance(c.peer_id, key))[:n]

    def _store_locally(
        self, key: bytes, records: Sequence[SignedRecord], nearest: list[PeerInfo], replicas: int
    ) -> int:
        """Hold ``records`` here too when this node is among the ``replicas`` nearest ``key``."""
        near = len(nearest) < replicas or (
            xor_distance(self.peer_id, key) < xor_distance(nearest[-1].peer_id, key)
        )
        if not (self.dialable and near):
            return 0
        try:
            for rec in records:
                self.records.put(rec, self.clock())
        except RemoteProtocolError as exc:  # our own store is full
            self.metrics.failures[f"local store ({type(exc).__name__})"] += 1
            return 0
        return 1


# ── helpers ─────────────────────────────────────────────────────────────────────────────────


def _check_id(value: bytes) -> None:
    if len(value) != ID_BYTES:
        raise LocalProtocolError(f"DHT keys and targets are {ID_BYTES} bytes, got {len(value)}")


def _holds(reply: Opened | Failure) -> bool:
    """Whether a Store reply says the peer now holds the record (stored, or held already)."""
    if isinstance(reply, Failure):
        return False
    msg = reply.message
    assert isinstance(msg, StoreReply)
    return msg.accepted > 0 or (
        bool(msg.reasons) and not any(r.startswith(REFUSED) for r in msg.reasons)
    )


def _newest_per_subkey(records: Iterable[SignedRecord], now: float) -> list[SignedRecord]:
    best: dict[bytes, SignedRecord] = {}
    for rec in records:
        held = best.get(rec.subkey)
        if rec.expires_at > now and (held is None or rec.expires_at > held.expires_at):
            best[rec.subkey] = rec
    return [best[s] for s in sorted(best)]
