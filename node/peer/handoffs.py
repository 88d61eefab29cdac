"""An owner's handoffs (``Handoffs``): replicating each version before it is published, handing
a retiring owner's state on, taking handoffs in, and the fencing rules that keep a version to one
content while members' views differ (``protocol.diloco.replica`` judges).

``Handoffs`` reads the fragments this peer owns (``Ownership`` owns them, and reacts to what a
handoff taken in means for them: ``TakenIn``) and the members' view (``MemberView``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from node.config import RunConfig
from node.dht.membership import Membership
from node.diloco.owner import FragmentOwner
from node.diloco.replica import (
    NOT_A_MEMBER,
    BaseNotHeld,
    Handed,
    NotAMemberThere,
    ReplicaStore,
    encode_state,
    hand_over,
    handed_from,
)
from node.peer.started import PeerShared
from node.peer.view import MemberView
from protocol.diloco.replica import MAX_EPOCH, Admission, HandoffView, admit
from protocol.errors import DecodeError
from protocol.wire.messages import ReplicaAck, ReplicaState
from protocol.wire.signing import Opened, ReplayWindow

__all__ = [
    "CATCH_UP_SOURCES",
    "REPLICAS",
    "VIEW_FRESH_S",
    "Handoffs",
    "Lapsed",
    "TakenIn",
    "supersedes",
]

log = logging.getLogger("atoll.peer")

CATCH_UP_SOURCES = 3  # members a new owner asks for its predecessor's newer versions, in turn
REPLICAS = 1  # replicas per fragment beside its owner (r = 2): each holds the owner's last state
MAX_EPOCH_BUMPS = 3  # per handoff: stale fences passed by adopting an epoch above them
LEASE_MARGIN_S = (
    2.0  # an owner stops publishing this long before its member record may expire (clock skew)
)
# A version made while our lease is lapsed, before anything was handed on, waits this long for
# our record to be stored again: nothing of it has left this peer, so holding it is safe, and
# dropping it lost the round's work (one H of every learner's steps; 32 peers at load ~50)
LEASE_WAIT_S = 20.0
LEASE_POLL_S = 0.25
# An owner publishes only from a view of the members whose read began less than this long before
# (one is awaited first when the last is older, within the same time). A better-ranked member
# whose record that read missed took the fragment after it, and merges nothing for CATCH_UP_S
# (6 s, ``node.peer.ownership``) while it fetches our versions: what we publish comes before its
# first merge, with 2 s (its catch-up polls: 1 s long-polls, 0.5 s apart) to fetch it.
VIEW_FRESH_S = 4.0


class _FencedBy(Exception):
    """A replica refused a handoff because another owner has taken the fragment over."""

    def __init__(self, ack: ReplicaAck) -> None:
        super().__init__(ack.reason)
        self.ack = ack


def supersedes(msg: ReplicaState, own: FragmentOwner) -> bool:
    """Whether a handoff comes from an owner above ``own`` in both epoch and version: one that
    took the fragment over after ``own`` did and has published past it (``own`` is the stale one)."""
    return msg.epoch > own.epoch and msg.version > own.version


@dataclass(frozen=True, slots=True)
class Lapsed:
    """A version a replica took that was not published because our lease had lapsed by then (or
    no read of the members came in time: ``VIEW_FRESH_S``): its state and the replica that holds it. Once our record is stored again, the owner resumes
    from it if that replica takes it again under the new owner's epoch (``Handoffs.resume``)."""

    state: ReplicaState
    replica: tuple[bytes, str]


@dataclass(frozen=True, slots=True)
class TakenIn:
    """A handoff judged and offered to the replica store: its answer, the state as admitted,
    and the sender's address (for what the owner of the fragment does next)."""

    ack: ReplicaAck
    state: ReplicaState
    url: str


class Handoffs:
    """Replication, handoffs and fencing of the fragments a peer owns. ``owners`` and
    ``last_owner`` (per fragment, the owner the last ownership pass saw) are read, never written;
    ``on_taken`` hears of every handoff taken (the peer announces it under a launcher)."""

    def __init__(
        self,
        cfg: RunConfig,
        shared: PeerShared,
        view: MemberView,
        replicas: ReplicaStore,
        *,
        owners: Mapping[int, FragmentOwner],
        last_owner: Mapping[int, bytes],
        on_taken: Callable[[int, int, bytes], None],
    ) -> None:
        self.cfg, self.signer = cfg, shared.signer
        self.transport, self.started = shared.transport, shared.started
        self.view, self.replicas, self.owners, self.last_owner = view, replicas, owners, last_owner
        self.on_taken = on_taken
        self.unreplicated = 0  # versions published with no replica reachable
        self.replica_bytes = (
            0  # tensor bytes handed to replicas (an owner's upload besides versions)
        )
        self.replica_took: dict[int, tuple[int, bytes]] = {}  # fragment -> (version, replica)
        self.lease_lapses = 0  # versions not published: our record may have expired elsewhere
        self.claimant_fences = 0  # versions not published: the view named another owner by then
        self.stale_view_fences = 0  # versions not published: no read of the members recent enough
        self.view_reads = 0  # reads of the members a publication awaited (the last was too old)
        # per fragment fenced by a lapsed lease: the version its replica took meanwhile (None: none)
        self.lapsed: dict[int, Lapsed | None] = {}
        self.resumed = 0  # owners that resumed from the version their replica took meanwhile
        self._replica_replay = ReplayWindow()
        self._passed_on: set[tuple[int, bytes, int]] = set()  # (fragment, peer, version) handed on

    @property
    def membership(self) -> Membership | None:
        return self.started.membership

    async def hand_on(self, p: int, target: tuple[bytes, str], state: ReplicaState) -> None:
        """A retiring owner's handoff to its successor: best effort, never fatal to the node.

        A successor whose fence ends at an older version than ours (an epoch it took while it
        owned the fragment briefly from an older version, e.g. during its join, and published
        nothing above) is handed the state again under that epoch, as ``_above_stale_fence``
        does for replication: refusing it lost the newest version, and a successor that never
        held it then owned the fragment from its old version, refusing every learner's work
        as ahead of it."""
        for _ in range(MAX_EPOCH_BUMPS + 1):
            try:
                # by reference first: the successor holds our version when it was our replica
                # (or its learner fetched it); the whole state follows when it does not
                if not (await self._hand_by_reference(p, target, state)):
                    await self._hand_to(p, target, state)
                return
            except NotAMemberThere:
                return  # the successor does not see us: it starts from the newest version it holds
            except _FencedBy as exc:
                ack = exc.ack
                if not (ack.epoch > state.epoch and 0 <= ack.version < state.version):
                    # the successor has moved on already: our state is old news
                    log.info(
                        "fragment %d: successor did not need version %d: %s", p, state.version, exc
                    )
                    return
                log.info(
                    "fragment %d: the successor's fence at epoch %d ends at version %d, behind our %d: "
                    "handing it on under epoch %d",
                    p,
                    ack.epoch,
                    ack.version,
                    state.version,
                    ack.epoch,
                )
                state = dataclasses.replace(state, epoch=ack.epoch)

    def final_declared(self, owner: FragmentOwner) -> None:
        """``owner`` has just handed its latest version out as final: tell the fragment's replica
        (by reference when it holds that version), so that should this owner die within the hold,
        the replica taking over holds the version final too and merges no late work into it."""
        if self.started.tg is None or self.membership is None:
            return
        p = owner.fragment.index
        ranked = self.membership.ranked(
            self.cfg.swarm, p, REPLICAS, exclude={self.signer.peer_id} | self.view.suspects()
        )
        if ranked:
            self.started.tg.create_task(self.hand_on(p, ranked[0], owner.snapshot()))

    async def _hand_by_reference(
        self, p: int, target: tuple[bytes, str], state: ReplicaState
    ) -> bool:
        """Hand ``state`` as a reference to the version and digest the target may hold already
        (no tensors); whether it took it. Only a whole state without momentum can go so."""
        if state.base_version >= 0 or state.momentum:
            return False
        reference = dataclasses.replace(
            state, theta=(), base_version=state.version, base_digest=state.digest
        )
        return await self._hand_to(p, target, reference)

    async def _hand_to(
        self,
        p: int,
        target: tuple[bytes, str],
        state: ReplicaState,
        theta_digest: bytes | None = None,
    ) -> bool:
        """Hand ``state`` to ``target``; whether it took it (failures are logged, not raised, but
        ``NotAMemberThere`` and a fenced refusal, ``_FencedBy``). ``theta_digest``: see ``hand_over``."""
        self.replica_bytes += sum(
            len(t.data) + len(t.scales) for t in (*state.theta, *state.momentum)
        )
        try:
            ack = await hand_over(
                self.transport,
                self.signer,
                target,
                state,
                self._replica_replay,
                blobs_digest=theta_digest,
            )
        except aiohttp.ClientConnectorError:
            self.view.unreachable(target[0])
            return False
        except NotAMemberThere as exc:  # not a failure to route around: the caller decides
            log.info(
                "fragment %d: %s refused version %d: %s", p, target[1], state.version, exc.reason
            )
            raise
        except Exception as exc:  # the replica may be busy, new or gone: the caller tries another
            log.info(
                "fragment %d: handoff of version %d to %s failed: %r",
                p,
                state.version,
                target[1],
                exc,
            )
            return False
        if not ack.accepted:
            log.info(
                "fragment %d: %s refused version %d: %s", p, target[1], state.version, ack.reason
            )
            # a fence names what stands above us: a higher epoch (one we may take: an owner bumps
            # its own above it), or this version (or a later one) held here; a "fenced" answer
            # claiming neither fences nothing, and is routed around
            if ack.reason.startswith("fenced") and (
                state.epoch < ack.epoch <= MAX_EPOCH or ack.version >= state.version
            ):
                raise _FencedBy(ack)
        return ack.accepted

    async def replicate(
        self,
        p: int,
        state: ReplicaState,
        update: ReplicaState | None = None,
        theta_digest: bytes | None = None,
    ) -> str | None:
        """Before publishing: hand the version's whole state to the fragment's replica (the next
        member by rendezvous hash; a replica that cannot be reached is routed around and the
        next one tried). None when one took it, or none is left (counted); the reason when a
        replica says another owner has taken over. ``update``: the same state as an update over
        the version before, sent first: the replica applies it over that version as it took it
        from us or as its own learner holds it (the whole state follows if it holds neither).
        ``theta_digest``: the BLAKE3 of ``state``'s tensor bytes, known from its seal (not hashed again)."""
        assert self.membership is not None
        if not await self._lease_back():
            lapsed = self._record_lapsed(p)
            if lapsed is not None:
                self.lapsed[p] = None
                return lapsed
        held = self.replicas.held.get(p)
        if held is not None and held.version >= state.version and held.digest != state.digest:
            # our predecessor handed us this version while we merged ours: its content stands
            return (
                f"fenced: fragment {p} version {held.version} was handed to this peer by the previous "
                f"owner while it merged its own"
            )
        tried: set[bytes] = {self.signer.peer_id}
        bumps = 0
        while True:
            ranked = self.membership.ranked(
                self.cfg.swarm, p, REPLICAS, exclude=tried | self.view.suspects()
            )
            if not ranked:
                self.unreplicated += 1
                return await self._publication_gate(p, state.version, None)
            try:
                # the update first: the replica holds its base if it took the version before from
                # us, and its learner does once it has fetched that version (the whole state
                # follows when it has neither)
                if (
                    update is not None
                    and await self._hand_to(p, ranked[0], update)
                    or await self._hand_to(p, ranked[0], state, theta_digest)
                ):
                    self.replica_took[p] = (
                        state.version,
                        ranked[0][0],
                    )  # its learner needs no download
                    return await self._publication_gate(p, state.version, Lapsed(state, ranked[0]))
            except _FencedBy as exc:
                bumped = (
                    self._above_stale_fence(p, state, exc.ack) if bumps < MAX_EPOCH_BUMPS else None
                )
                if bumped is None:
                    return str(exc)
                state, bumps = bumped, bumps + 1
                continue
            except NotAMemberThere:
                # an unreachable replica may be dead, but this one is alive and routes around us:
                # the fragment may have another owner in its view, publishing this version number
                # (and a peer further down the list, which has not seen that owner, would take it)
                return (
                    f"fenced: the replica {ranked[0][1]} of fragment {p} refused version {state.version}: "
                    "this peer is not a member in its view"
                )
            tried.add(ranked[0][0])

    async def _publication_gate(self, p: int, version: int, taken: Lapsed | None) -> str | None:
        """``_may_publish``, from a view read less than ``VIEW_FRESH_S`` ago: a starved loop's
        last read may predate a better-ranked member's record, and then its view still names us
        (a 32-peer run at load ~8.6 published a version with two contents so)."""
        await self._freshen_view()
        return self._may_publish(p, version, taken)

    async def _freshen_view(self) -> None:
        """Read the members when the last read began ``VIEW_FRESH_S`` ago or more, within as
        long (owners publishing at once share the read: ``Membership.fresh``). A read that fails
        or comes too late is not raised: ``_may_publish`` measures the view's age and fences."""
        ms = self.membership
        if ms is None or ms.read_age() < VIEW_FRESH_S:
            return
        self.view_reads += 1
        try:
            async with asyncio.timeout(VIEW_FRESH_S):
                await ms.fresh(VIEW_FRESH_S)
        except Exception as exc:  # the DHT unreachable or slow: the age decides below
            log.info(
                "no read of the members within %g s before a publication: %r", VIEW_FRESH_S, exc
            )

    def _may_publish(self, p: int, version: int, taken: Lapsed | None) -> str | None:
        """Why ``version`` of ``p``, which a replica has just taken (``taken``: the state and that
        replica; None: no replica was left), must not be published after all (None: it may). The
        handoff awaited the network, and a starved loop may have run seconds late: the lease is
        measured again (a lapse keeps ``taken`` to resume from: ``resume``), and the view must
        still name us ``p``'s owner (a better-ranked member that entered the roster meanwhile
        publishes this version itself) from a read begun less than ``VIEW_FRESH_S`` ago
        (``_publication_gate`` awaits one). The owner publishes on the same loop turn, with no
        await in between."""
        lapsed = self._record_lapsed(p)
        if lapsed is not None:
            self.lapsed[p] = taken
            return lapsed
        owner = self.view.owner_of(p)
        if owner is not None and owner[0] != self.signer.peer_id:
            self.claimant_fences += 1
            return (
                f"fenced: this peer's view now names {owner[1]} as fragment {p}'s owner; "
                f"version {version} is not published here"
            )
        age = self.membership.read_age() if self.membership is not None else 0.0
        if age >= VIEW_FRESH_S:
            self.stale_view_fences += 1
            # as after a lapsed lease: own again from the version the replica took once a read
            # still names us (``resume``), not from the one before, whose next merge would make
            # this version number with another content, which the replica refuses (32 peers at
            # load ~38: fragment 1 went 295 s without a version so)
            self.lapsed[p] = taken
            return (
                f"fenced: this peer's view of the members was last read {age:.1f} s ago and no "
                f"read came within {VIEW_FRESH_S:g} s: a better-ranked member it missed may "
                f"publish fragment {p}'s version {version}; not published here"
            )
        return None

    def lease_live(self) -> bool:
        """Whether our member record was stored recently enough to publish (``_record_lapsed``;
        not counted): an owner fenced by a lapse owns again only once it is."""
        at, ms = self.view.record_published_at, self.membership
        return at is None or ms is None or time.monotonic() - at <= ms.ttl_s - LEASE_MARGIN_S

    async def _lease_back(self) -> bool:
        """Whether our lease is live, waiting up to ``LEASE_WAIT_S`` for our record to be stored
        again when it is not (the record loop stores it meanwhile)."""
        deadline = time.monotonic() + LEASE_WAIT_S
        while not self.lease_live():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(LEASE_POLL_S)
        return True

    async def resume(self, p: int, epoch: int, *, after: int) -> Handed | None:
        """The version of ``p`` that a replica took while our lease lapsed (``lapsed``), to own
        from under ``epoch`` once the lease is live again; None when there is none newer than
        ``after``, or that
        replica no longer takes it under ``epoch`` (a successor took the fragment over there,
        or it no longer sees us as a member): then nothing is resumed and the owner starts
        from its last published version. Taken again there, it is the content that replica (the
        successor while our record was in doubt) would own from: one content either way."""
        kept = self.lapsed.pop(p, None)
        if kept is None or kept.state.version <= after:
            return None
        state = dataclasses.replace(kept.state, epoch=epoch)
        try:
            took = await self._hand_by_reference(p, kept.replica, state) or await self._hand_to(
                p, kept.replica, state
            )
        except (_FencedBy, NotAMemberThere) as exc:
            log.info("fragment %d: version %d not resumed: %s", p, state.version, exc)
            return None
        if not took:
            log.info(
                "fragment %d: version %d not resumed: %s did not take it",
                p,
                state.version,
                kept.replica[1],
            )
            return None
        try:
            theta, momentum = await asyncio.to_thread(self.replicas.decode, state)
        except DecodeError as exc:  # our own state: a bug, but no reason to stop owning
            log.warning("fragment %d: version %d not resumed: %r", p, state.version, exc)
            return None
        self.resumed += 1
        log.info(
            "fragment %d: resuming from version %d, which %s took while we could not publish it",
            p,
            state.version,
            kept.replica[1],
        )
        return handed_from(self.signer.peer_id, state, theta, momentum)

    def _record_lapsed(self, p: int) -> str | None:
        """Why this owner must not publish ``p``'s next version: our member record was last stored
        so long ago that others may see it expire (its TTL, less ``LEASE_MARGIN_S`` for their
        clocks), drop us, and hand the fragment to a successor; None while it is live."""
        at, ms = self.view.record_published_at, self.membership
        if self.lease_live() or at is None or ms is None:
            return None
        age = time.monotonic() - at
        self.lease_lapses += 1
        return (
            f"fenced: our member record was last stored {age:.1f} s ago, past its {ms.ttl_s:g} s "
            f"TTL less {LEASE_MARGIN_S:g} s: others may have handed fragment {p} to a successor"
        )

    def _above_stale_fence(
        self, p: int, state: ReplicaState, ack: ReplicaAck
    ) -> ReplicaState | None:
        """The handoff again under an epoch above ``ack``'s when the fence that refused it is
        stale: the replica's highest epoch ended at a version older than the one this owner's
        line already starts from (``state.version - 1``), so no owner of that epoch is ahead of
        us. That happens after a double failure (an owner and its replica both killed): the new
        owner starts from the newest published version, with an epoch from its own older
        records. A fence whose version is not behind ours is real: None (stop publishing)."""
        owner = self.owners.get(p)
        base = state.version - 1
        if (
            owner is None
            or owner.epoch != state.epoch
            or ack.epoch <= state.epoch
            or not 0 <= ack.version < base
        ):
            return None
        owner.epoch = ack.epoch + 1
        self.replicas.fence(p, owner.epoch, base, owner.digest_of(base))
        log.info(
            "fragment %d: the fence at epoch %d ends at version %d, behind our %d: owning at epoch %d",
            p,
            ack.epoch,
            ack.version,
            base,
            owner.epoch,
        )
        return dataclasses.replace(state, epoch=owner.epoch)

    async def take_in(self, opened: Opened) -> ReplicaAck | TakenIn:
        """A handoff: the owner of a fragment (or the one retiring from it) hands us its state.
        A refusal before the replica store is asked (a ``ReplicaAck``), else what it answered
        (``TakenIn``): the fragment's owner here reacts to it (``Ownership.on_replica_state``)."""
        msg = opened.message
        assert isinstance(msg, ReplicaState)
        member = self.membership.members.get(opened.peer_id) if self.membership else None
        if member is None or not member.certified_owner:  # signed, so that its primary may trust it
            return self._refuse_handoff(
                msg,
                "not-a-member",
                f"{NOT_A_MEMBER}: peer {opened.peer_id.hex()[:8]} "
                "may not own fragments in this peer's view; its state is not taken",
            )
        admission = self._admit_handoff(opened.peer_id, msg)
        if not admission.accepted:
            return self._refuse_handoff(msg, admission.kind, admission.reason)
        if msg.final and not admission.final:
            self.replicas.refusals["final-ignored"] += 1
        # only what the sender may claim: ``final`` from an owner, merged bases below the version
        msg = dataclasses.replace(msg, final=admission.final, merged_bases=admission.merged_bases)
        fence = self._owner_fence(msg)
        if fence is not None:
            return fence
        learned = (
            self.started.net.held_state(msg.fragment)
            if self.started.net is not None and msg.base_version >= 0
            else None
        )
        try:
            decoded = await asyncio.to_thread(
                self.replicas.decode, msg, learned
            )  # a whole fragment: off the loop
        except BaseNotHeld as exc:  # not the sender's fault: it sends the whole state next
            held = self.replicas.held.get(msg.fragment)
            return ReplicaAck(
                accepted=False,
                reason=exc.reason,
                epoch=held.epoch if held else -1,
                version=held.version if held else -1,
            )
        fence = self._owner_fence(msg)  # the loop ran meanwhile: look again
        if fence is not None:
            return fence
        admission = self._admit_handoff(opened.peer_id, msg)  # and so may the view have changed
        if not admission.accepted:
            return self._refuse_handoff(msg, admission.kind, admission.reason)
        own = self.owners.get(msg.fragment)
        ack = self.replicas.offer(
            opened.peer_id,
            msg,
            successor=own is not None and not own.retired,
            decoded=decoded,
            hashed=self.replicas.hashes_to_digest(msg, opened.blobs_digest),
        )
        if ack.accepted:
            self.on_taken(msg.fragment, msg.version, msg.digest)
        return TakenIn(ack, msg, member.record.url)

    def _handoff_view(self, p: int) -> HandoffView:
        """Who this peer's view names for fragment ``p`` (``protocol.diloco.replica.admit``): its
        owner now (with and without our suspects), the owner our last ownership pass saw and, while
        we own ``p``, the one we took it from; its predecessor is who would own it without us."""
        me, owners = self.signer.peer_id, set()
        predecessor = None
        if self.membership is not None:
            ranked = (self.membership.owner_of(self.cfg.swarm, p), self.view.owner_of(p))
            owners |= {o[0] for o in ranked if o is not None}
            without_us = self.membership.owner_of(self.cfg.swarm, p, exclude={me})
            predecessor = without_us[0] if without_us is not None else None
        last = self.last_owner.get(p)
        if last is not None:
            owners.add(last)
        own = self.owners.get(p)
        if own is not None and own.retired:
            own = None  # retired: we no longer own p
        took = self.replicas.took_from.get(p) if own is not None else None
        if took is not None:
            owners.add(took)
        merged = own is not None and own.merges_done > 0
        sources: frozenset[bytes] = frozenset()
        if own is not None and not merged:
            sources = frozenset(c[0] for c in self.catch_up_sources(p))
        return HandoffView(
            me=me,
            owners=frozenset(owners),
            predecessor=predecessor,
            merged=merged,
            sources=sources,
        )

    def catch_up_sources(self, p: int) -> list[tuple[bytes, str]]:
        """The members a new owner of ``p`` asks for its predecessor's newer versions, and whose
        handoff it takes as its predecessor's before its first merge: the first
        ``CATCH_UP_SOURCES`` ranked without us and our suspects."""
        if self.membership is None:
            return []
        return self.membership.ranked(
            self.cfg.swarm,
            p,
            CATCH_UP_SOURCES,
            exclude={self.signer.peer_id, *self.view.suspects()},
        )

    def _admit_handoff(self, sender: bytes, msg: ReplicaState) -> Admission:
        """``admit`` for ``msg`` from ``sender``: the view, the fence held and the newest version
        known here (held as a replica or owner, or received by our learner, whichever is newer)."""
        p = msg.fragment
        held = self.replicas.held.get(p)
        received, received_at, created = -1, None, None
        if self.started.net is not None:
            received, received_at, created = (
                self.started.net.received[p],
                self.started.net.received_at.get(p),
                self.started.net.created,
            )
        known = max(received, held.version if held is not None else -1)
        return admit(
            sender,
            self._handoff_view(p),
            held,
            fragment=p,
            epoch=msg.epoch,
            version=msg.version,
            final=msg.final,
            merged_bases=msg.merged_bases,
            known_version=known,
            received=received,
            received_at=received_at,
            created=created,
            now=time.time(),
        )

    def _refuse_handoff(self, msg: ReplicaState, kind: str, reason: str) -> ReplicaAck:
        """A signed refusal (the RPC layer seals every answer), counted by ``kind``."""
        self.replicas.refused += 1
        self.replicas.refusals[kind] += 1
        log.info(
            "fragment %d: handoff of version %d (epoch %d) refused: %s",
            msg.fragment,
            msg.version,
            msg.epoch,
            reason,
        )
        held = self.replicas.held.get(msg.fragment)
        return ReplicaAck(
            accepted=False,
            reason=reason,
            epoch=held.epoch if held else -1,
            version=held.version if held else -1,
        )

    def _owner_fence(self, msg: ReplicaState) -> ReplicaAck | None:
        """The refusal of a handoff for a fragment this peer owns and has moved on with (merged
        already, or holds a newer version of); None when the handoff may be judged, and when the
        handoff supersedes this owner (``supersedes``)."""
        own = self.owners.get(msg.fragment)
        if (
            own is not None
            and not own.retired
            and not supersedes(msg, own)
            and (own.merges_done or msg.version < own.version)
        ):
            return ReplicaAck(
                accepted=False,
                epoch=own.epoch,
                version=own.version,
                reason=f"fenced: this peer owns fragment {msg.fragment} (epoch {own.epoch}, "
                f"version {own.version})",
            )
        return None

    def pass_on_held(self, refused: ReplicaState, url: str, sender: bytes) -> None:
        """A new owner (by its view) was refused because we hold its base version's state from
        a higher epoch (we are the replica of a failed owner that the rendezvous did not make the
        successor), its next version with another content (handed to us by an owner that did
        not live to publish it), or a newer version than it holds. Hand it that state (global fragment, momentum, merged work), so
        it owns the fragment from exactly there instead of stepping back and leaving it unowned."""
        p, held = refused.fragment, self.replicas.states.get(refused.fragment)
        if held is None or self.started.tg is None or (p, sender, held.version) in self._passed_on:
            return
        builds_on_it = refused.version == held.version + 1 and refused.epoch < held.epoch
        # or the same version with another content: the owner we hold it from handed it to us
        # and died (or retired) before publishing it; the new owner must continue from it
        replaces_it = refused.version == held.version and refused.digest != held.digest
        # or an older version: the new owner took the fragment over from a state behind ours
        # (a retiring owner handed its newest to us, the successor in its view, not in the
        # others'); without ours it steps back and owns again from where it was, refusing every
        # learner's work as ahead of it
        behind_it = refused.version < held.version
        if not (builds_on_it or replaces_it or behind_it):
            return
        self._passed_on.add((p, sender, held.version))
        if len(self._passed_on) > 4096:
            self._passed_on.clear()
        # under the new owner's epoch when that is higher: it is the owner now, continuing from here
        state = encode_state(
            swarm=self.cfg.swarm,
            fragment=p,
            epoch=max(held.epoch, refused.epoch),
            version=held.version,
            digest=held.digest,
            theta=held.theta,
            momentum=held.momentum,
            merged=held.merged,
        )
        log.info(
            "fragment %d: handing version %d (epoch %d) to %s, which took the fragment over without it",
            p,
            held.version,
            held.epoch,
            url,
        )
        self.started.tg.create_task(self.hand_on(p, (sender, url), state))
