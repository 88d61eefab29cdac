"""A peer's presence in its swarm: joining, its member record, and the view of the members
that routing, ownership and admission read (``Presence``).

Joining (``join``): bootstrap the DHT from the initial peers (``JOIN_ATTEMPTS`` tries, backing
off), ask one of them to dial us back (reachable peers may own fragments; the others are learners
only), read the member list (which pins each member's TLS key to the address it holds, so that
what follows never runs unpinned: ``pin_members``), download every global fragment at its latest
version from its current owner (``sync``, verified against the owner's key), then publish our own
member record. Only then may the rendezvous hash hand us fragments to own.

Our record (``record_loop``): stored when it changes (within ``RECORD_CHECK_S``) or every
``ttl / 3`` (at most ``REPUBLISH_S``), in a loop of its own, so that nothing the membership loop
waits for can let it lapse, and a slow store holds up no renewal (``RecordRenewal``: the schedule
and the owners' lease, taken from the first node that takes the record). The membership loop
(``PeerNode``) reads everyone's records, follows a newer swarm manifest (``follow_manifest``:
claims checked and backed off by ``ManifestClaims``), probes disputed addresses and reconciles
the fragments we own, every ``MEMBERSHIP_PERIOD_S`` (``JOINING_PERIOD_S`` while
``wait_for_members`` waits for more: ``pause``). A member that
refuses our connections is a suspect and routed around until it republishes (``suspects``), and
so is one whose address answered with another TLS key than its pin (``_pin_mismatch``). A sealed
request from a key that is no member is admitted after one rate-limited read of the records
finds it (``authorize``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable

import torch
from aiohttp import web

from node.config import RunConfig
from node.dht.bootstrap import DialBacks, MemberListings
from node.dht.kademlia import DHTNode
from node.dht.manifest_claims import ManifestClaims
from node.dht.membership import Member, MemberRecord, Membership, manifest_hash
from node.dht.swarm import MANIFEST_PATH, SwarmCredentials
from node.diloco.flat import flat_digest
from node.peer.renewal import RecordRenewal
from node.peer.started import PeerShared
from node.state.sync import SyncFailed, sync_fragments
from node.wire.rpc import max_rpc_body
from node.wire.tls import origin
from node.wire.transport import Busy
from protocol.errors import DecodeError
from protocol.wire.membership import MAX_MANIFEST_BYTES

__all__ = [
    "JOINING_PERIOD_S",
    "MEMBERSHIP_PERIOD_S",
    "Presence",
    "ViewScope",
    "state_cap",
]

log = logging.getLogger("atoll.peer")

MEMBERSHIP_PERIOD_S = 2.0
JOINING_PERIOD_S = (
    0.5  # the membership period while fewer members are seen than wait_for_members awaits
)
RECORD_CHECK_S = 0.5  # how often our record is compared with what was last published
JOIN_ATTEMPTS = 5
SYNC_SOURCES = 4  # members asked for a fragment's latest version at join, the presumed owner first
# A sealed request from a key that is not (yet) a member makes the owner read the member records
# once before refusing: a new member is refused only until its record is found, not until the
# next membership pass. Strangers cannot turn this into load: one read per this many seconds
# at most, and a key that was looked up and not found is refused without a read for a while.
MEMBER_LOOKUP_GAP_S = 1.0
UNKNOWN_KEY_RETRY_S = 10.0
UNKNOWN_KEYS_KEPT = 4096
# Fetching the manifests members claim to hold: what a membership pass may spend on it in all
# (a member that does not answer in time is backed off like one that fails: a few silent liars
# cannot hold up the loop that reconciles the fragments we own).
CLAIMS_BUDGET_S = 5.0
# A disputed address (two members name it) is dialled at most this often, one a pass, with this
# timeout: the TLS handshake shows whose key is there. Without it, a member that claimed an
# owner's address while the owner's record had lapsed (a restart) would keep it from the owner.
PROBE_EVERY_S = 60.0
PROBE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ViewScope:
    """What a peer offers and which members it reads. ``may_own`` False: never offer to own (a
    learner only, which reads the bounded view); ``whole_view``: read every member's record even
    when not offering to own (a recipe's shards are dealt among every learner the view holds)."""

    may_own: bool = True
    whole_view: bool = False


class Presence:
    """Joining, our member record and the members' view: who is a member, who owns a fragment,
    whom we route around. ``started`` holds the DHT node, the membership and the learner once the
    peer serves; ``on_suspect`` is called when a member is newly routed around (the peer moves
    its fragments at once, not at the next membership pass)."""

    def __init__(
        self,
        cfg: RunConfig,
        shared: PeerShared,
        *,
        shapes: list[list[tuple[int, ...]]],
        credentials: SwarmCredentials | None,
        public_address: str | None,
        on_suspect: Callable[[], None],
        scope: ViewScope = ViewScope(),
    ) -> None:
        self.cfg, self.signer = cfg, shared.signer
        self.transport, self.started = shared.transport, shared.started
        self.shapes, self.credentials, self.public_address = shapes, credentials, public_address
        self.on_suspect = on_suspect
        self.may_own, self.whole_view = scope.may_own, scope.whole_view
        self.manifest = manifest_hash(cfg)
        self.reachable = False
        self.learning = True
        self.step = 0
        self.awaited_members = 0  # wait_for_members: read members often until this many are seen
        self.renewal: RecordRenewal | None = None  # made with the membership (its ttl)
        self.synced: dict[int, tuple[int, torch.Tensor]] = {}
        self.member_lookups = 0
        self._suspect_since: dict[bytes, float] = {}  # peer id -> when it failed us (wall clock)
        self._lookup_lock = asyncio.Lock()
        self._last_lookup = -math.inf
        self._unknown: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._probed: dict[str, float] = {}  # disputed address -> when we last dialled it
        self._manifest_claims = ManifestClaims()
        self._dialbacks = DialBacks()
        self._listings = MemberListings(only=cfg.swarm)

    @property
    def membership(self) -> Membership | None:
        return self.started.membership

    @property
    def dht(self) -> DHTNode | None:
        return self.started.dht

    def is_member(self, peer_id: bytes) -> bool:
        """A member whose record passed the certificate checks and that may learn (contribute)."""
        member = self.membership.members.get(peer_id) if self.membership is not None else None
        return member is not None and (member.cert is None or "learner" in member.cert.roles)

    async def authorize(self, peer_id: bytes) -> bool:
        """A member, or a key whose member record a (rate-limited) read of the DHT finds."""
        if self.is_member(peer_id):
            return True
        if self.membership is None:
            return False
        seen = self._unknown.get(peer_id)
        if seen is not None and time.monotonic() - seen < UNKNOWN_KEY_RETRY_S:
            return False
        arrived = time.monotonic()
        self.membership.want(peer_id)  # a bounded view looks it up in the read below
        async with self._lookup_lock:
            if (
                not self.is_member(peer_id)
                and time.monotonic() - self._last_lookup >= MEMBER_LOOKUP_GAP_S
            ):
                self._last_lookup = time.monotonic()
                self.member_lookups += 1
                try:  # a bounded view asks for the wanted ids alone, not the roster too
                    await self.membership.look_up()
                except Exception as exc:  # the DHT may be unreachable; the key is refused for now
                    log.warning("member lookup for %s failed: %r", peer_id.hex()[:8], exc)
        if self.is_member(peer_id):
            log.info("member %s found on lookup", peer_id.hex()[:8])
            return True
        if self._last_lookup < arrived:
            return False  # refused without a read (rate limit): not remembered as unknown
        self._unknown[peer_id] = time.monotonic()
        self._unknown.move_to_end(peer_id)
        while len(self._unknown) > UNKNOWN_KEYS_KEPT:
            self._unknown.popitem(last=False)
        return False

    def owner_of(self, p: int) -> tuple[bytes, str] | None:
        if self.membership is None:
            return None
        return self.membership.owner_of(self.cfg.swarm, p, exclude=self.suspects())

    def suspects(self) -> set[bytes]:
        """Members that refused our connections and have not republished their record since.

        A crashed owner's record lingers in the DHT until it expires; every peer that finds it
        unreachable routes around it at once instead (its fragments move by rendezvous hash).
        A record counts as republished when it was signed after we suspected the member (its
        expiry minus the records' time-to-live): copies of a dead peer's older records, which
        reach us from other responders with later expiries than the one we held, do not revive it.
        """
        assert self.membership is not None
        live, ttl = self.membership.members, self.membership.ttl_s
        return {
            pid
            for pid, since in self._suspect_since.items()
            if pid in live and live[pid].expires_at - ttl <= since
        }

    def unreachable(self, peer_id: bytes) -> None:
        if self.membership is None or peer_id == self.signer.peer_id:
            return
        member = self.membership.members.get(peer_id)
        if member is not None and peer_id not in self.suspects():
            log.warning(
                "member %s at %s refuses connections: routing around it",
                peer_id.hex()[:8],
                member.record.url,
            )
            self._suspect_since[peer_id] = time.time()
            self.membership.cadence.hurry()  # read again at once: the view is in question
            self.on_suspect()  # move its fragments now, not at the next membership pass

    def my_record(self) -> MemberRecord:
        cred = self.credentials
        may_own = self.may_own and (
            cred is None or (cred.cert is not None and "owner" in cred.cert.roles)
        )
        # an open swarm caps its roster: a member that may own offers only while it ranks in it,
        # and stands by otherwise
        capped = may_own and self.reachable and (cred is None or not cred.certified)
        if capped:
            may_own = self._ranks_in_roster()
        roles: tuple[str, ...] = ("learner",)
        if self.reachable and may_own:
            roles = ("learner", "owner")
        elif capped:
            roles = ("learner", "standby")
        url = (
            origin(self.url) if self.reachable else ""
        )  # a bare origin: others refuse anything more
        return MemberRecord(
            url=url,
            roles=roles,
            reachable=self.reachable,
            manifest=self.manifest,
            learning=self.learning,
            step=self.step,
            cert=cred.cert.encode() if cred is not None and cred.cert is not None else b"",
            manifest_version=cred.manifest.version if cred is not None else 0,
        )

    def _ranks_in_roster(self) -> bool:
        """An open swarm's roster is capped (``Membership.offers_to_own``): whether we rank
        among the members that offer to own, suspects left out."""
        ms = self.membership
        return ms is None or ms.offers_to_own(self.signer.peer_id, self.suspects())

    def scope_view(self) -> None:
        """Read every member while we offer to own (an owner needs its learners' standing),
        while ``wait_for_members`` counts them, or with ``whole_view``; else the bounded view
        (the roster, and the other members by id as they are wanted)."""
        ms = self.membership
        if ms is None:
            return
        ms.sees_all = (
            self.whole_view or self.awaited_members > 0 or "owner" in self.my_record().roles
        )
        if len(ms.members) < self.awaited_members:
            ms.cadence.hurry()  # read every pass (``pause``: JOINING_PERIOD_S) until all are seen

    @property
    def url(self) -> str:
        return self.public_address or self.transport.url

    def member_url(self, peer_id: bytes) -> str | None:
        """The address of a reachable member (None for anyone else): where holders are fetched from."""
        member = self.membership.members.get(peer_id) if self.membership is not None else None
        if self.membership is not None:  # a bounded view: looked up at the next pass, or kept
            self.membership.want(peer_id)  # renewed while pointers keep naming it
        if member is None or not member.record.url or not member.record.reachable:
            return None
        return member.record.url

    @property
    def record_published_at(self) -> float | None:
        """Monotonic time from before the newest record of ours that a node took was signed:
        the owners' lease (``RecordRenewal.stored_at``); None before any was."""
        return self.renewal.stored_at if self.renewal is not None else None

    def record_renewal(self) -> RecordRenewal:
        """Our record's schedule and lease, made with the membership (its ttl)."""
        assert self.membership is not None
        if self.renewal is None:
            self.renewal = RecordRenewal(self.membership.ttl_s)
        return self.renewal

    async def record_loop(self) -> None:
        """Keep our member record live: store it when it changes or every ``renew_s``
        (``RecordRenewal``), each store in a task of its own so that a slow one delays no renewal.

        A loop of its own: the membership loop's reads, handoffs and the merges it starts
        (``set_expected``) can take longer than the record's TTL on a loaded machine, and a
        record that lapses makes the others hand our fragments to a successor while we still
        merge them."""
        renewal = self.record_renewal()
        async with asyncio.TaskGroup() as tg:
            while True:
                record = renewal.due(self.my_record())
                if record is not None:
                    tg.create_task(self._store_record(record))
                await asyncio.sleep(RECORD_CHECK_S)

    async def _store_record(self, record: MemberRecord) -> None:
        try:
            if not await self.publish_record(record):
                log.debug("publishing our member record: no node took it")
        except Exception as exc:  # the DHT is unreachable for now: the next renewal tries again
            log.debug("publishing our member record failed: %r", exc)

    async def publish_record(self, record: MemberRecord) -> bool:
        """Store our record (``RecordRenewal.store``: the lease runs from the first node that
        takes it); whether a node did."""
        assert self.membership is not None
        return await self.record_renewal().store(record, self.membership.publish)

    async def pause(self) -> None:
        """``MEMBERSHIP_PERIOD_S``, cut to ``JOINING_PERIOD_S`` while fewer members are seen than
        ``wait_for_members`` awaits (it may start waiting while a pause is under way)."""
        assert self.membership is not None
        for _ in range(round(MEMBERSHIP_PERIOD_S / JOINING_PERIOD_S)):
            await asyncio.sleep(JOINING_PERIOD_S)
            if len(self.membership.members) < self.awaited_members:
                return

    def pin_members(self) -> None:
        """Have the transport pin each address to the key of the member that holds it: the
        membership's own pin table (``Membership.pins``), kept current by every read, so a
        member's pin is set by the read that finds it and goes with its record. A server that
        answers with another key is reported to ``_pin_mismatch``."""
        if self.membership is None:
            return
        self.transport.pins = self.membership.pins
        self.transport.on_pin_mismatch = self._pin_mismatch

    def _pin_mismatch(self, expected: bytes, got: bytes) -> None:
        """A server we dialled presented a TLS key that is not its member's: route around that
        member, as around one that refuses connections (``Membership.pin_mismatch`` hands the
        address to another claimant whose key it was)."""
        if self.membership is None:
            return
        holder = self.membership.pin_mismatch(expected, got)
        if holder is not None:
            log.warning(
                "member %s: its address answered with another TLS key (%s, not %s)",
                holder.hex()[:8],
                got.hex()[:16] or "none",
                expected.hex()[:16],
            )
            self.unreachable(holder)

    async def probe_disputes(self) -> None:
        """Dial one disputed address not dialled in the last ``PROBE_EVERY_S``: a key there that
        is not its holder's pin hands it to the claimant whose key it is (``_pin_mismatch``)."""
        if self.membership is None:
            return
        disputed, now = self.membership.disputed(), time.monotonic()
        for url in list(self._probed):
            if url not in disputed:
                del self._probed[url]
        for url in disputed:
            if now - self._probed.get(url, -PROBE_EVERY_S) < PROBE_EVERY_S:
                continue
            self._probed[url] = now
            try:  # no request byte leaves before the key is checked against the holder's pin
                async with self.transport.reply(
                    "HEAD", url + MANIFEST_PATH, timeout_s=PROBE_TIMEOUT_S
                ):
                    pass
            except Exception as exc:  # a mismatch is handled on the way (``_pin_mismatch``)
                log.info("disputed address %s: %r", url, exc)
            return

    def address_status(self) -> dict[str, int]:
        """What members' addresses and manifest claims cost us, for ``/v1/status``: reads that
        found a claim of an address another member holds, TLS keys that did not match their
        pin, addresses moved by a handshake, and manifest claims ignored, backed off, failed."""
        ms = self.membership
        counts = (
            {
                "address_disputes": ms.address_disputes,
                "pin_mismatches": ms.pin_mismatches,
                "addresses_moved": ms.addresses_moved,
                "pins": len(ms.pins),
            }
            if ms is not None
            else {}
        )
        return {**counts, **self._manifest_claims.status()}

    async def follow_manifest(self) -> None:
        """Keep the pins current, and adopt a newer swarm manifest that a member claims: claims
        within reach tried highest first, a member whose claim failed backed off
        (``ManifestClaims``); the fetch is capped, the parse runs off the loop (``parse``)."""
        self.pin_members()
        if self.credentials is None or self.membership is None:
            return
        claims, deadline = self._manifest_claims, time.monotonic() + CLAIMS_BUDGET_S
        for m in claims.candidates(
            self.membership.members.values(), self.credentials.manifest.version, time.time()
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                adopted = await self._adopt_claim(m, left)
            except Busy:  # a manifest post is being checked: not this member's fault; next pass
                return
            except Exception as exc:  # no answer, a bad manifest or signature: back this member off
                adopted, why = False, repr(exc)
            else:
                why = f"it serves no manifest newer than ours (version {self.credentials.manifest.version})"
            if adopted:
                claims.succeeded(m)
                await self.membership.refresh()  # revoked members drop out now
                return
            retry = claims.failed(m, time.time())
            log.info(
                "member %s claims manifest version %d: %s; not asked again for %.0f s and until it "
                "republishes",
                m.peer_id.hex()[:8],
                m.record.manifest_version,
                why,
                retry - time.time(),
            )

    async def _adopt_claim(self, m: Member, timeout_s: float) -> bool:
        """Fetch ``m``'s manifest (at most ``MAX_MANIFEST_BYTES``, within ``timeout_s``) and adopt
        it if newer. Raises ``Busy`` while another manifest is being parsed, anything else for a
        failure."""
        assert self.credentials is not None
        async with self.transport.reply(
            "GET", m.record.url + MANIFEST_PATH, timeout_s=timeout_s, max_reply=MAX_MANIFEST_BYTES
        ) as r:
            status, body = r.status, bytes(r.body)
        if status != 200:
            raise DecodeError(f"answered {status}")
        return self.credentials.adopt(await self.credentials.parse(body))

    async def on_dialback(self, request: web.Request) -> web.Response:
        """Ping the requester's DHT node at its own address (a joining peer asks whether it can be
        dialled); rate-limited per address, see ``DialBacks``."""
        assert self.dht is not None
        return await self._dialbacks.answer(request, self.dht)

    async def on_members(self, request: web.Request) -> web.Response:
        """This swarm's members, from a cache refreshed at most every couple of seconds; other
        swarms' names get 404 without a DHT lookup."""
        assert self.dht is not None
        return await self._listings.answer(request, self.dht)

    async def join(self, initial_peers: list[str]) -> None:
        assert self.dht is not None and self.membership is not None
        if initial_peers:
            reached = 0
            for attempt in range(JOIN_ATTEMPTS):  # a lossy network may drop the first tries
                reached = await self.dht.bootstrap(
                    [u.rstrip("/") + "/v1/dht" for u in initial_peers]
                )
                if reached:
                    break
                await asyncio.sleep(0.5 * 2**attempt)
            if not reached:
                raise ConnectionError(
                    f"none of the initial peers answered after {JOIN_ATTEMPTS} tries: "
                    f"{initial_peers}; check the addresses and that they are running"
                )
            for _ in range(3):  # each try costs a ping timeout when we really cannot be dialled
                self.reachable = await self._dialback(initial_peers)
                if self.reachable:
                    break
        else:
            self.reachable = True  # the first peer: others will reach it through its address
        # a peer that offers to own reads every member; any other the bounded view (the roster,
        # others by id), but every member while ``wait_for_members`` counts them (``scope_view``;
        # docs/scale_peers.md)
        self.membership.sees_all = True
        self.pin_members()  # before the first read: state sync below runs pinned
        await self.membership.refresh()
        if self.membership.owner_candidates():
            await self.sync()
        await self.publish_record(self.my_record())
        self.scope_view()
        await self.membership.refresh()

    async def _dialback(self, initial_peers: list[str]) -> bool:
        for base in initial_peers:
            with contextlib.suppress(Exception):
                async with self.transport.reply(
                    "GET", f"{base.rstrip('/')}/v1/dialback?url={self.url}", timeout_s=10
                ) as r:
                    status, body = r.status, bytes(r.body)
                if status == 200:
                    answer = json.loads(body)
                    return (
                        bool(answer.get("reachable"))
                        and answer.get("peer_id") == self.signer.peer_id.hex()
                    )
        return False

    async def sync(self) -> None:
        """Download every fragment's latest version from its current owner (not us).

        Which member owns a fragment now is a guess from our first read of the members: the one
        ranked first without us. With bounded loads that is not always the one that took the
        fragment while we were away (a restarted peer once synced from a member that did not
        own it, took the fragment over from its own checkpoint two versions behind, and refused
        every learner's work as ahead of it for the rest of the run). So a fragment the guess
        failed for is asked of the next-ranked members, up to ``SYNC_SOURCES`` in all; only its
        owner answers, with a version it signed itself."""
        net = self.started.net
        assert self.membership is not None and net is not None
        me, n = self.signer.peer_id, len(self.shapes)
        held = [net.latest.get(p, (0, None))[0] for p in range(n)]
        candidates = [
            self.membership.ranked(self.cfg.swarm, p, SYNC_SOURCES, exclude={me}) for p in range(n)
        ]
        got: dict[int, tuple[int, torch.Tensor]] = {}
        failed = {p: "no owner known" for p in range(n) if not candidates[p]}
        pending = [
            p for p in range(n) if candidates[p]
        ]  # then those that failed: synced or nothing newer
        for attempt in range(SYNC_SOURCES):
            sources = {p: candidates[p][attempt] for p in pending if attempt < len(candidates[p])}
            if not sources:
                break
            try:
                got.update(
                    await sync_fragments(
                        self.transport,
                        sources.get,
                        n,
                        self.shapes,
                        swarm=self.cfg.swarm,
                        held_versions=held,
                        max_size=state_cap(self.shapes),
                    )
                )
                failures: dict[int, str] = {}
            except SyncFailed as exc:
                got.update(exc.fetched)
                failures = exc.failures
            for (
                p
            ) in sources:  # its last source's answer counts: a failure, or synced / nothing newer
                if p in failures:
                    failed[p] = failures[p]
                else:
                    failed.pop(p, None)
            pending = [p for p in sources if p in failures]
        if failed:
            log.warning(
                "state sync incomplete: %d/%d fragments failed: %s",
                len(failed),
                n,
                "; ".join(f"fragment {p}: {why}" for p, why in sorted(failed.items())),
            )
        for p, (version, flat) in got.items():
            jump = net.version_jump(p, version)
            if jump is not None:
                log.warning("state sync: fragment %d refused: %s", p, jump)
                net.stats.version_jumps += 1
                continue
            net.remember(
                p, version, flat, await asyncio.to_thread(flat_digest, flat)
            )  # off the loop
            net.island.deliver(p, version, flat)
        self.synced = got

    def learner_steps(self) -> list[int]:
        """The inner step each other learning member claims in its record (read by the trainer
        thread: a copy of the view taken at once)."""
        members = dict(self.membership.members) if self.membership is not None else {}
        return [
            m.record.step
            for pid, m in members.items()
            if m.record.learning and pid != self.signer.peer_id
        ]

    def wait_for_members(self, n: int, timeout_s: float = 180.0) -> None:
        """Block (the trainer thread) until ``n`` members are visible, then one joining period
        more, so that every peer's view of the owners has settled (peers that wait for members
        read them every ``JOINING_PERIOD_S`` until they see them all). Raises ``TimeoutError``."""
        self.awaited_members = n
        deadline = time.monotonic() + timeout_s
        while self.membership is None or len(self.membership.members) < n:
            if time.monotonic() > deadline:
                seen = len(self.membership.members) if self.membership else 0
                raise TimeoutError(
                    f"only {seen} of {n} expected members joined within {timeout_s:.0f} s"
                )
            time.sleep(0.1)
        time.sleep(JOINING_PERIOD_S + 0.5)
        # then back to MEMBERSHIP_PERIOD_S: a member that leaves later must not make every
        # peer read four times as often (``pause``)
        self.awaited_members = 0


def state_cap(shapes: list[list[tuple[int, ...]]]) -> int:
    """The largest sealed fragment state a join syncs, sized from the model (``max_rpc_body`` of
    its fragments): a fixed 1 GiB let a small swarm's owner make a joiner buffer 1 GiB, and
    refused a fragment over 1 GiB (GPT-2 medium's at 1 fragment, anything past ~1.3B at 4)."""
    return max_rpc_body(sum(math.prod(shape) for shape in fragment) for fragment in shapes)
