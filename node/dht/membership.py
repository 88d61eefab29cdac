"""Swarm membership over the DHT: signed, expiring member records under the swarm's key.

Every peer publishes one record in its own subkey (its peer id; the DHT refuses a subkey signed
by anyone else): its address, its roles, whether a dial-back from another member reached it, the
swarm manifest hash it trains with, whether it is still learning, and its step. A record that
offers to own goes under the *roster*, ``key_id("atoll/<swarm>/roster")``; any other under
``key_id("atoll/<swarm>/members")``. Records expire after ``ttl_s`` unless republished, so a
crashed peer leaves the member list by itself.

Who reads what (docs/scale_peers.md). A peer that may own (``sees_all``) reads both keys whole:
it needs its learners' records. A peer that may not reads the roster whole (every candidate owner)
and only the other members it needs, by id (``want``: a holder a version pointer names, a
requester it serves; ``protocol.dht.member_lookups`` bounds how many a read and how many kept),
so its reads do not grow with the number of learners.

Owners are chosen from this list by rendezvous hash over live members that are reachable,
accept the owner role, share our recipe and carry a certificate that grants the owner role (in
open and certified swarms alike); a member that cannot be dialled is a learner only.

Addresses and TLS pins. A record's address is a claim: any member may name any host:port. Each
address is *held* by one member: the one that held it at our last read while it still claims it,
else (two claims seen at once) a candidate owner before a learner, then the lower peer id. A
member whose address another holds keeps learning, but its address is ignored (no pin, no
ownership, never dialled) and the reason is in ``refused``. ``pins`` maps each held https origin
to its holder's TLS pin, from the holder's own certificate, and loses it when the holder leaves:
a later record can never re-pin an address. Only a TLS handshake moves an address: when the key
presented there belongs to another claimant, ``pin_mismatch`` hands the address to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack

from node.config import RECIPE_FIELDS, SCHEDULE_FIELDS, SWARM_WIDE_FIELDS, RunConfig
from node.dht.kademlia import DHTNode
from node.wire.tls import origin
from protocol.dht.member_lookups import MemberLookups
from protocol.dht.member_reads import ReadCadence, RosterSeat
from protocol.dht.messages import MAX_ONLY_SUBKEYS
from protocol.dht.records import KNOWN_TAG_ID_BYTES, SignedRecord
from protocol.diloco.fragments import balanced_owners, owner_chain, owners_of
from protocol.errors import DecodeError, NotAuthorized, RemoteProtocolError
from protocol.ids import key_id
from protocol.wire.certificates import MAX_CERT_BYTES, Certificate, admit
from protocol.wire.membership import SwarmManifest, bare_origin

__all__ = [
    "Member",
    "MemberRecord",
    "Membership",
    "address_of",
    "config_from_manifest",
    "manifest_hash",
    "members_key",
    "recipe_of",
    "roster_key",
]

log = logging.getLogger(__name__)

# The fields that must agree across a swarm: the model and how it is cut, merged and weighted.
MANIFEST_FIELDS = SWARM_WIDE_FIELDS
# "standby": a member of an open swarm that may own and would offer if it ranked among the capped
# roster; members that outrank us and stand by lengthen our wait for an open place (RosterSeat)
ROLES = ("learner", "owner", "standby")


READ_QUORUM = 3  # responders whose member records are merged on a full read
# One read in this many asks READ_QUORUM responders; the others read this node's own store when
# it is among the nearest (every member stores its record there) or else one responder. Every
# responder sends every record, so three full reads every 2 s were the swarm's busiest control
# traffic (8 tiny peers: ~1.1 B/token, before reads became delta reads). A record a publisher did not store here, or a
# responder omitted, is then seen at most FULL_READ_EVERY - 1 reads late; the view never shrinks.
FULL_READ_EVERY = 4
REFUSED_KEPT = 1024
# A peer that may not own looks other members up by id: at most this many a read, this many
# records kept beyond the roster, an id not found not asked for again within this many seconds.
LOOKUPS_PER_READ = 16
LOOKED_UP_KEPT = 256
LOOKUP_RETRY_S = 5.0
# A looked-up record is renewed (as a refresh, in the reads the cadence makes due) while its
# member was wanted within this many seconds; any other lapses at its expiry.
RENEW_WANTED_S = 60.0
# Member records are stored on this many of the nodes nearest their key, not the DHT's k = 20:
# they are republished every few seconds anyway, so a copy lost with its node is back within a
# republication, and every store is one request (~860 bytes with its reply) a republication.
# READ_QUORUM + 2, so that a full read still finds its quorum with two holders gone.
MEMBER_REPLICAS = READ_QUORUM + 2
# A held record that expires within this share of its ttl is read again as a refresh (its newer
# expiry and signature, ``protocol.dht.delta_reads``); one that does not is left out unless its
# value changed. A dead member's record still leaves the view when its held copy expires.
RENEW_SHARE = 0.5
# A held record this close to expiry makes the next pass read. When a read asked for its renewal
# and did not carry it past the renewal horizon (the responder read lacks its newer copies:
# another node's view of the nearest replicas; or its member is gone), READ_QUORUM responders
# are asked, in the same pass, so a live member never drops out of the view for one responder's
# gap. A record that only aged into the guard since a read that did not need to renew it is
# renewed by one responder, as any other (nearly every read was a quorum read while both
# counted alike).
LAPSE_GUARD_S = 6.0
# The membership loop runs every 2 s, but reads the DHT only when due (``ReadCadence``): every
# READ_BASE_S while the view changes, backing off to READ_MAX_S while it does not. A dead member
# still leaves the view when its held record expires, one that refuses connections is routed
# around at once, and a read is due at once for a wanted id, a suspect or a lapsing record.
READ_BASE_S = 2.0
READ_MAX_S = 6.0  # on the 2 s passes; a record republished every 6 s keeps > LAPSE_GUARD_S
# In an open swarm at most this many members offer to own (``offers_to_own``): the roster every
# peer reads whole stays this size however many join; every other member reads the bounded
# view. Certified swarms cap it by who holds an owner certificate instead.
ROSTER_CAP = 8
# A member outside the roster takes a place that opened in it only once it stayed open this long
# (one record ttl): an owner whose record lapsed for a moment keeps its fragments.
ROSTER_GRACE_S = 20.0
# A member not offering takes a place only from a view whose newest completed read began this
# recently: twice the longest gap between reads (READ_MAX_S), so a loop that keeps time always
# may, and a starved one, whose records lapse for want of reads, does not (RosterSeat)
ROSTER_FRESH_S = 2 * READ_MAX_S
RANKED_KEPT = 1024  # ``ranked`` answers kept for one members dict (fragments x r x exclude sets)
ASSIGNMENTS_KEPT = (
    64  # owner assignments remembered (one per candidate set: the members, less each primary)
)


def recipe_of(
    cfg: RunConfig, *, schedule: bool = True
) -> tuple[tuple[str, str | int | float | bool], ...]:
    """The swarm-wide fields of ``cfg`` as a signed manifest's recipe (sorted by name), with its
    learning-rate schedule (``SCHEDULE_FIELDS``) unless ``schedule`` is false (a swarm whose
    learners bring their own optimizers, as ``node.api``'s do)."""
    names = (
        RECIPE_FIELDS if schedule else tuple(n for n in RECIPE_FIELDS if n not in SCHEDULE_FIELDS)
    )
    return tuple(sorted((name, getattr(cfg, name)) for name in names))


def config_from_manifest(
    manifest: SwarmManifest, base: RunConfig, *, keep: Collection[str] = ()
) -> RunConfig:
    """``base`` with the manifest's recipe and the swarm id as the swarm's name on the wire.
    ``keep``: schedule fields (``SCHEDULE_FIELDS``) that stay ``base``'s, whatever the recipe says
    (the ones a joiner gave on its command line); a swarm-wide field is always the recipe's.

    Raises ``ValueError`` naming a recipe field this version of Atoll does not know, or one
    whose value does not fit (the manifest is newer than this install, or was edited by hand)."""
    recipe = {
        k: v for k, v in manifest.recipe_dict.items() if not (k in keep and k in SCHEDULE_FIELDS)
    }
    unknown = sorted(set(recipe) - set(RECIPE_FIELDS))
    if unknown:
        raise ValueError(
            f"the swarm's recipe has fields this Atoll does not know: {unknown}; upgrade Atoll"
        )
    types = {f.name: type(getattr(base, f.name)) for f in dataclasses.fields(base)}
    fields: dict[str, Any] = {}
    for name, value in recipe.items():
        want = types[name]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(f"recipe field {name} = {value!r} should be {want.__name__}")
        fields[name] = value
    return dataclasses.replace(base, swarm=manifest.swarm_id, **fields)


def address_of(url: str) -> str:
    """The ``host:port`` a member's address names (http and https alike: one socket)."""
    return urlsplit(url).netloc.lower()


def members_key(swarm: str) -> bytes:
    """Where the records of members that do not offer to own are published."""
    return key_id(f"atoll/{swarm}/members")


def roster_key(swarm: str) -> bytes:
    """Where the records of members that offer to own are published (every peer reads it)."""
    return key_id(f"atoll/{swarm}/roster")


def manifest_hash(cfg: RunConfig) -> str:
    """Hex SHA-256 over the swarm-wide fields of ``cfg`` (peers must agree on it)."""
    fields = {name: getattr(cfg, name) for name in MANIFEST_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberRecord:
    """What one member says of itself (the DHT record's value); ``cert`` is its encoded Atoll
    certificate (empty for an uncertified learner of an open swarm), ``manifest_version`` the
    version of the swarm manifest it holds (a higher one is fetched from it)."""

    url: str
    roles: tuple[str, ...]
    reachable: bool
    manifest: str
    learning: bool
    step: int = 0
    cert: bytes = b""
    manifest_version: int = 0

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                self.url,
                list(self.roles),
                self.reachable,
                self.manifest,
                self.learning,
                self.step,
                self.cert,
                self.manifest_version,
            ],
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, value: bytes) -> MemberRecord:
        """Raises ``DecodeError`` for anything but a well-formed record."""
        try:
            fields = msgpack.unpackb(
                bytes(value),
                raw=False,
                strict_map_key=True,
                max_str_len=512,
                max_bin_len=MAX_CERT_BYTES,
                max_array_len=16,
                max_map_len=0,
            )
            url, roles, reachable, manifest, learning, step, cert, manifest_version = fields
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise DecodeError(f"bad member record: {exc}") from exc
        if not (
            isinstance(url, str)
            and isinstance(manifest, str)
            and type(step) is int
            and isinstance(reachable, bool)
            and isinstance(learning, bool)
            and isinstance(cert, bytes)
            and type(manifest_version) is int
            and 0 <= manifest_version < 2**63
            and isinstance(roles, list)
            and all(r in ROLES for r in roles)
        ):
            raise DecodeError("bad member record: wrong field types or unknown role")
        if url:
            try:
                bare_origin(url)
            except DecodeError as exc:
                raise DecodeError(f"bad member record: {exc.reason}") from None
        return cls(
            url=url,
            roles=tuple(roles),
            reachable=reachable,
            manifest=manifest,
            learning=learning,
            step=step,
            cert=cert,
            manifest_version=manifest_version,
        )


@dataclass(frozen=True, slots=True)
class Member:
    peer_id: bytes
    record: MemberRecord
    expires_at: float
    cert: Certificate | None = None  # checked against the manifest when the record was read
    certified_owner: bool = False  # its certificate grants the owner role (and is valid)

    @property
    def can_own(self) -> bool:
        return self._owner_capable("owner")

    @property
    def stands_by(self) -> bool:
        """It may own and would offer if it ranked in the capped roster."""
        return self._owner_capable("standby")

    def _owner_capable(self, role: str) -> bool:
        """Its certificate grants the owner role, it can be dialled, and its record says ``role``."""
        return (
            self.certified_owner
            and bool(self.record.url)
            and self.record.reachable
            and role in self.record.roles
        )

    @property
    def lab(self) -> str:
        return self.cert.lab if self.cert is not None else ""


class Membership:
    """Publishes our record and reads everyone's, through a ``DHTNode``.

    With ``swarm_manifest`` (a callable returning the current signed manifest), every record's
    certificate is checked as it is read: in a certified swarm a record without a valid one is
    refused; in an open swarm it is a learner's; only a valid certificate with the owner role
    makes a member a candidate owner. Without it (in-process tests of the DHT only) every
    reachable member that asks may own."""

    def __init__(
        self,
        dht: DHTNode,
        swarm: str,
        manifest: str,
        *,
        ttl_s: float = 20.0,
        swarm_manifest: Callable[[], SwarmManifest] | None = None,
        n_fragments: int | None = None,
    ) -> None:
        self.dht, self.swarm, self.manifest, self.ttl_s = dht, swarm, manifest, ttl_s
        self.n_fragments = (
            n_fragments  # owners by balanced_owners when given, else plain rendezvous
        )
        self._assignments: dict[tuple[str, frozenset[bytes]], tuple[bytes, ...]] = {}
        # ``ranked``'s answers for the members dict they were computed from: every pass asks
        # several times a second per fragment, and a read replaces the dict, never edits it
        self._ranked_for: dict[bytes, Member] | None = None
        self._ranked: dict[
            tuple[str, int, int, frozenset[bytes], int | None], list[tuple[bytes, str]]
        ] = {}
        self._candidates: list[bytes] | None = None  # ``owner_candidates`` of that dict
        self.swarm_manifest = swarm_manifest
        self.key = members_key(swarm)
        self.roster = roster_key(swarm)
        # True: read both keys whole (a peer that may own); False: the roster, and the other
        # members by id as they are wanted (module docstring)
        self.sees_all = True
        self.lookups = MemberLookups(
            per_read=LOOKUPS_PER_READ, kept=LOOKED_UP_KEPT, retry_s=LOOKUP_RETRY_S
        )
        # id -> set when the lookup by id asking for it has answered (``in_flight``)
        self._asking: dict[bytes, asyncio.Event] = {}
        self.cadence = ReadCadence(base_s=READ_BASE_S, max_s=READ_MAX_S)
        self.seat = RosterSeat(cap=ROSTER_CAP, grace_s=ROSTER_GRACE_S)
        self.seat_clock: Callable[[], float] = time.monotonic  # the seat's waits (tests: a fake)
        self._published_under: bytes | None = None  # the key our record was last stored under
        # replaced by each rebuild, never edited in place: ``ranked``, ``owner_candidates`` and
        # the transport's ``MemberAddresses`` remember answers for the dict they came from
        self.members: dict[bytes, Member] = {}
        self.refused: dict[
            bytes, str
        ] = {}  # peer id -> why its record is ignored (the latest REFUSED_KEPT)
        self._records: dict[
            bytes, SignedRecord
        ] = {}  # the newest record seen per member, until it expires
        # held records the last whole read did not carry past its renewal horizon (LAPSE_GUARD_S)
        self._unrenewed: set[bytes] = set()
        # roster records that expired in our view since the last quorum read: a responder (or
        # our own store) lacked their renewals, or their members are gone. The roster alone:
        # its records are the candidate owners every view must agree on, and a lapsed learner's
        # record would cost an owner a quorum read of every member's
        self._lapsed: set[bytes] = set()
        # each held record's value as last decoded (subkey -> value, record): a view is rebuilt
        # at every read from every record held, and a record's value rarely changes
        self._decoded: dict[bytes, tuple[bytes, MemberRecord]] = {}
        self._certs: dict[bytes, Certificate] = {}  # encoded certificate -> verified certificate
        self.reads = 0
        self.holders: dict[
            str, bytes
        ] = {}  # host:port -> the member that holds it (module docstring)
        self.pins: dict[
            str, bytes
        ] = {}  # https origin -> its holder's TLS pin (the transport's table)
        self.address_disputes = 0  # reads that found an address claimed by a member not holding it
        self.addresses_moved = 0  # addresses handed to another claimant by a TLS handshake
        self.pin_mismatches = 0  # servers that presented another key than their member's pin
        self._claimed: dict[bytes, Member] = {}  # the last read's members, addresses as claimed
        # monotonic time the newest completed read began: every record stored before it that
        # the read's responders held is in the view (``read_age``; an owner's publication gate)
        self.read_at: float | None = None
        self._fresh_lock = asyncio.Lock()  # callers of ``fresh`` share one read
        # reads begun and not ended (monotonic starts), and those that ended in an error, by its
        # type: a view whose reads never complete is stale whatever its cadence
        self.reads_in_flight: set[float] = set()
        self.read_errors: Counter[str] = Counter()
        self.pass_at: float | None = None  # monotonic start of the membership loop's last pass

    async def publish(self, record: MemberRecord, on_held: Callable[[], None] | None = None) -> int:
        """Store our record at the nodes nearest its key (the roster's when it offers to own, the
        members key's otherwise); return how many took it (``on_held``: called as each does)."""
        key = self.roster if "owner" in record.roles else self.key
        old, self._published_under = self._published_under, key
        value = record.encode()
        if old is not None and old != key:
            if old == self.roster:  # withdrawn: the roster's copy says so, so no reader of the
                # roster alone keeps ranking us an owner until our old record there expires
                await self.dht.store(old, value, self.ttl_s, replicas=MEMBER_REPLICAS)
            self.dht.forget(old)  # it expires there at its ttl
        return await self.dht.store(
            key, value, self.ttl_s, replicas=MEMBER_REPLICAS, on_held=on_held
        )

    def want(self, peer_id: bytes) -> None:
        """``peer_id``'s record is needed: a peer that does not see all members looks it up at
        its next read (no-op for one that does)."""
        if not self.sees_all:
            self.lookups.want(peer_id, time.time())

    def offers_to_own(self, me: bytes, exclude: Collection[bytes] = ()) -> bool:
        """Whether ``me`` may offer to own in an open swarm: fewer than ``ROSTER_CAP`` other
        candidate owners in our view (``exclude``: suspects) outrank it, and a place that opened
        in an established roster stayed open ``ROSTER_GRACE_S``, once more for each member
        standing by in our view that outranks us (``RosterSeat``)."""
        rivals = self.owner_candidates(exclude)
        # a generator: read only when a place looks open to us (``RosterSeat.decide``)
        waiting = (
            m.peer_id for m in self.members.values() if m.stands_by and m.peer_id not in exclude
        )
        fresh = self.read_age() < ROSTER_FRESH_S
        return self.seat.decide(
            self.swarm, me, rivals, self.seat_clock(), waiting=waiting, fresh=fresh
        )

    async def _read(
        self, key: bytes, full: bool, now: float, renew_before: float
    ) -> list[SignedRecord]:
        """``key``'s records: this node's own store when it is among the nearest and ``full`` is
        not asked, else a delta read by content of ``READ_QUORUM`` responders (``full``) or one:
        unchanged values are left out, and those held that expire before ``renew_before`` come
        back as refreshes (``DHTNode.get``'s ``held``)."""
        local = None if full else self.dht.held_near(key, MEMBER_REPLICAS)
        if local is not None:
            return local
        held = [r for r in self._records.values() if r.expires_at > now and r.key == key]
        return await self.dht.get(
            key, quorum=READ_QUORUM if full else 1, held=held, renew_before=renew_before
        )

    def _renew_before(self, now: float) -> float:
        return self.cadence.renew_before(
            now, share_s=RENEW_SHARE * self.ttl_s, guard_s=LAPSE_GUARD_S
        )

    async def _look_up(self, now: float, *, renewing: bool = False) -> None:
        """Read the wanted members' records by id that are not held (``MemberLookups.due``),
        and with ``renewing`` (a read the cadence made due) those held that expire before the
        next read and were wanted within ``RENEW_WANTED_S``, as refreshes naming the value held: holders are named again and again by
        pointers, and one that lapsed from the view makes the next pointer to it fall back to an
        owner. One request for all, at most ``MAX_ONLY_SUBKEYS`` ids. Then drop the looked-up
        records no longer among the most recently wanted."""
        renew_at = self._renew_before(now)
        live = {pid: r.expires_at for pid, r in self._records.items()}
        due = list(self.lookups.due(live, now))
        if renewing:
            recent = self.lookups.wanted_since(now - RENEW_WANTED_S)
            lapsing = sorted(
                (r.expires_at, pid)
                for pid, r in self._records.items()
                if r.key == self.key
                and r.expires_at < renew_at
                and pid in recent
                and pid not in due
            )
            due += [pid for _, pid in lapsing[: MAX_ONLY_SUBKEYS - len(due)]]
        if due:
            only = tuple(pid[:KNOWN_TAG_ID_BYTES] for pid in due)
            held = [self._records[pid] for pid in due if pid in self._records]
            answered = asyncio.Event()
            self._asking.update(dict.fromkeys(due, answered))
            try:
                self._merge(
                    await self.dht.get(self.key, only=only, held=held, renew_before=renew_at)
                )
            finally:
                for pid in due:
                    if self._asking.get(pid) is answered:
                        del self._asking[pid]
                answered.set()
        others = [pid for pid, r in self._records.items() if r.key != self.roster]
        for pid in self.lookups.keep(others):
            del self._records[pid]

    def _merge(self, records: list[SignedRecord]) -> None:
        for rec in records:
            held = self._records.get(rec.subkey)
            if held is None or rec.expires_at > held.expires_at:
                self._records[rec.subkey] = rec

    async def _read_whole(
        self, keys: tuple[bytes, ...], full: bool, now: float, renew_at: float
    ) -> None:
        """Read ``keys`` (``_read``), merge, and note the held records the read did not carry
        past ``renew_at`` (``_unrenewed``: a responder lacked their newer copies, or their
        members are gone)."""
        for key in keys:
            self._merge(await self._read(key, full, now, renew_at))
        self._unrenewed = {
            subkey
            for subkey, r in self._records.items()
            if r.key in keys and r.expires_at < renew_at
        }

    def _whole_keys(self) -> tuple[bytes, ...]:
        return (self.roster, self.key) if self.sees_all else (self.roster,)

    def _lapsing(self, now: float, *, unrenewed: bool = False) -> bool:
        """Whether a held record of the keys read whole is within ``LAPSE_GUARD_S`` of expiry
        (with ``unrenewed``: one the last read asked to renew and did not)."""
        keys = self._whole_keys()
        return any(
            r.key in keys
            and r.expires_at - now < LAPSE_GUARD_S
            and (not unrenewed or subkey in self._unrenewed)
            for subkey, r in self._records.items()
        )

    def _shape(self) -> frozenset[tuple[bytes, str, tuple[str, ...], bool, bool, int]]:
        """What of the view a read that changes it changes: who, and each one's address, roles,
        reachability, learning flag and manifest version (not its step: news every minute)."""
        return frozenset(
            (
                pid,
                m.record.url,
                m.record.roles,
                m.record.reachable,
                m.record.learning,
                m.record.manifest_version,
            )
            for pid, m in self.members.items()
        )

    async def in_flight(self, peer_ids: Collection[bytes]) -> bool:
        """Wait for the lookups by id in flight that ask for any of ``peer_ids`` (the membership
        loop's, say: ``MemberLookups`` asks for an id once per ``LOOKUP_RETRY_S``, so another
        lookup now would not ask for it), then rebuild the view with what they brought. Returns
        whether there was one. Unbounded: the caller puts a deadline on it."""
        waits = {id(e): e for pid in peer_ids if (e := self._asking.get(pid)) is not None}
        for answered in waits.values():
            await answered.wait()
        if waits:
            self._rebuild(time.time())
        return bool(waits)

    async def look_up(self) -> dict[bytes, Member]:
        """A member we do not know asked us for something: ``refresh`` for a view of every
        member; a bounded view reads the wanted ids alone (``want``), not the roster too."""
        if self.sees_all:
            return await self.refresh()
        now = time.time()
        await self._look_up(now)
        self._rebuild(now)
        return self.members

    def read_age(self) -> float:
        """Seconds since the newest completed read began (infinite before the first)."""
        return math.inf if self.read_at is None else time.monotonic() - self.read_at

    async def fresh(self, max_age_s: float) -> None:
        """A view read within ``max_age_s``: a quorum read (``refresh(full=True)``: a record one
        responder lacks is missed only if all ``READ_QUORUM`` lack it) unless the newest
        completed read began less than ``max_age_s`` ago. Concurrent callers share one read.
        Raises what ``refresh`` raises; bound it with a deadline."""
        async with self._fresh_lock:
            if self.read_age() >= max_age_s:
                await self.refresh(full=True)

    async def refresh_if_due(self) -> dict[bytes, Member]:
        """The membership loop's pass: ``refresh`` when a read is due (``ReadCadence``, or a
        held record lapses or lapsed); else only the wanted ids looked up and the view rebuilt from the
        records held (an expired one leaves it)."""
        now = time.time()
        self.pass_at = time.monotonic()
        if self.cadence.due(now) or self._lapsing(now) or self._lapsed:
            return await self.refresh()
        before = self._shape()
        if not self.sees_all:
            await self._look_up(now)
        self._rebuild(now)
        if self._shape() != before:
            self.cadence.hurry()
        return self.members

    async def refresh(self, *, full: bool = False) -> dict[bytes, Member]:
        """Read the member records (both keys whole, or the roster and the members wanted by
        id: ``sees_all``); keep those that decode, are live, share our manifest and pass the
        certificate checks.

        Records are merged with the records already held (the newest expiry per member wins),
        so one responder that leaves members out cannot shrink the view: records are signed, a
        responder can only omit, and an omitted member stays until its own record expires. The
        first read, every ``FULL_READ_EVERY``-th, one made while a record a read asked to
        renew and did not nears expiry (``LAPSE_GUARD_S``; asked again at once, in the same
        pass), and the next after a roster record expired in our view (``_lapsed``: a rebuild
        between reads drops it where the guard no longer sees it; the next pass reads) merge
        ``READ_QUORUM`` responders' records; the others read this node's own store when it is among the nodes nearest the swarm key
        (members publish there, ``MEMBER_REPLICAS`` of them: no request at all), else one
        responder's. Reads from responders are delta reads by content: they name the values
        held here, responders leave those out and send a refresh (expiry and signature) of
        those due within ``RENEW_SHARE`` of the ttl (``_read``). ``full`` asks for a full read
        now."""
        now, began = time.time(), time.monotonic()
        self.reads_in_flight.add(began)
        try:
            return await self._refresh(now, began, full)
        except Exception as exc:
            self.read_errors[type(exc).__name__] += 1
            raise
        finally:
            self.reads_in_flight.discard(began)

    async def _refresh(self, now: float, began: float, full: bool) -> dict[bytes, Member]:
        keys = self._whole_keys()
        full = (
            full
            or self.reads % FULL_READ_EVERY == 0
            or self._lapsing(now, unrenewed=True)
            or bool(self._lapsed)  # a record lapsed from the view: ask whether it is renewed
        )
        self.reads += 1
        before = self._shape()
        renew_at = self._renew_before(now)
        await self._read_whole(keys, full, now, renew_at)
        if not full and self._lapsing(time.time(), unrenewed=True):
            # the one responder lacked a lapsing record's newer copy: ask a quorum in this pass
            full = True
            await self._read_whole(keys, True, now, renew_at)
        if not self.sees_all:
            await self._look_up(now, renewing=True)
        self._rebuild(now)
        if full:  # what a quorum did not renew has gone: no further read for it
            self._lapsed.clear()
        self.cadence.read(time.time(), changed=self._shape() != before)
        # reads may overlap (the membership loop, a lookup, a publication): the newest start wins
        self.read_at = max(began, self.read_at if self.read_at is not None else began)
        return self.members

    def _rebuild(self, now: float) -> None:
        """The view from the records held: live, decoded, our manifest, certificates checked."""
        members: dict[bytes, Member] = {}
        for subkey, rec in list(self._records.items()):
            if rec.expires_at <= now:
                del self._records[subkey]
                if rec.key == self.roster:  # a rebuild between reads drops it unseen by the guard
                    self._lapsed.add(subkey)
                continue
            try:
                record = self._decode(rec.subkey, rec.value)
                if record.manifest != self.manifest:
                    raise NotAuthorized(
                        f"recipe {record.manifest} differs from ours {self.manifest}"
                    )
                members[rec.subkey] = self._checked(
                    rec.subkey, rec.public_key, record, rec.expires_at, now
                )
                self.refused.pop(
                    rec.subkey, None
                )  # refused before, good now (a dispute is settled below)
            except RemoteProtocolError as exc:
                self._refuse(rec.subkey, exc.reason)
        self._claimed = members
        self.members = self._settle_addresses()
        for gone in self._decoded.keys() - self._records.keys():
            del self._decoded[gone]

    def _decode(self, subkey: bytes, value: bytes) -> MemberRecord:
        """``MemberRecord.decode(value)``, remembered for ``subkey`` while its value stays the
        same (a value that fails is decoded, and fails, every time)."""
        got = self._decoded.get(subkey)
        if got is not None and got[0] == value:
            return got[1]
        record = MemberRecord.decode(value)
        self._decoded[subkey] = (bytes(value), record)
        return record

    def _settle_addresses(self) -> dict[bytes, Member]:
        """The members with each address held by one of its claimants (see the module
        docstring); the others' addresses blanked and said why in ``refused``. Sets ``pins``."""
        members = dict(self._claimed)
        claims: dict[str, list[bytes]] = {}
        for pid, m in members.items():
            if m.record.url:
                claims.setdefault(address_of(m.record.url), []).append(pid)
        holders: dict[str, bytes] = {}
        for address, pids in claims.items():
            held = self.holders.get(address)
            holder = (
                held if held in pids else min(pids, key=lambda pid: (not members[pid].can_own, pid))
            )
            holders[address] = holder
            for pid in pids:
                if pid != holder:
                    self.address_disputes += 1
                    self._refuse(
                        pid,
                        f"address {address} is held by member {holder.hex()[:16]}: "
                        "its address is ignored (it may still learn)",
                    )
                    m = members[pid]
                    members[pid] = dataclasses.replace(
                        m, record=dataclasses.replace(m.record, url="")
                    )
        self.holders = holders
        pins = {
            origin(m.record.url): m.cert.tls_pin
            for m in members.values()
            if m.cert is not None and m.record.url.startswith("https://")
        }
        self.pins.clear()  # in place: the transport may hold this very table
        self.pins.update(pins)
        return members

    def disputed(self) -> list[str]:
        """The https addresses (as their holders name them) that another certified member claims
        too: a handshake there shows whose key is really there (``pin_mismatch``)."""
        out = []
        for address, holder in self.holders.items():
            url = self.members[holder].record.url if holder in self.members else ""
            if url.startswith("https://") and any(
                pid != holder
                and m.cert is not None
                and m.record.url
                and address_of(m.record.url) == address
                for pid, m in self._claimed.items()
            ):
                out.append(url)
        return out

    def pin_mismatch(self, expected: bytes, got: bytes) -> bytes | None:
        """A server we dialled with the pin ``expected`` presented a TLS key whose pin is ``got``.
        Returns the member that holds the address pinned to ``expected`` (the one we dialled: to
        be routed around), or None when no member's does. A claimant of that address whose own
        certificate pins ``got`` has proved it is the one there: the address is handed to it."""
        held = [
            (address, pid)
            for address, pid in self.holders.items()
            if (m := self.members.get(pid)) is not None
            and m.cert is not None
            and m.cert.tls_pin == expected
        ]
        if not held:
            return None
        address, holder = held[0]
        self.pin_mismatches += 1
        proven = [
            pid
            for pid, m in self._claimed.items()
            if pid != holder
            and m.record.url
            and address_of(m.record.url) == address
            and m.cert is not None
            and m.cert.tls_pin == got
        ]
        if proven:
            log.warning(
                "address %s: the key there is member %s's, not %s's: the address is now %s's",
                address,
                proven[0].hex()[:8],
                holder.hex()[:8],
                proven[0].hex()[:8],
            )
            self.holders[address] = proven[0]
            self.addresses_moved += 1
            self.members = self._settle_addresses()
        return holder

    def _refuse(self, peer_id: bytes, reason: str) -> None:
        self.refused.pop(peer_id, None)
        self.refused[peer_id] = reason
        while len(self.refused) > REFUSED_KEPT:
            self.refused.pop(next(iter(self.refused)))

    def _checked(
        self, peer_id: bytes, public_key: bytes, record: MemberRecord, expires_at: float, now: float
    ) -> Member:
        if self.swarm_manifest is None:
            return Member(peer_id, record, expires_at, None, certified_owner=True)
        manifest = self.swarm_manifest()
        cert = None
        if record.cert:
            known = self._certs.get(record.cert)
            cert = known if known is not None else Certificate.decode(record.cert)
            admit(
                manifest,
                cert,
                public_key=public_key,
                role=None,
                now=now,
                signature_verified=known is not None,
            )
            if known is None:
                if len(self._certs) >= 4096:
                    self._certs.clear()
                self._certs[record.cert] = cert
        else:
            admit(manifest, None, public_key=public_key, role=None, now=now)
        return Member(
            peer_id,
            record,
            expires_at,
            cert,
            certified_owner=cert is not None and "owner" in cert.roles,
        )

    def _forget_answers_for_old_members(self) -> None:
        """Drop ``ranked``'s and ``owner_candidates``' answers once ``members`` was replaced."""
        if self._ranked_for is not self.members:
            self._ranked_for, self._ranked, self._candidates = self.members, {}, None

    def owner_candidates(self, exclude: Collection[bytes] = ()) -> list[bytes]:
        """The members that may own, less ``exclude``: the list is remembered for the members
        dict (as ``ranked``'s answers), the exclusion made on each call."""
        self._forget_answers_for_old_members()
        if self._candidates is None:
            self._candidates = [m.peer_id for m in self.members.values() if m.can_own]
        if not exclude:
            return list(self._candidates)
        return [pid for pid in self._candidates if pid not in exclude]

    def owner_of(
        self, swarm: str, fragment: int, *, exclude: Collection[bytes] = ()
    ) -> tuple[bytes, str] | None:
        ranked = self.ranked(swarm, fragment, 1, exclude=exclude)
        return ranked[0] if ranked else None

    def ranked(
        self, swarm: str, fragment: int, r: int, *, exclude: Collection[bytes] = ()
    ) -> list[tuple[bytes, str]]:
        """The first ``r`` candidate owners of ``fragment``: the primary, then its replicas (by
        ``balanced_owners`` when the number of fragments is known, else by rendezvous hash).
        Remembered until ``members`` is replaced (a read): replace it, never edit it in place."""
        self._forget_answers_for_old_members()
        key = (swarm, fragment, r, frozenset(exclude), self.n_fragments)
        got = self._ranked.get(key)
        if got is None:
            if len(self._ranked) >= RANKED_KEPT:  # a bound against ever-new exclude sets
                self._ranked.clear()
            got = self._ranked[key] = self._rank(swarm, fragment, r, exclude)
        return list(got)

    def _rank(
        self, swarm: str, fragment: int, r: int, exclude: Collection[bytes]
    ) -> list[tuple[bytes, str]]:
        candidates = self.owner_candidates(exclude)
        if self.n_fragments is None or not 0 <= fragment < self.n_fragments:
            chain = owners_of(swarm, fragment, candidates, r) if candidates else ()
        else:
            chain = owner_chain(fragment, candidates, r, lambda rest: self._assignment(swarm, rest))
        return [(pid, self.members[pid].record.url) for pid in chain]

    def _assignment(self, swarm: str, candidates: frozenset[bytes]) -> tuple[bytes, ...]:
        """``balanced_owners`` over ``candidates``, remembered (it hashes every fragment and member)."""
        key = (swarm, candidates)
        got = self._assignments.get(key)
        if got is None:
            assert self.n_fragments is not None
            got = self._assignments[key] = balanced_owners(swarm, self.n_fragments, candidates)
            while len(self._assignments) > ASSIGNMENTS_KEPT:
                self._assignments.pop(next(iter(self._assignments)))
        return got

    def learners(self) -> int:
        return sum(
            1 for m in self.members.values() if m.record.learning and m.expires_at > time.time()
        )
