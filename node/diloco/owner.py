"""The owner of a fragment: drives ``protocol.diloco.merge`` and publishes global versions.

For each fragment this peer owns, a ``FragmentOwner`` is composed of: its state (``OwnerState``:
the global fragment Θ_p as one flat fp32 vector, its Nesterov buffer, version and the digests
that name it), the ``FragmentMerger`` state machine (logged for replay with an event log), an
intake that decodes each contribution and says why it is refused before the merger
(``node.diloco.intake``), a ``VersionMaker`` that computes and checks the next version
(``node.diloco.merging``), a ``Sealer`` that seals versions with its key
(``node.diloco.sealing``), and its succession (``node.diloco.succession``: the final hold,
retiring). The owner feeds the merger with ``now`` from its ``clock`` (``time.monotonic``; tests
pass a fake one), carries out what it decides, and wakes every long-poll waiting for a version.
The timer task calls ``tick`` at the merger's deadline.

A merge that fails (a non-finite aggregate or result, or any unforeseen error) drops the
contributions that caused it (every one of them: no single one is to blame, since each was
checked for shape, finiteness and a finite norm on arrival), with the reason logged, and the
merger retries with the rest: the same failing set is never retried. A new owner that catches up
with its predecessor's newer version keeps the contributions it already accepted
(``FragmentMerger.rebase``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

import torch

from node.diloco.eventlog import Content, LoggedMerger
from node.diloco.flat import flat_digest
from node.diloco.intake import ContributionIntake
from node.diloco.merging import Fenced, MergeFailed, NextVersion, Rejected, VersionMaker, Work
from node.diloco.owner_state import OwnerConfig, OwnerCounts, OwnerStart, OwnerState
from node.diloco.replica import Carried, Handed
from node.diloco.sealing import Sealer
from node.diloco.succession import FINAL_HOLD_S, Prepared, Succession, prepare
from node.diloco.validation import OwnerValidation
from protocol.diloco.activity import LearnerActivity
from protocol.diloco.fragments import Fragment
from protocol.diloco.merge import Decision, FragmentMerger, Phase
from protocol.diloco.norms import all_finite, norm64
from protocol.diloco.outer import OuterConfig
from protocol.diloco.reference import starting_reference
from protocol.diloco.standing import Event, Standing
from protocol.errors import DecodeError, Stale
from protocol.wire.messages import Ack, Contribution, ReplicaState
from protocol.wire.signing import Sealed, Signer

__all__ = [
    "FINAL_HOLD_S",
    "FragmentOwner",
    "MergeFailed",
    "OwnerConfig",
    "OwnerCounts",
    "OwnerStart",
]

log = logging.getLogger(__name__)

Replicate = Callable[[ReplicaState, ReplicaState | None, bytes | None], Awaitable[str | None]]


class FragmentOwner:
    """Merges contributions for one fragment and serves its versions."""

    def __init__(
        self,
        config: OwnerConfig,
        start: OwnerStart,
        *,
        signer: Signer,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        replicate: Replicate | None = None,
        on_publish: Callable[[int, int, bytes], None] | None = None,
        on_final: Callable[[FragmentOwner], None] | None = None,
        validation: OwnerValidation | None = None,
    ) -> None:
        """``replicate``: hands each next version's whole state to a replica before it is
        published (and the same state as an update over the version before, when there is one,
        and the BLAKE3 of the state's fp32 bytes when its seal computed that already), returning
        None when a replica took it (or none can) and the reason when this owner has been
        replaced ("fenced: ..."), after which it stops publishing and retires; ``on_publish``:
        called with (fragment, version, digest) of each published version; ``on_final``: called
        with this owner the first time its latest version is held final (handed out as final
        here, or taken over as final from the previous owner); ``validation``: check each
        candidate version on the swarm's validation set before publishing it
        (``node.diloco.validation``; None: off)."""
        self.config, self.clock = config, clock
        self.replicate, self.on_publish, self.on_final = replicate, on_publish, on_final
        self.sealer = Sealer(config, signer, wall_clock)
        now = self.started_at = clock()
        self.merger, self.log = _merger(config, start.version, now)
        theta = start.theta.detach().float().clone()  # [numel_p] fp32
        latest, *digests = self.sealer.state(start.version, theta)
        self.held = OwnerState(
            theta=theta,
            buffer=None if start.momentum is None else start.momentum.detach().float().clone(),
            version=start.version,
            epoch=start.epoch,
            latest=latest,
            keep=config.merge.staleness_bound + 2,
            merged_base=dict(start.merged),
        )
        if self.log is not None:
            self.log.note_state(self.held.theta, self.held.buffer)
        self._remember(start.version, *digests, flat_digest(theta))  # and v0 unrounded (bf16)
        self.counts = OwnerCounts(config.fragment.index)  # what outlives this owner once retired
        self.intake = ContributionIntake(config, self.held)
        self.maker = VersionMaker(config, self.held, self.sealer, validation, self.log, self.counts)
        self.succession = Succession(config.fragment.index, clock)
        # when each sender's contributions were taken: a member claiming to learn that has long
        # sent nothing is not waited for (``protocol.diloco.activity``)
        self.activity = LearnerActivity(min_steps=config.round_steps)
        self.not_waited_for: dict[bytes, float] = {}  # members found silent, and when logged
        # per sender key: what its work came to here, carried to successors
        self.standing = Standing()
        self.reference_note = ""  # where the clip reference came from (status)
        self.start_reference(start.reference, start.measured)
        if start.standing is not None:
            self.take_standing(start.standing)
        self._background: set[asyncio.Task[None]] = set()  # merges started by ``receive``
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()

    # --- the state, as others read it ----------------------------------------------------------
    @property
    def theta(self) -> torch.Tensor:
        return self.held.theta

    @property
    def buffer(self) -> torch.Tensor | None:
        return self.held.buffer

    @property
    def version(self) -> int:
        return self.held.version

    @property
    def epoch(self) -> int:
        return self.held.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:  # a fence behind our version: owning at a higher epoch
        self.held.epoch = epoch

    @property
    def latest(self) -> Sealed:
        return self.held.latest

    @property
    def update(self) -> Sealed | None:
        return self.held.update

    @property
    def residual(self) -> torch.Tensor | None:
        return self.held.residual

    @property
    def digests(self) -> dict[int, set[bytes]]:
        return self.held.digests

    @property
    def fragment(self) -> Fragment:
        return self.config.fragment

    @property
    def download_codec(self) -> str:
        return self.config.download_codec

    @property
    def outer_cfg(self) -> OuterConfig:
        return self.config.outer

    @property
    def signer(self) -> Signer:
        return self.sealer.signer

    @property
    def step_bounds(self) -> int:
        """Merges whose aggregate was scaled down to max_delta_ratio * |Theta|."""
        return self.maker.step_bounds

    @property
    def retired(self) -> bool:
        return self.succession.retired

    @property
    def fenced(self) -> str | None:
        return self.succession.fenced

    @fenced.setter
    def fenced(self, why: str | None) -> None:  # a handoff from above: stepping back
        self.succession.fenced = why

    @property
    def final_declared(self) -> tuple[int, float] | None:
        return self.succession.final_declared

    def digest_of(self, version: int) -> bytes:
        """The digest of ``version``'s state as learners decode it (``OwnerState.digest_of``)."""
        return self.held.digest_of(version)

    def sealed_after(self, after: int, *, update_ok: bool, full_every: int = 0) -> Sealed:
        """What a learner holding ``after`` should fetch (``OwnerState.sealed_after``)."""
        return self.held.sealed_after(after, update_ok=update_ok, full_every=full_every)

    def owes_resync(self, asker: bytes | None) -> bool:
        """Whether ``asker`` is owed a serve (``ContributionIntake.owes_resync``)."""
        return self.intake.owes_resync(asker)

    def _remember(self, version: int, state_digest: bytes, *others: bytes) -> None:
        """Know ``version`` by its digests (``OwnerState.remember``), logged for replay."""
        self.held.remember(version, state_digest, *others)
        if self.log is not None:
            self.log.note_version(version, state_digest)

    # --- inbound -------------------------------------------------------------------------------
    async def contribute(
        self, sender: bytes, msg: Contribution, flat: torch.Tensor | None = None
    ) -> Ack:
        """Check and feed one contribution to the merger; the merge it completes (if any) has
        run when this returns (``flat``: see ``ContributionIntake.decode``). Raises
        ``RemoteProtocolError``."""
        decision = await self._accept(sender, msg, flat)
        if isinstance(decision, Ack):
            return decision
        await self._apply(decision)
        return Ack(accepted=decision.accepted, reason=decision.reason, version=self.version)

    async def receive(
        self, sender: bytes, msg: Contribution, flat: torch.Tensor | None = None
    ) -> Ack:
        """``contribute``, answered as soon as the contribution is checked and taken (or
        refused): the merge it completes runs on in the background, so the sender's next
        contribution (to this or another owner) does not wait for it. Raises
        ``RemoteProtocolError``."""
        decision = await self._accept(sender, msg, flat)
        if isinstance(decision, Ack):
            return decision
        ack = Ack(accepted=decision.accepted, reason=decision.reason, version=self.version)
        if decision.kind == "merge":
            task = asyncio.create_task(self._apply(decision))
            self._background.add(task)
            task.add_done_callback(self._merge_done)
        else:
            await self._apply(decision)
        return ack

    async def _accept(
        self, sender: bytes, msg: Contribution, given: torch.Tensor | None = None
    ) -> Decision | Ack:
        """Decode, check and hand one contribution to the merger: its decision, or the Ack of
        a refusal before the merger (a final version handed out, low standing, a base this
        owner does not hold, work merged already, a norm far out of bounds)."""
        index, version, penalties = self.fragment.index, self.version, self.counts.penalties
        if (held := self.final_hold()) is not None:  # before decoding: refused at no cost
            log.info("%s (from %s)", held, sender.hex()[:8])
            return Ack(accepted=False, reason=held, version=version)
        if (low := self.standing.refused(sender, version=version)) is not None:  # also free
            penalties[sender]["refused_standing"] += 1
            return Ack(accepted=False, reason=f"fragment {index}: {low}", version=version)
        if msg.base_version > version:
            raise Stale(f"base version {msg.base_version} is ahead of the owner's {version}")
        try:  # malformed: a 4xx, whatever its base
            flat, norm = await asyncio.to_thread(self.intake.decode, msg, given)
        except DecodeError:  # NaN/Inf or a wrong shape: counts against the (authenticated) sender
            self.standing.record(sender, Event.REFUSED, version=self.version)
            raise
        refused = self.intake.screen(sender, msg, norm, self.merger.norm_reference())
        if refused is not None:
            self.intake.give_back(flat)
            penalties[sender][f"refused_{refused.counted}"] += 1
            if refused.counted == "out_of_bounds":  # acknowledged as taken, it was a free shot
                self.standing.record(sender, Event.REFUSED, version=self.version)
                log.info("fragment %d: %s (from %s)", index, refused.reason, sender.hex()[:8])
            else:
                log.info("fragment %d: %s", index, refused.reason)
            return Ack(accepted=False, reason=refused.reason, version=self.version)
        return self._offer(sender, msg, flat, norm)

    def _offer(self, sender: bytes, msg: Contribution, flat: torch.Tensor, norm: float) -> Decision:
        """Hand a screened contribution to the merger, and count what it decided."""
        if self.log is not None:
            self.log.note_payload(msg)
        last = self.intake.last.honoured(sender, msg.last)  # a refused one does not spend it
        now = self.clock()
        decision = self.merger.on_contribution(
            sender,
            base_version=msg.base_version,
            tokens=msg.tokens,
            steps=msg.steps,
            step_time=msg.step_time,
            payload=flat,
            norm=norm,
            now=now,
            last=last,
        )
        if decision.refusal is not None:
            self.counts.penalties[sender][f"refused_{decision.refusal}"] += 1
        self.activity.heard(
            sender, now, steps=msg.steps, step_time=msg.step_time, accepted=decision.accepted
        )
        if decision.accepted:
            if last:
                self.intake.last.taken(sender)
        else:
            self.intake.give_back(flat)
        log.info("fragment %d: %s", self.fragment.index, decision.reason)
        return decision

    def _merge_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "fragment %d: background merge failed",
                self.fragment.index,
                exc_info=task.exception(),
            )

    async def settled(self) -> None:
        """Wait for the merges ``receive`` started (tests, and a clean shutdown)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def set_expected(
        self, n: int, finished: int = 0, learners: frozenset[bytes] | None = None
    ) -> None:
        """Tell the merger how many live learners may contribute (``learners``: which, when
        known) and how many finished training (counted in a round's share, see
        ``protocol.diloco.merge``); may close the round."""
        if self.merger.phase is Phase.MERGING:
            return
        await self._apply(
            self.merger.set_expected(n, now=self.clock(), finished=finished, learners=learners)
        )

    @property
    def merges_done(self) -> int:
        return self.counts.merges_done

    @property
    def merges(self) -> list[str]:
        """Why each of the latest merges (up to ``OwnerCounts.RECENT``) closed, oldest first."""
        return list(self.counts.recent)

    @property
    def penalties(self) -> collections.defaultdict[bytes, collections.Counter[str]]:
        return self.counts.penalties

    @property
    def merge_seconds(self) -> float:
        return self.counts.merge_seconds

    async def wait_after(self, after: int, wait_s: float) -> Sealed | None:
        """The sealed state of the first version above ``after``, waiting up to ``wait_s``.

        None on timeout, or at once when this peer stops owning the fragment (``retire``), so
        long-polls move to the new owner without waiting out their timeout.
        """
        async with self._changed:
            try:
                async with asyncio.timeout(wait_s):
                    await self._changed.wait_for(lambda: self.version > after or self.retired)
            except TimeoutError:
                return None
            return None if self.version <= after else self.latest

    # --- the timer -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Call ``tick`` at the merger's deadline, forever (cancel to stop)."""
        while True:
            deadline = self.merger.deadline()
            self._wake.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass
            await self.tick()

    async def tick(self) -> None:
        """If the merger's deadline has passed, tell it (it may close the round and merge)."""
        deadline = self.merger.deadline()
        if deadline is not None and self.clock() >= deadline:
            await self._apply(self.merger.on_tick(self.clock()))

    # --- merge ---------------------------------------------------------------------------------
    async def _apply(self, decision: Decision) -> None:
        """Carry out a merger decision: merge (and keep merging while it says so), wake the timer."""
        while decision.kind == "merge":
            decision = await self._merge(decision)
        self._wake.set()

    async def _merge(self, decision: Decision) -> Decision:
        """Make, hand to a replica and publish the next version; a failure is the merger's to
        retry without the work it names."""
        t0 = self.clock()
        work = Work.of(decision, self.outer_cfg.aggregate)
        # the merged bases as they will be once this merge is published
        merged = self.held.merged_with(
            (e.peer, self.version - e.staleness) for e in decision.entries
        )
        carry = self._carried(self.version + 1)  # read here, on the event loop: intake changes them
        try:  # one worker-thread hop: the outer step, the sealed version and the replica's state
            nxt = await asyncio.to_thread(
                self.maker.make,
                self.version + 1,
                work,
                merged,
                carry,
                for_replica=self.replicate is not None,
            )
            await self._replicated(nxt, work)
        except MergeFailed as exc:
            return await self._failed(exc)
        except Exception as exc:  # an unforeseen failure must not kill the owner, nor loop forever
            log.exception("fragment %d: merge failed", self.fragment.index)
            failed = self.merger.on_merge_failed(
                f"merge failed: {exc!r}", now=self.clock(), discard=work.peers
            )
            log.warning("fragment %d: %s", self.fragment.index, failed.reason)
            return failed
        self._publish(nxt, merged, work)
        self._count(decision, nxt)
        async with self._changed:
            self._changed.notify_all()
        now = self.clock()
        self.counts.merge_seconds += now - t0
        return self.merger.on_published(self.version, sync_time=now - t0, now=now)

    async def _replicated(self, nxt: NextVersion, work: Work) -> None:
        """Hand ``nxt`` to a replica before it is published. Raises ``Fenced`` when another owner
        has taken over (or this one retired while merging: the successor owns the next version)."""
        if nxt.state is not None and self.replicate is not None:
            fence = await self.replicate(nxt.state, nxt.state_update, nxt.theta_digest)
            if fence is not None:
                raise Fenced(fence, frozenset(work.peers))
        if self.retired:
            raise Fenced(
                f"retired before publishing version {self.version + 1}", frozenset(work.peers)
            )

    async def _failed(self, exc: MergeFailed) -> Decision:
        """Tell the merger a merge failed, dropping the work ``exc`` names, and count it."""
        if isinstance(exc, Rejected):
            self._rejected(exc)
            failed = self.merger.on_merge_failed(exc.reason, now=self.clock(), discard=exc.culprits)
            log.warning(
                "fragment %d: version %d not published: %s",
                self.fragment.index,
                self.version + 1,
                exc.reason,
            )
            return failed
        if isinstance(exc, Fenced):
            self.succession.fenced = exc.reason
            log.warning("fragment %d: stopped publishing: %s", self.fragment.index, exc.reason)
            await self.retire()
            return self.merger.on_merge_failed(exc.reason, now=self.clock(), discard=exc.culprits)
        for peer in exc.culprits:
            self.penalties[peer]["dropped"] += 1
        failed = self.merger.on_merge_failed(exc.reason, now=self.clock(), discard=exc.culprits)
        log.warning("fragment %d: %s", self.fragment.index, failed.reason)
        return failed

    def _publish(self, nxt: NextVersion, merged: dict[bytes, int], work: Work) -> None:
        """Hold ``nxt`` as the latest version, and tell ``on_publish``."""
        held = self.held
        held.set_merged(merged)  # their bases, so that a second send of the same work is refused
        held.theta, held.buffer, held.version, held.latest = (
            nxt.theta,
            nxt.buffer,
            held.version + 1,
            nxt.latest,
        )
        held.update, held.residual = nxt.update, nxt.residual
        self._remember(held.version, nxt.digest, nxt.message_digest)
        self.intake.spare_max = max(4, len(work.deltas))
        for d in work.deltas:  # merged and published: nothing refers to these buffers any more
            self.intake.give_back(d)
        if self.on_publish is not None:
            self.on_publish(self.fragment.index, held.version, nxt.digest)

    def _count(self, decision: Decision, nxt: NextVersion) -> None:
        """Count a published merge per sender, in penalties and standing, and log it."""
        self.counts.merged(decision.reason)
        for e in decision.entries:
            counts = self.penalties[e.peer]
            counts["merged"] += 1
            for flag in ("weight_capped", "steps_bounded", "tokens_bounded"):
                counts[flag] += int(getattr(e, flag))
            counts["clipped"] += int(e.clip < e.work_scale)  # the norm clip bit (clip * work_scale)
            counts["work_capped"] += int(e.work_scale < 1.0)  # covered more than max_work_steps
            counts["late"] += int(e.staleness > 0)  # its round had closed: carried to this one
        for peer in nxt.helped:  # first: the version's one credit is the larger one
            self.penalties[peer]["helped"] += 1
            self.standing.record(peer, Event.HELPED, version=self.version)
        self._note_standing(decision)
        log.info(
            "fragment %d: published version %d (%s)",
            self.fragment.index,
            self.version,
            decision.reason,
        )

    def _rejected(self, exc: Rejected) -> None:
        """Count a rejected candidate against the senders it names (and for those that helped)."""
        for peer in exc.culprits:  # a round dropped whole blames no one of them: no standing lost
            self.penalties[peer]["round_dropped" if exc.whole else "hurt"] += 1
            if not exc.whole:
                self.standing.record(peer, Event.HURT, version=self.version)
        for peer in exc.helped:
            self.penalties[peer]["helped"] += 1
            self.standing.record(peer, Event.HELPED, version=self.version)

    # --- the reference and the standing, which outlive this owner ----------------------------------
    def start_reference(self, handed: Sequence[float], measured: Sequence[float] = ()) -> str:
        """Start the merger's clip reference from a predecessor's (``handed``) when it is plausible
        against ``measured`` (estimates from published updates), else from ``measured``
        (``protocol.diloco.reference``); only before the first merge. Returns why."""
        if self.merges_done:
            return "this owner has merged already: its own reference stands"
        # a norm longer than the fragment itself is no honest reference (``starting_reference``)
        ceiling = norm64(self.theta) if handed or measured else math.inf
        reference, why = starting_reference(handed, measured, ceiling=ceiling)
        if reference:
            self.merger.seed_reference(reference)  # logged for replay when there is a log
        if handed or measured:
            log.info("fragment %d: clip reference: %s", self.fragment.index, why)
        self.reference_note = why
        return why

    def take_standing(self, standing: tuple[tuple[bytes, ...], tuple[float, ...]]) -> None:
        """Take a predecessor's standing per sender key (what this owner saw itself wins); one
        that does not fit ``StandingConfig`` is refused whole, with the reason logged and counted."""
        try:
            self.standing.restore(*standing, version=self.version)
        except ValueError as exc:
            self.counts.recent.append(f"handed standing refused: {exc}")
            log.warning("fragment %d: handed standing refused: %s", self.fragment.index, exc)

    def _carried(self, version: int) -> Carried:
        """The reference and standing to hand to a replica or successor with ``version``."""
        return self.merger.reference(), self.standing.export(version=version)

    def _note_standing(self, decision: Decision) -> None:
        """Count a published merge's outcomes in each sender's standing: the norm clip worst, then
        a claim capped to what the owner can see, else merged cleanly (a late one is not its fault)."""
        for e in decision.entries:
            if e.clip < e.work_scale:
                event = Event.CLIPPED
            elif (
                e.steps_bounded or e.tokens_bounded
            ):  # a claim past what the owner can see (a weight
                # cap is not: it bites whichever honest learner counted the most tokens)
                event = Event.BOUNDED
            else:
                event = Event.MERGED
            self.standing.record(e.peer, event, version=self.version)

    def standing_status(self, lowest: int = 5) -> dict[str, object]:
        """The standing per sender key in short: how many are refused now, the lowest scores."""
        return {
            "keys": len(self.standing),
            "refused": self.standing.below(version=self.version),
            "threshold": self.standing.config.threshold,
            "lowest": [
                {"peer": p.hex()[:16], "score": round(s, 3)}
                for p, s in self.standing.lowest(lowest, version=self.version)
            ],
            "reference": self.reference_note,
        }

    # --- starting from a predecessor -----------------------------------------------------------
    def _before_first_merge(self) -> bool:
        """A predecessor's state may still be taken: no merge is done or under way."""
        return not self.merges_done and self.merger.phase is not Phase.MERGING

    async def catch_up(self, version: int, flat: torch.Tensor) -> bool:
        """Take over a newer version published by the previous owner, before our first merge.

        Returns whether it was taken. Contributions accepted so far stay (their staleness
        counts against the new version; those beyond the staleness bound are dropped).
        """
        if version <= self.version or not self._before_first_merge():
            return False
        if flat.numel() != self.theta.numel() or not all_finite(flat):
            log.warning(
                "fragment %d: the previous owner's version %d is malformed; not taken",
                self.fragment.index,
                version,
            )
            return False
        new = await prepare(
            self.sealer,
            flat,
            version,
            held=self.theta,
            held_version=self.version,
            lr=self.outer_cfg.lr,
        )
        if version <= self.version or not self._before_first_merge():
            return False  # a merge or another catch-up ran while we sealed
        if not self.merger.reference():  # none handed: seed it from the updates between the two
            self.start_reference((), new.measured)
        decision = self.merger.rebase(version, now=self.clock())
        await self._adopt(new, version)
        log.info(
            "fragment %d: caught up with the previous owner at version %d (%s)",
            self.fragment.index,
            version,
            decision.reason,
        )
        await self._apply(decision)
        return True

    async def take_over(self, handed: Handed) -> bool:
        """Start from a state handed over by the previous owner (or to us as its replica), before
        our first merge: the same global fragment, momentum, version and digest, under an epoch
        above it. Returns whether it was taken (it must not be behind what we hold)."""
        if handed.version < self.version or not self._before_first_merge():
            return False
        new = await prepare(
            self.sealer,
            handed.theta,
            handed.version,
            held=self.theta,
            held_version=self.version,
            lr=self.outer_cfg.lr,
        )
        if handed.version < self.version or not self._before_first_merge():
            return False
        if new.digest != handed.digest:
            log.warning(
                "fragment %d: handed version %d does not hash to its digest; not taken",
                self.fragment.index,
                handed.version,
            )
            return False
        now = self.clock()
        if handed.final and self.merger.count:  # late work: the predecessor's learners left
            self.merger.drop_round(
                f"version {handed.version} was handed out as final by the previous owner", now=now
            )
        decision = (
            self.merger.rebase(handed.version, now=now) if handed.version > self.version else None
        )
        await self._adopt(new, handed.version, handed)
        log.info(
            "fragment %d: took over version %d with its momentum (epoch %d)",
            self.fragment.index,
            handed.version,
            self.epoch,
        )
        if handed.final:
            self.hold_final(handed.version)
        if (decision is None or decision.kind != "merge") and self.merger.held_until is not None:
            decision = self.merger.hold_until(now, now=now)  # the predecessor's state is in
        if decision is not None:
            await self._apply(decision)
        return True

    async def _adopt(self, new: Prepared, version: int, handed: Handed | None = None) -> None:
        """Hold a predecessor's state ``new`` as ``version`` (with what ``handed`` carries: its
        momentum, epoch, merged bases, reference and standing), and wake the long-polls."""
        held = self.held
        held.theta, held.version, held.latest = new.theta, version, new.latest
        held.update, held.residual = None, None  # the residual is not handed over: it starts at 0
        if handed is not None:
            held.buffer = (
                None if handed.momentum is None else handed.momentum.detach().float().clone()
            )
            held.epoch = max(held.epoch, handed.epoch + 1)
            held.take_merged(handed.merged)
            self.start_reference(handed.norms, new.measured)  # the predecessor's, when plausible
            self.take_standing(handed.standing)
        if self.log is not None:
            self.log.note_state(held.theta, held.buffer)
        self._remember(version, new.digest, new.message_digest)
        async with self._changed:
            self._changed.notify_all()

    def hold_first_merge(self, seconds: float) -> None:
        """Merge nothing for ``seconds`` unless the previous owner's state comes first (a handoff,
        ``take_over``, releases the hold). A new owner whose predecessor may still be alive calls
        this before any contribution: merging first would make a version the predecessor's
        learners never see, and at the end of a run fork the swarm off a version it handed out
        as final. Contributions are accepted meanwhile and merge once the hold ends."""
        if self.merges_done or self.merger.phase is Phase.MERGING:
            return
        now = self.clock()
        self.merger.hold_until(now + seconds, now=now)  # setting a hold never merges
        self._wake.set()

    # --- the end of a run, and of this term ------------------------------------------------------
    def idle(self) -> bool:
        """No contribution is waiting and no merge is running: the latest version is final."""
        return self.merger.phase is Phase.COLLECTING and self.merger.count == 0

    def declare_final(self) -> Sealed:
        """The latest version, handed out as final (call when ``idle`` and no learner is left):
        contributions are refused for ``FINAL_HOLD_S`` after (``final_hold``)."""
        declared = self.final_declared
        if declared is None or declared[0] != self.version:
            log.info("fragment %d: version %d is final", self.fragment.index, self.version)
        if self.succession.declare(self.version):
            self._held_final()
        return self.latest

    def hold_final(self, version: int) -> None:
        """Hold ``version`` final as the previous owner did (its handoff said so): learners that
        ended their run took it from that owner, so work is refused here for the hold too."""
        if version != self.version:
            return
        log.info(
            "fragment %d: version %d was handed out as final by the previous owner; holding it final",
            self.fragment.index,
            version,
        )
        if self.succession.declare(version):
            self._held_final()

    def _held_final(self) -> None:
        """The latest version is newly held final: tell ``on_final`` (the node hands that on to
        the fragment's replica, so a replica taking over within the hold holds it final too)."""
        if self.on_final is not None:
            self.on_final(self)

    def holds_final(self) -> bool:
        """Whether the latest version was handed out as final and the hold has not lapsed."""
        return self.succession.holds_final(self.version)

    def final_hold(self) -> str | None:
        """Why a contribution is refused now (``Succession.final_hold``), or None."""
        return self.succession.final_hold()

    async def retire(self, *, finish_merge_s: float = 0.0) -> None:
        """This peer no longer owns the fragment: release every long-poll (and close the log).

        ``finish_merge_s``: first let a merge under way finish (up to that long), so the version
        its replica may already hold is published and in the state handed to the successor; a
        merge still running after that does not publish."""
        if finish_merge_s > 0 and self.merger.phase is Phase.MERGING:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(finish_merge_s):
                    while self.merger.phase is Phase.MERGING:
                        await asyncio.sleep(0.01)
        self.succession.retire()
        if self.log is not None:
            self.log.close()
        async with self._changed:
            self._changed.notify_all()

    async def wait_retired(self) -> None:
        await self.succession.wait_retired()

    # --- the whole state, handed on ----------------------------------------------------------------
    def snapshot(self) -> ReplicaState:
        """The whole state at the latest version (handed to the successor when retiring), marked
        final while this owner holds that version final (``holds_final``)."""
        held = self.held
        return self.sealer.replica_state(
            held.version,
            held.digest_of(held.version),
            held.theta,
            held.buffer,
            dict(held.merged_base),
            epoch=held.epoch,
            carry=self._carried(held.version),
            final=self.holds_final(),
        )

    def state(self) -> Handed:
        """The whole state at the latest version, as held (for an owner checkpoint)."""
        held = self.held
        norms, standing = self._carried(held.version)
        return Handed(
            self.fragment.index,
            held.epoch,
            held.version,
            held.digest_of(held.version),
            held.theta,
            held.buffer,
            self.signer.peer_id,
            dict(held.merged_base),
            norms=norms,
            standing=standing,
        )


def _merger(
    config: OwnerConfig, version: int, now: float
) -> tuple[FragmentMerger, LoggedMerger | None]:
    """The owner's merger, and with ``config.event_log`` the log every call and decision of it
    is written to for ``atoll replay`` (the merger is then that log)."""
    merger = FragmentMerger(config.fragment.index, config.merge, version=version, now=now)
    if config.event_log is None:
        return merger, None
    content = Content(
        shapes=list(config.shapes),
        download_codec=config.download_codec,
        outer=config.outer,
        embedding=config.fragment.is_embedding,
        update_codec=config.update_codec,
        block_size=config.block_size,
    )
    logged = LoggedMerger(
        merger,
        config.event_log,
        fragment=config.fragment.index,
        config=config.merge,
        version=version,
        now=now,
        content=content,
    )
    return cast(FragmentMerger, logged), logged
