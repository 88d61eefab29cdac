"""Kademlia routing table: k-buckets by common-prefix length, with a replacement cache.

Theory of operation (Maymounkov & Mazières, "Kademlia: A Peer-to-peer Information System Based
on the XOR Metric", IPTPS 2002, sections 2.2 and 4.1). Every peer has a 256-bit id
(``protocol.ids``) and the distance between two ids is their XOR read as an integer. A peer keeps,
for each ``i`` in ``0..255``, one *k-bucket* holding up to ``k`` contacts whose id shares exactly
``i`` leading bits with its own: bucket ``i`` covers distances in ``[2**(255-i), 2**(256-i))``.

We use these 256 fixed buckets instead of the paper's split-on-demand tree (section 4.2). Both
index the same ranges; the split tree only saves memory for the empty deep buckets, which here
cost one empty dict each. We also do not keep the paper's relaxed rule that lets the bucket of
our own id hold more than ``k`` contacts: no bucket ever holds more than ``k``.

Buckets are least-recently-seen first. When a peer is seen and its bucket has room it goes in at
the tail. When the bucket is full the newcomer goes to the bucket's replacement cache and the
table *asks* for a ping of the oldest contact by returning ``PingCandidate``; it never pings by
itself. The node answers with ``on_ping_result``: a live oldest contact moves to the tail and the
newcomer stays cached (old, long-lived peers are preferred, which resists flooding); a dead one is
evicted and the freshest cached contact takes its place. ``on_failed`` counts RPC failures and
evicts after ``max_failures`` of them, promoting from the cache the same way.

Contacts are ``protocol.wire.messages.PeerInfo`` (peer id, address), as they travel on the wire.
Call ``on_seen`` only for peers that sent us a verified message or answered one of ours, never
for contacts merely listed in someone's reply: those are unproven and belong in a lookup. Peers
without an address (behind NAT, learners only) can never be dialled and are not added.

IP diversity (S/Kademlia; libp2p's diversity filter): a bucket holds at most ``max_per_group``
contacts from one network, an IPv4 /24 or an IPv6 /48 (``protocol.dht.netgroups``), so an
attacker with a few networks cannot fill the buckets near a key it wants to eclipse (the swarm's
members key) however many ids it grinds. A newcomer from a full group is refused (counted in
``diversity_refused``), not cached; a cached contact is promoted only into room its group has.
Non-global addresses (loopback, private) have no group: a local swarm shares one address.

Buckets are refreshed (section 2.3) by looking up a random id in any bucket that saw no traffic
for ``refresh_interval``; ``stale_buckets`` picks those ids with the node's seeded ``rng``.

A request's ``sender`` names an address nobody has checked: a peer that answered one of *our*
calls is proven at the address we dialled, one that merely wrote an address into its request is
not (it could name a dead port, or a stranger's server, to fill our buckets with junk). The node
puts such a claim in a ``ClaimQueue`` and calls ``on_seen`` only once a ping to the claimed address
came back signed by the claimed peer id. The queue is sans-IO like the table: bounded, fair
between the sources (IPs) that make claims, at most one claim per peer id and per address,
paced by a token bucket and a cap on pings in flight, and it remembers addresses that did not
answer so that a flood naming one address costs one ping per ``retry_after_s``.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from protocol.dht.netgroups import diversity_group
from protocol.dht.ratelimit import TokenBucket
from protocol.errors import LocalProtocolError
from protocol.ids import ID_BYTES, xor_distance
from protocol.wire.messages import PeerInfo

__all__ = ["ID_BITS", "ClaimQueue", "ClaimResult", "PingCandidate", "RoutingTable"]

ID_BITS = 8 * ID_BYTES


@dataclass(frozen=True, slots=True)
class PingCandidate:
    """The table asks the node to ping ``oldest``; ``candidate`` waits in the replacement cache."""

    oldest: PeerInfo
    candidate: PeerInfo


@dataclass(slots=True)
class _Entry:
    contact: PeerInfo
    last_seen: float
    failures: int = 0


@dataclass(slots=True)
class _Bucket:
    entries: OrderedDict[bytes, _Entry] = field(default_factory=OrderedDict)  # oldest first
    cache: OrderedDict[bytes, _Entry] = field(default_factory=OrderedDict)  # freshest last
    last_touched: float = float("-inf")


class RoutingTable:
    """The k-buckets of the peer ``own_id``. See the module docstring."""

    def __init__(
        self,
        own_id: bytes,
        *,
        k: int = 20,
        replacement_cache: int = 10,
        max_failures: int = 3,
        max_per_group: int | None = 2,
    ) -> None:
        if len(own_id) != ID_BYTES:
            raise LocalProtocolError(f"own id must be {ID_BYTES} bytes, got {len(own_id)}")
        if (
            k < 1
            or replacement_cache < 0
            or max_failures < 1
            or (max_per_group is not None and max_per_group < 1)
        ):
            raise LocalProtocolError(
                f"need k >= 1, replacement_cache >= 0, max_failures >= 1, max_per_group >= 1 or None; "
                f"got {k}, {replacement_cache}, {max_failures}, {max_per_group}"
            )
        self.max_per_group = max_per_group
        self.diversity_refused = (
            0  # newcomers refused: their network's share of the bucket was full
        )
        self.own_id = own_id
        self.k = k
        self.replacement_cache = replacement_cache
        self.max_failures = max_failures
        self._buckets = [_Bucket() for _ in range(ID_BITS)]
        self._pending: dict[bytes, int] = {}  # peer id we asked the node to ping -> bucket index
        self._index: dict[bytes, PeerInfo] = {}  # every contact in a bucket, for closest()

    # ── queries ─────────────────────────────────────────────────────────────────────────────

    def bucket_index(self, peer_id: bytes) -> int:
        """Common-prefix length of ``peer_id`` with our id (0..255). Raises for our own id."""
        d = xor_distance(self.own_id, peer_id)
        if d == 0:
            raise LocalProtocolError("our own id has no bucket")
        return ID_BITS - d.bit_length()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._index

    def get(self, peer_id: bytes) -> PeerInfo | None:
        """The contact for ``peer_id`` if it is in a bucket (not the replacement cache)."""
        return self._index.get(peer_id)

    def contacts(self) -> list[PeerInfo]:
        """Every contact in the buckets, nearest bucket last, oldest first within a bucket."""
        return [e.contact for b in self._buckets for e in b.entries.values()]

    def bucket_sizes(self) -> dict[int, int]:
        """Non-empty buckets: common-prefix length -> number of contacts."""
        return {i: len(b.entries) for i, b in enumerate(self._buckets) if b.entries}

    def holds(self, contact: PeerInfo) -> bool:
        """Whether ``contact``, this very id at this very address, is in a bucket or a cache."""
        bucket = self._bucket_of(contact.peer_id)
        if bucket is None:
            return False
        entry = bucket.entries.get(contact.peer_id) or bucket.cache.get(contact.peer_id)
        return entry is not None and entry.contact == contact

    def cached(self, peer_id: bytes) -> bool:
        """Whether ``peer_id`` waits in a replacement cache."""
        bucket = self._bucket_of(peer_id)
        return bucket is not None and peer_id in bucket.cache

    def closest(self, target: bytes, n: int | None = None) -> list[PeerInfo]:
        """The ``n`` (default ``k``) known contacts nearest ``target`` by XOR, nearest first."""
        if len(target) != ID_BYTES:
            raise LocalProtocolError(f"target must be {ID_BYTES} bytes, got {len(target)}")
        t = int.from_bytes(target, "big")
        return heapq.nsmallest(
            self.k if n is None else n,
            self._index.values(),
            key=lambda c: t ^ int.from_bytes(c.peer_id, "big"),
        )

    # ── events ──────────────────────────────────────────────────────────────────────────────

    def on_seen(self, contact: PeerInfo, now: float) -> PingCandidate | None:
        """A verified message came from ``contact``; asks for a ping if its bucket is full."""
        if contact.peer_id == self.own_id or not contact.address:
            return None
        i = self.bucket_index(contact.peer_id)
        bucket = self._buckets[i]
        bucket.last_touched = now
        entry = bucket.entries.get(contact.peer_id)
        if entry is not None:
            if contact.address == entry.contact.address or self._group_has_room(
                bucket, contact, contact.peer_id
            ):
                entry.contact = contact  # a move into a full network keeps the old address
                self._index[contact.peer_id] = contact
            entry.last_seen, entry.failures = now, 0
            bucket.entries.move_to_end(contact.peer_id)
            return None
        if not self._group_has_room(bucket, contact):
            self.diversity_refused += 1
            bucket.cache.pop(contact.peer_id, None)
            return None
        if len(bucket.entries) < self.k:
            bucket.cache.pop(contact.peer_id, None)
            bucket.entries[contact.peer_id] = _Entry(contact, now)
            self._index[contact.peer_id] = contact
            return None
        self._cache(bucket, _Entry(contact, now))
        if i in self._pending.values():
            return None
        oldest = next(iter(bucket.entries.values())).contact
        self._pending[oldest.peer_id] = i
        return PingCandidate(oldest=oldest, candidate=contact)

    def on_ping_result(self, peer_id: bytes, alive: bool, now: float) -> PeerInfo | None:
        """The ping asked for by ``PingCandidate`` finished; returns the contact promoted, if any.

        Raises ``LocalProtocolError`` if no ping of ``peer_id`` was asked for.
        """
        i = self._pending.pop(peer_id, None)
        if i is None:
            raise LocalProtocolError(f"no ping of {peer_id.hex()[:16]} was requested")
        bucket = self._buckets[i]
        entry = bucket.entries.get(peer_id)
        if entry is None:  # removed meanwhile (on_failed); its slot was already refilled
            return None
        if alive:
            entry.last_seen, entry.failures = now, 0
            bucket.entries.move_to_end(peer_id)
            return None
        return self._evict(bucket, peer_id)

    def on_failed(self, peer_id: bytes, now: float) -> PeerInfo | None:
        """An RPC to ``peer_id`` failed; evicts it after ``max_failures``. Returns the promoted."""
        bucket = self._bucket_of(peer_id)
        if bucket is None:
            return None
        bucket.cache.pop(peer_id, None)
        entry = bucket.entries.get(peer_id)
        if entry is None:
            return None
        entry.failures += 1
        if entry.failures < self.max_failures:
            return None
        return self._evict(bucket, peer_id)

    def touch(self, target: bytes, now: float) -> None:
        """A lookup of ``target`` ran now: its bucket needs no refresh for a while."""
        if target != self.own_id:
            self._buckets[self.bucket_index(target)].last_touched = now

    def stale_buckets(self, now: float, refresh_interval: float, rng: random.Random) -> list[bytes]:
        """Random ids to look up, one per bucket untouched for ``refresh_interval``.

        Only buckets up to the deepest non-empty one are considered (deeper ones are empty because
        no such peers exist, not for lack of refresh). The buckets returned count as touched now.
        """
        deepest = max(self.bucket_sizes(), default=-1)
        targets = []
        for i in range(deepest + 1):
            bucket = self._buckets[i]
            if now - bucket.last_touched >= refresh_interval:
                bucket.last_touched = now
                targets.append(self.random_id_in_bucket(i, rng))
        return targets

    def random_id_in_bucket(self, i: int, rng: random.Random) -> bytes:
        """A uniformly random id sharing exactly ``i`` leading bits with ours."""
        if not 0 <= i < ID_BITS:
            raise LocalProtocolError(f"bucket index must be in 0..{ID_BITS - 1}, got {i}")
        own = int.from_bytes(self.own_id, "big")
        low = ID_BITS - 1 - i  # the bit that must differ
        mask = (1 << low) - 1
        value = ((own ^ (1 << low)) & ~mask) | (rng.getrandbits(ID_BITS) & mask)
        return value.to_bytes(ID_BYTES, "big")

    # ── internals ───────────────────────────────────────────────────────────────────────────

    def _bucket_of(self, peer_id: bytes) -> _Bucket | None:
        if len(peer_id) != ID_BYTES or peer_id == self.own_id:
            return None
        return self._buckets[self.bucket_index(peer_id)]

    def _group_has_room(
        self, bucket: _Bucket, contact: PeerInfo, leaving: bytes | None = None
    ) -> bool:
        """Whether ``contact``'s network has fewer than ``max_per_group`` contacts in ``bucket``
        (not counting ``leaving``)."""
        group = diversity_group(contact.address) if self.max_per_group is not None else None
        if group is None or self.max_per_group is None:
            return True
        same = sum(
            1
            for pid, e in bucket.entries.items()
            if pid != leaving and diversity_group(e.contact.address) == group
        )
        return same < self.max_per_group

    def _cache(self, bucket: _Bucket, entry: _Entry) -> None:
        if self.replacement_cache == 0:
            return
        bucket.cache.pop(entry.contact.peer_id, None)
        bucket.cache[entry.contact.peer_id] = entry
        while len(bucket.cache) > self.replacement_cache:
            bucket.cache.popitem(last=False)

    def _evict(self, bucket: _Bucket, peer_id: bytes) -> PeerInfo | None:
        del bucket.entries[peer_id]
        del self._index[peer_id]
        # the freshest cached contact whose network has room (diversity holds after promotion)
        pid = next(
            (
                p
                for p in reversed(bucket.cache)
                if self._group_has_room(bucket, bucket.cache[p].contact)
            ),
            None,
        )
        if pid is None:
            return None
        fresh = bucket.cache.pop(pid)
        fresh.failures = 0
        bucket.entries[fresh.contact.peer_id] = fresh
        self._index[fresh.contact.peer_id] = fresh.contact
        return fresh.contact


# ── claimed addresses, waiting for our ping ────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What became of a claim: ``kind`` is "queued" (a ping will follow), "ignored" (a duplicate,
    no address, or an address that did not answer lately) or "dropped" (the queue is full)."""

    kind: str
    reason: str

    @property
    def queued(self) -> bool:
        return self.kind == "queued"


class ClaimQueue:
    """Contacts that claimed an address in a request, waiting for a ping. See the module doc."""

    def __init__(
        self,
        *,
        max_pending: int = 64,
        rate: float = 10.0,
        burst: float = 50.0,
        max_in_flight: int = 8,
        retry_after_s: float = 60.0,
        max_remembered: int = 4096,
    ) -> None:
        if min(max_pending, max_in_flight, max_remembered) < 1 or retry_after_s < 0:
            raise LocalProtocolError("claim queue caps must be positive")
        self.max_pending, self.max_in_flight = max_pending, max_in_flight
        self.retry_after_s, self.max_remembered = retry_after_s, max_remembered
        self._tokens = TokenBucket(rate, burst)
        self._pending: OrderedDict[bytes, tuple[PeerInfo, str]] = OrderedDict()  # oldest first
        self._in_flight: dict[bytes, PeerInfo] = {}
        self._failed: OrderedDict[str, float] = OrderedDict()  # address -> when it did not answer

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def offer(self, contact: PeerInfo, source: str, now: float) -> ClaimResult:
        """``contact``, in a request from ``source`` (an IP), claims its address."""
        pid, address = contact.peer_id, contact.address
        if not address:
            return ClaimResult("ignored", "no address")
        if pid in self._in_flight:
            return ClaimResult("ignored", "a ping of this peer is in flight")
        failed_at = self._failed.get(address)
        if failed_at is not None and now - failed_at < self.retry_after_s:
            return ClaimResult("ignored", f"{address} did not answer {now - failed_at:.0f}s ago")
        if pid in self._pending:
            self._pending[pid] = (contact, source)
            return ClaimResult("queued", "already waiting; address updated")
        if self._address_taken(address):
            return ClaimResult("ignored", f"{address} is already waiting or being pinged")
        reason = f"waits behind {len(self._pending)}"
        if len(self._pending) >= self.max_pending:
            victim = self._fair_victim(source)
            if victim is None:
                return ClaimResult("dropped", f"{len(self._pending)}/{self.max_pending} wait")
            del self._pending[victim]
            reason = "replaced the newest claim of a source with more of them"
        self._pending[pid] = (contact, source)
        return ClaimResult("queued", reason)

    def next(self, now: float) -> PeerInfo | None:
        """The contact to ping now, if one waits, a ping slot is free and a token is there."""
        if not self._pending or len(self._in_flight) >= self.max_in_flight:
            return None
        if not self._tokens.allow(now):
            return None
        _, (contact, _) = self._pending.popitem(last=False)
        self._in_flight[contact.peer_id] = contact
        return contact

    def wait_s(self, now: float) -> float | None:
        """Seconds until ``next`` can give a contact; None while none waits or no slot is free."""
        if not self._pending or len(self._in_flight) >= self.max_in_flight:
            return None
        return self._tokens.wait_s(now)

    def done(self, contact: PeerInfo, answered: bool, now: float) -> None:
        """The ping of ``contact`` came back (``answered``) or failed.

        Raises ``LocalProtocolError`` if ``next`` did not hand out ``contact``.
        """
        if self._in_flight.get(contact.peer_id) != contact:
            raise LocalProtocolError(f"no ping of {contact.peer_id.hex()[:16]} is in flight")
        del self._in_flight[contact.peer_id]
        if answered:
            self._failed.pop(contact.address, None)
            return
        self._failed.pop(contact.address, None)
        self._failed[contact.address] = now
        while len(self._failed) > self.max_remembered:
            self._failed.popitem(last=False)

    def _address_taken(self, address: str) -> bool:
        return any(c.address == address for c in self._in_flight.values()) or any(
            c.address == address for c, _ in self._pending.values()
        )

    def _fair_victim(self, source: str) -> bytes | None:
        """The newest claim of the source with the most claims, if it has more than ``source``."""
        counts = Counter(src for _, src in self._pending.values())
        heavy, n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        if n <= counts[source] + 1:
            return None
        return next(pid for pid in reversed(self._pending) if self._pending[pid][1] == heavy)
