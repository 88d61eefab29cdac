"""Owning fragments (``Ownership``): which fragments this peer owns by its view of the members,
starting and stopping their ``FragmentOwner``s, the owners' training routes, and what a handoff
taken in means for them (the handoffs themselves: ``node.peer.handoffs``).

``reconcile`` runs after every membership read: a fragment the view hands us is owned from the
state a previous owner handed us (or the newest version we hold), one the view moves away is
retired and handed on; an owner fenced off steps back for ``FENCE_BACKOFF_S`` unless a newer
state was handed to us. One fenced by its own lapsed lease (nobody is known to have taken over)
owns again as soon as our record is stored again, from the version its replica took meanwhile
when that replica takes it again (``Handoffs.resume``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from node.config import RunConfig
from node.dht.membership import Membership
from node.diloco.fetching import RoundDeclined
from node.diloco.flat import encode_flat, flat_from_tensors
from node.diloco.owner import (
    Declined,
    FragmentOwner,
    OwnerConfig,
    OwnerCounts,
    OwnerHooks,
    OwnerStart,
)
from node.diloco.replica import Handed, ReplicaStore
from node.diloco.succession import measured_updates
from node.diloco.validation import Evaluator, OwnerValidation
from node.peer.finals import FinalVersions
from node.peer.handoffs import Handoffs, TakenIn, supersedes
from node.peer.started import PeerShared
from node.peer.view import MemberView
from protocol.diloco.fragments import FragmentPlan
from protocol.diloco.interval import interval
from protocol.diloco.merge import MergeConfig
from protocol.diloco.outer import OuterConfig
from protocol.diloco.validation import ValidationConfig
from protocol.errors import NotAuthorized, UnknownFragment
from protocol.wire.messages import Ack, Contribution, ReplicaAck, ReplicaState
from protocol.wire.signing import Opened

__all__ = [
    "CATCH_UP_S",
    "FENCE_BACKOFF_S",
    "RETIRE_MERGE_WAIT_S",
    "Ownership",
    "OwnershipConfig",
]

log = logging.getLogger("atoll.peer")

CATCH_UP_S = 6.0
FENCE_BACKOFF_S = (
    5.0  # an owner fenced off does not claim the fragment again for this long (or until handed it)
)
RETIRE_MERGE_WAIT_S = 10.0  # a retiring owner lets a merge under way finish this long


@dataclass(frozen=True, slots=True)
class OwnershipConfig:
    """What owners are built from: the swarm's config, the plan and its tensors' shapes, the
    validation set (None: validated publication off) and where owners log their merges."""

    run: RunConfig
    plan: FragmentPlan
    shapes: list[list[tuple[int, ...]]]
    evaluator: Evaluator | None = None
    event_log_dir: Path | None = None


class Ownership:
    """The fragments a peer owns, their ``FragmentOwner``s and their handoffs (``handoffs``).
    ``on_publish`` hears of every version an owner publishes, ``on_taken`` of every handoff
    taken in (the peer fences, checkpoints and announces them)."""

    def __init__(
        self,
        config: OwnershipConfig,
        shared: PeerShared,
        view: MemberView,
        finals: FinalVersions,
        *,
        on_publish: Callable[[int, int, bytes], None],
        on_taken: Callable[[int, int, bytes], None],
    ) -> None:
        self.cfg, self.plan, self.shapes = config.run, config.plan, config.shapes
        self.evaluator, self.event_log_dir = config.evaluator, config.event_log_dir
        self.signer, self.started = shared.signer, shared.started
        self.view, self.finals = view, finals
        self.on_publish = on_publish
        numels = [sum(int(torch.Size(s).numel()) for s in shapes) for shapes in self.shapes]
        self.replicas = ReplicaStore(self.cfg.swarm, numels)
        self.owners: dict[int, FragmentOwner] = {}
        # per fragment, what is kept of the owners this peer retired: the earlier ones folded, the last
        self.retired: dict[int, list[OwnerCounts]] = {}
        self._owner_tasks: dict[int, asyncio.Task[None]] = {}
        self._fenced_until: dict[int, float] = {}
        self._last_owner: dict[int, bytes] = {}  # per fragment, the owner the last pass saw
        # per fragment, the live owner we took it from and hold our first merge for (its handoff)
        self._awaited: dict[int, bytes] = {}
        self.handoffs = Handoffs(
            self.cfg,
            shared,
            view,
            self.replicas,
            owners=self.owners,
            last_owner=self._last_owner,
            on_taken=on_taken,
        )

    @property
    def membership(self) -> Membership | None:
        return self.started.membership

    def cancel_tasks(self) -> None:
        """Cancel every owner's task (the peer is stopping)."""
        for task in self._owner_tasks.values():
            task.cancel()

    def reconcile_soon(self) -> None:
        """Reconcile now in a task of its own (a member was found dead, or handed us a state)."""
        self.started.spawn(self.reconcile())

    async def reconcile(self) -> None:
        now = time.monotonic()
        for p in range(len(self.plan.fragments)):
            running = self.owners.get(p)
            if running is not None and running.fenced is not None:
                handed = self.replicas.states.get(p)
                self._drop_owner(p)
                if p in self.handoffs.lapsed:
                    pass  # lease lapsed or view stale, no other owner known: own again when live
                elif handed is None or (handed.version, handed.epoch) <= (
                    running.version,
                    running.epoch,
                ):
                    self._fenced_until[p] = (
                        now + FENCE_BACKOFF_S
                    )  # another owner took over: step back
                    continue
                # else a newer state was handed to us: own again from it at once (below)
            owner = self.view.owner_of(p)
            mine = owner is not None and owner[0] == self.signer.peer_id
            if not mine:
                self.handoffs.lapsed.pop(p, None)  # another owns it now: nothing to resume
            # a lapsed lease: the others may not see us, and the first merge would fence again
            may_start = now >= self._fenced_until.get(p, 0.0) and self.handoffs.lease_live()
            if mine and p not in self.owners and may_start:
                self._start_owner(p)
            elif not mine and p in self.owners:
                log.info(
                    "fragment %d: no longer the owner (now %s)", p, owner[1] if owner else None
                )
                retired = self._drop_owner(p, finish_merge=True)
                await retired.retire(
                    finish_merge_s=RETIRE_MERGE_WAIT_S
                )  # a merge under way ends first
                if (
                    owner is not None and self.started.tg is not None
                ):  # hand our state on: nothing is lost
                    self.started.tg.create_task(self.handoffs.hand_on(p, owner, retired.snapshot()))
            if owner is not None:
                self._last_owner[p] = owner[0]
        await self._release_holds_for_gone_owners()
        if self.started.net is not None:
            self.started.net.owners_changed()  # work accepted by an owner that has gone is sent again now

    async def _release_holds_for_gone_owners(self) -> None:
        """End the first-merge hold of each owner whose predecessor is now a suspect (it refuses
        connections: it left or died, and hands nothing over). Holding on would only idle the
        fragment: a 2-peer CI run trained its whole 80 steps with a fragment held this way."""
        suspects = self.view.suspects()
        for p, awaited in list(self._awaited.items()):
            owner = self.owners.get(p)
            if owner is None or owner.merges_done:
                del self._awaited[p]
            elif awaited in suspects and p not in self.handoffs.lapsed:
                del self._awaited[p]
                await owner.release_first_merge(
                    f"the previous owner {awaited.hex()[:8]} refuses connections: "
                    "it hands nothing over"
                )

    def _drop_owner(self, p: int, *, finish_merge: bool = False) -> FragmentOwner:
        """Stop owning ``p``. With ``finish_merge`` a merge under way is not cancelled: its
        replica may hold that version already, and the successor must get it (``retire`` waits
        for it, then the timer is cancelled)."""
        retired = self.owners.pop(p)
        # its counts for the report (its state goes), kept live while a merge under way may
        # still finish; the fragment's earlier retired owners' are folded into one
        kept = self.retired.setdefault(p, [])
        if len(kept) == 2:
            kept[0].fold(kept.pop())
        kept.append(retired.counts)
        task = self._owner_tasks.pop(p)
        if finish_merge and self.started.tg is not None:

            async def cancel_after_retire() -> None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RETIRE_MERGE_WAIT_S + 1.0):
                        await retired.wait_retired()
                task.cancel()

            self.started.tg.create_task(cancel_after_retire())
        else:
            task.cancel()
        return retired

    def _start_owner(self, p: int) -> None:
        """Own fragment ``p``: from the state a previous owner handed us (its global fragment,
        momentum and version, under a higher epoch) when it is not behind what we hold, else
        from the newest version we hold."""
        assert self.started.net is not None and self.started.tg is not None
        version, flat = self.started.net.latest.get(p, (0, self.started.net.island_initial[p]))
        held, handed = self.replicas.held.get(p), self.replicas.states.get(p)
        previous = (
            self.membership.owner_of(
                self.cfg.swarm, p, exclude={self.signer.peer_id, *self.view.suspects()}
            )
            if self.membership
            else None
        )
        # the owner our last pass saw is the one we take p from: its handoff is an owner's (issue
        # 48). Without a pass (we have just joined, or come back) it is the one the members rank
        # first without us: it owned p until now, and may have handed its version out as final
        # (a swarm that ended while we were away), which we must then hold final too.
        took = self._last_owner.get(p)
        if took is None and previous is not None:
            took = previous[0]
        if took is None or took == self.signer.peer_id:
            self.replicas.took_from.pop(p, None)
        else:
            self.replicas.took_from[p] = took
        epoch, momentum, merged = (held.epoch + 1 if held else 0), None, None
        from_handoff = False
        # the predecessor's clip reference and standing come with its state; an older state held
        # here measures the updates since, which checks (or seeds) the reference
        measured = (
            measured_updates(handed.theta, handed.version, flat, version, lr=self.cfg.outer_lr)
            if handed is not None
            else []
        )
        if handed is not None and handed.version >= version:
            from_handoff = True
            version, flat, momentum, merged = (
                handed.version,
                handed.theta,
                handed.momentum,
                handed.merged,
            )
            log.info(
                "fragment %d: taking over version %d (epoch %d) with its momentum",
                p,
                version,
                handed.epoch,
            )
        owner = FragmentOwner(
            OwnerConfig(
                swarm=self.cfg.swarm,
                fragment=self.plan.fragments[p],
                shapes=tuple(self.shapes[p]),
                merge=self._merge_cfg(),
                outer=self._outer_cfg(),
                download_codec=self.cfg.download_codec,
                update_codec=None if self.cfg.update_codec == "none" else self.cfg.update_codec,
                block_size=self.cfg.block_size,
                round_steps=2 * self._longest_interval(),
                event_log=(
                    self.event_log_dir
                    / f"fragment{p}-epoch{epoch}-v{version}-{time.time_ns()}.jsonl"
                    if self.event_log_dir is not None
                    else None
                ),
            ),
            OwnerStart(
                theta=flat,
                version=version,
                epoch=epoch,
                momentum=momentum,
                merged=merged or {},
                reference=handed.norms if from_handoff and handed is not None else (),
                measured=measured,
                standing=handed.standing if from_handoff and handed is not None else None,
            ),
            signer=self.signer,
            hooks=OwnerHooks(
                replicate=functools.partial(self.handoffs.replicate, p),
                on_publish=self.on_publish,
                on_final=self.handoffs.final_declared,
            ),
            validation=(
                OwnerValidation(
                    self.evaluator,
                    ValidationConfig(
                        windows=self.cfg.validate_windows, every=self.cfg.validate_every
                    ),
                )
                if self.evaluator is not None
                else None
            ),
        )
        if handed is not None and handed.final:
            owner.hold_final(handed.version)
        self.replicas.fence(p, epoch, version, owner.digest_of(version))
        if self.handoffs.lapsed.get(p) is not None:
            # a replica took a version we did not publish (our lease had lapsed): merge nothing
            # until it takes it again under our new epoch and we own from it (``_run_owner``)
            owner.hold_first_merge(CATCH_UP_S)
        self._awaited.pop(p, None)
        displaced = None if from_handoff else self._displaced_live_owner(p, previous)
        if displaced is not None:
            # it hands us its state as it retires, maybe a version it handed out as final: merge
            # nothing before. (A replica taking over from a dead owner starts from its last state,
            # handed before it was published.) At version 0 too: a joiner that has not yet fetched
            # the live owner's first version would publish version 1 with a second content
            # (96 peers on a starved box, docs/scale_peers.md "Two contents on a starved box").
            owner.hold_first_merge(CATCH_UP_S)
            self._awaited[p] = displaced
        self.owners[p] = owner
        # the owner the hold waits for is asked first: its refusal, if it has gone, ends the hold
        member = self.membership.members.get(displaced) if self.membership and displaced else None
        first = (member.peer_id, member.record.url) if member and member.record.url else previous
        self._owner_tasks[p] = self.started.tg.create_task(self._run_owner(owner, first))
        log.info("fragment %d: now the owner, from version %d", p, version)

    def _displaced_live_owner(self, p: int, previous: tuple[bytes, str] | None) -> bytes | None:
        """The live owner starting to own ``p`` takes it from, if any. The owner our last
        ownership pass saw is the one we take it from: live unless it is a suspect or no longer a
        member (then it died, and hands nothing over). Without such a pass (we have just joined,
        or come back) it is the one the members would rank first without us, ``previous``."""
        seen = self._last_owner.get(p)
        if seen is None or seen == self.signer.peer_id:
            return None if previous is None else previous[0]
        live = seen not in self.view.suspects() and (
            self.membership is None or seen in self.membership.members
        )
        return seen if live else None

    async def _run_owner(self, owner: FragmentOwner, previous: tuple[bytes, str] | None) -> None:
        """Resume from the version our replica took while our lease lapsed, if any
        (``Handoffs.resume``), and catch up with the previous owner's latest version for a few
        seconds, then merge.

        The previous owner is presumed to be the member ranked first without us; with bounded
        loads it may be another, so the next-ranked members are asked in turn (only an owner
        answers, with a version it signed)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(owner.run())
            p = owner.fragment.index
            resumed = await self.handoffs.resume(p, owner.epoch, after=owner.version)
            if resumed is not None:
                await owner.take_over(resumed)
            if previous is not None and self.started.net is not None:
                sources = [previous]
                sources += [c for c in self.handoffs.catch_up_sources(p) if c[0] != previous[0]]
                deadline = time.monotonic() + CATCH_UP_S
                for turn in itertools.count():
                    if time.monotonic() >= deadline or owner.merges_done:
                        break
                    with contextlib.suppress(Exception):
                        got = await self.started.net.fetch(
                            p, after=owner.version, wait_s=1.0, owner=sources[turn % len(sources)]
                        )
                        if got is not None:
                            await owner.catch_up(*got)
                    await asyncio.sleep(0.5)

    def _longest_interval(self) -> int:
        """The longest H a learner of this swarm trains between two syncs of a fragment (with
        ``--sync-growth``, H at the end of the learning rate's decay)."""
        c = self.cfg
        return max(c.inner_steps, interval(c.inner_steps, max(c.min_lr_ratio, 1e-6), c.sync_growth))

    def _merge_cfg(self) -> MergeConfig:
        c = self.cfg
        return MergeConfig(
            quorum=c.quorum,
            quorum_fraction=c.merge_quorum_fraction,
            gamma=c.grace_gamma,
            tau=c.grace_tau,
            grace_cap_s=c.grace_cap_s,
            staleness_bound=c.staleness_bound,
            late_policy="carry" if c.late_policy == "carry" else "drop",
            max_tokens_per_step=c.max_tokens_per_step,
            quorum_is_expected=c.mode != "decoupled",
            max_work_steps=c.merge_max_work_steps,
            max_claimed_steps=c.merge_max_claimed_steps,
            reference_min_steps=c.inner_steps // 2,
        )

    def _outer_cfg(self) -> OuterConfig:
        return OuterConfig(
            lr=self.cfg.outer_lr,
            momentum=self.cfg.outer_momentum,
            aggregate=self.cfg.aggregate,
            rda_max_gain=self.cfg.rda_max_gain,
        )

    async def on_contribution(self, opened: Opened, flat: torch.Tensor | None = None) -> Ack:
        msg = opened.message
        assert isinstance(msg, Contribution)
        if msg.swarm != self.cfg.swarm:
            raise NotAuthorized(f"contribution for swarm {msg.swarm!r}, this is {self.cfg.swarm!r}")
        owner = self.owners.get(msg.fragment)
        if owner is None:
            raise UnknownFragment(
                f"fragment {msg.fragment} is not owned here (plan has {len(self.plan.fragments)})"
            )
        member = self.membership.members.get(opened.peer_id) if self.membership else None
        if member is not None and not member.record.learning:
            # its final versions may already be out: a late contribution would fork the model
            return Ack(
                accepted=False,
                version=owner.version,
                reason=f"peer {opened.peer_id.hex()[:8]} has stopped learning; contribution not merged",
            )
        return await owner.receive(
            opened.peer_id, msg, flat
        )  # answered before the merge it completes

    async def contribute_local(self, msg: Contribution, flat: torch.Tensor | None = None) -> Ack:
        """Our own learner's contribution to a fragment we own: the RPC's checks, in process
        (``flat``: see ``LocalOwners.contribute_local``)."""
        me = Opened(
            public_key=self.signer.public_key,
            peer_id=self.signer.peer_id,
            timestamp=time.time(),
            nonce=b"",
            message=msg,
        )
        return await self.on_contribution(me, flat)

    async def version_local(
        self, p: int, *, after: int, wait_s: float, final: bool
    ) -> tuple[int, torch.Tensor, bytes] | None:
        """A version of a fragment we own for our own learner, in process: the owner's state as
        every other learner decodes it (``IslandNet.fetch``'s local path)."""
        owner = self.owners.get(p)
        if owner is None or owner.retired:
            raise UnknownFragment(f"fragment {p} is not owned here")
        got = await (
            self.finals.wait(owner, wait_s)
            if final
            else owner.wait_after(after, wait_s, asker=self.signer.peer_id)
        )
        if isinstance(got, Declined):  # our own work was in a candidate validation declined
            raise RoundDeclined(p, got.base)
        if got is None:
            return None
        if owner.retired:
            raise UnknownFragment(f"fragment {p} is not owned here any more")
        version, theta, digest = owner.version, owner.theta, owner.digest_of(owner.version)
        if owner.download_codec != "none":  # others hold the decoded bf16 state: so must we
            shapes, codec = self.shapes[p], owner.download_codec
            theta = await asyncio.to_thread(
                lambda: flat_from_tensors(encode_flat(theta, shapes, codec), shapes)
            )
        return version, theta, digest

    def replica_version(self, p: int, owner_id: bytes) -> Handed | None:
        """Fragment ``p`` as ``owner_id`` handed it to this peer's replica store (``IslandNet.fetch``
        takes it instead of downloading it again): see ``ReplicaStore.version_from``."""
        return self.replicas.version_from(p, owner_id)

    async def on_replica_state(self, opened: Opened) -> ReplicaAck:
        """A handoff (``Handoffs.take_in``), then what it means for the fragment we own, if any:
        an owner that has not merged yet starts from it; one it supersedes steps back; an owner
        that stepped back for its sender takes over now; a refused successor is handed ours.
        Raises ``UnknownFragment`` for a fragment outside our plan (the replica store refuses
        another swarm's)."""
        msg = opened.message
        assert isinstance(msg, ReplicaState)
        if msg.fragment >= len(self.plan.fragments):  # every per-fragment table is this long
            raise UnknownFragment(
                f"handoff of fragment {msg.fragment}: the plan has {len(self.plan.fragments)}"
            )
        taken = await self.handoffs.take_in(opened)
        if not isinstance(taken, TakenIn):
            return taken
        ack, msg, url = taken.ack, taken.state, taken.url
        own = self.owners.get(msg.fragment)
        if ack.accepted and own is not None and not own.retired:
            # a retiring owner's newer state: an owner that has not merged yet starts from it; one
            # that has merged was superseded by an owner above it in epoch and version
            if not await own.take_over(self.replicas.states[msg.fragment]) and supersedes(msg, own):
                await self._step_back_for(own, msg, url)
        elif ack.accepted and self._fenced_until.pop(msg.fragment, None) is not None:
            # we stepped back for the owner that has now handed us its state: take over now
            self.reconcile_soon()
        elif not ack.accepted and (own is None or own.retired):
            self.handoffs.pass_on_held(msg, url, opened.peer_id)
        return ack

    async def _step_back_for(self, own: FragmentOwner, msg: ReplicaState, url: str) -> None:
        """Stop owning a fragment whose state ``msg`` was handed to us from above our epoch and
        version: another owner published past us while views of the members differed. A merge
        under way does not publish (it would give one of that owner's version numbers another
        content); the next membership pass owns the fragment again from the state we were handed,
        if the view still names us."""
        own.fenced = (
            f"fenced: {url} handed over fragment {msg.fragment} version {msg.version} at epoch "
            f"{msg.epoch}, past this owner's version {own.version} at epoch {own.epoch}"
        )
        log.warning("fragment %d: stepping back: %s", msg.fragment, own.fenced)
        await own.retire()
        self.reconcile_soon()
