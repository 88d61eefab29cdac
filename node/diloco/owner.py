"""The owner of a fragment: drives ``protocol.diloco.merge`` and publishes global versions.

For each fragment this peer owns, a ``FragmentOwner`` is composed of parts, each owning its piece:
- ``OwnerState`` (``node.diloco.owner_state``): the global fragment Θ_p as one flat fp32 vector,
  its Nesterov buffer, version, sealed forms and the digests that name it; the only state the
  parts share;
- the ``FragmentMerger`` state machine (written to an event log for ``atoll replay`` when asked);
- ``ContributionIntake`` (``node.diloco.intake``): measures each contribution (kept compressed,
  ``protocol.diloco.sliced``) and says why it is refused before the merger
  (``protocol.diloco.intake``);
- ``VersionMaker`` (``node.diloco.merging``): the next version's outer step, check and seal, off
  the event loop; ``Sealer`` (``node.diloco.sealing``): seals with the owner's key;
- ``Reputation`` (``node.diloco.reputation``): standing and penalties per sender, the clip
  reference's source;
- ``Succession`` (``node.diloco.succession``): taking over from a predecessor, the final hold,
  retiring.
The owner feeds the merger with ``now`` from its ``clock`` (``time.monotonic``; tests pass a fake
one), carries out what it decides, and wakes every long-poll waiting for a version; the timer
task calls ``tick`` at the merger's deadline.

A merge that fails (a non-finite aggregate or result, or any unforeseen error) drops the
contributions that caused it (every one of them: no single one is to blame, since each was
checked for shape, finiteness and a finite norm on arrival), with the reason logged, and the
merger retries with the rest: the same failing set is never retried. When validation declines a
candidate, the senders whose work it drops are told at their next long-poll (``wait_after`` with
``asker``: ``Declined``): a synchronous learner, which waits for the version, goes on from the
version it holds at once instead of sending the refused work again after a silence. A new owner that catches up
with its predecessor's newer version keeps the contributions it already accepted
(``FragmentMerger.rebase``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from node.diloco.eventlog import Content, LoggedMerger
from node.diloco.flat import flat_digest
from node.diloco.intake import ContributionIntake
from node.diloco.merging import Fenced, MergeFailed, NextVersion, Rejected, VersionMaker, Work
from node.diloco.owner_state import OwnerConfig, OwnerCounts, OwnerStart, OwnerState
from node.diloco.replica import Carried, Handed
from node.diloco.reputation import Reputation
from node.diloco.sealing import Sealer
from node.diloco.succession import FINAL_HOLD_S, Succession, Taken
from node.diloco.validation import OwnerValidation
from protocol.diloco.activity import LearnerActivity
from protocol.diloco.fragments import Fragment
from protocol.diloco.merge import Decision, FragmentMerger, Phase
from protocol.diloco.outer import OuterConfig
from protocol.diloco.reference import HandedNorm
from protocol.diloco.sliced import Delta
from protocol.diloco.standing import Standing
from protocol.errors import DecodeError, Stale
from protocol.wire.messages import Ack, Contribution, ReplicaState
from protocol.wire.signing import Sealed, Signer

__all__ = [
    "FINAL_HOLD_S",
    "Declined",
    "FragmentOwner",
    "MergeFailed",
    "OwnerConfig",
    "OwnerClocks",
    "OwnerCounts",
    "OwnerHooks",
    "OwnerStart",
]

log = logging.getLogger(__name__)

Replicate = Callable[[ReplicaState, ReplicaState | None, bytes | None], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class Declined:
    """A long-poll's answer to a sender whose work a declined candidate dropped: its work on
    ``base`` is in no version and will be in none (validation refused it)."""

    base: int


@dataclass(frozen=True, slots=True)
class OwnerHooks:
    """What an owner calls out to. ``replicate``: hands each next version's whole state to a
    replica before it is published (and the same state as an update over the version before,
    when there is one, and the BLAKE3 of the state's fp32 bytes when its seal computed that
    already), returning None when a replica took it (or none can) and the reason when this owner
    has been replaced ("fenced: ..."), after which it stops publishing and retires;
    ``on_publish``: called with (fragment, version, digest) of each published version;
    ``on_final``: called with the owner the first time its latest version is held final (handed
    out as final here, or taken over as final from the previous owner). None: nobody is told."""

    replicate: Replicate | None = None
    on_publish: Callable[[int, int, bytes], None] | None = None
    on_final: Callable[[FragmentOwner], None] | None = None


@dataclass(frozen=True, slots=True)
class OwnerClocks:
    """An owner's two clocks: ``monotonic`` times the merger's rounds and deadlines (tests pass
    a fake one); ``wall`` stamps the seals peers check for freshness."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


class FragmentOwner:
    """Merges contributions for one fragment and serves its versions."""

    def __init__(
        self,
        config: OwnerConfig,
        start: OwnerStart,
        *,
        signer: Signer,
        hooks: OwnerHooks = OwnerHooks(),
        clocks: OwnerClocks = OwnerClocks(),
        validation: OwnerValidation | None = None,
    ) -> None:
        """``hooks``: what it calls out to (``OwnerHooks``); ``validation``: check each
        candidate version on the swarm's validation set before publishing it
        (``node.diloco.validation``; None: off)."""
        clock = clocks.monotonic
        self.config, self.clock = config, clock
        self.replicate, self.on_publish, self.on_final = (
            hooks.replicate,
            hooks.on_publish,
            hooks.on_final,
        )
        self.sealer = Sealer(config, signer, clocks.wall)
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
            log=self.log,
        )
        self.held.note_state()
        self.held.remember(start.version, *digests, flat_digest(theta))  # and v0 unrounded (bf16)
        self.counts = OwnerCounts(config.fragment.index)  # what outlives this owner once retired
        self.intake = ContributionIntake(config, self.held)
        self.maker = VersionMaker(config, self.held, self.sealer, validation, self.log, self.counts)
        self.reputation = Reputation(config.fragment.index, self.merger, self.counts)
        self.succession = Succession(
            config, self.held, self.sealer, self.reputation, clock=clock, on_final=self._held_final
        )
        # when each sender's contributions were taken: a member claiming to learn that has long
        # sent nothing is not waited for (``protocol.diloco.activity``)
        self.activity = LearnerActivity(min_steps=config.round_steps)
        self.not_waited_for: dict[bytes, float] = {}  # members found silent, and when logged
        self.start_reference(start.reference, start.measured)
        if start.standing is not None:
            self.reputation.take_standing(start.standing, version=start.version)
        self._background: set[asyncio.Task[None]] = set()  # merges started by ``receive``
        # sender -> the base of its work a declined candidate dropped, until its next long-poll
        # is told or it sends again (at most one entry per sender that was in a round)
        self._declined: dict[bytes, int] = {}
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

    @property
    def standing(self) -> Standing:
        return self.reputation.standing

    @property
    def reference_note(self) -> str:
        return self.reputation.reference_note

    def start_reference(
        self, handed: Sequence[HandedNorm | float], measured: Sequence[float] = ()
    ) -> str:
        """Start the merger's clip reference (``Reputation.start_reference``); returns why."""
        return self.reputation.start_reference(handed, measured, theta=self.theta)

    def standing_status(self, lowest: int = 5) -> dict[str, object]:
        """The standing per sender key in short (``Reputation.status``)."""
        return self.reputation.status(version=self.version, lowest=lowest)

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
        return self._ack(decision)

    def _ack(self, decision: Decision) -> Ack:
        """The answer to a contribution the merger decided on: an accepted one names the round
        it joined (its sender sends that fragment again once the round's version has come),
        a refused one the version held."""
        version = decision.joined if decision.accepted else self.version
        return Ack(accepted=decision.accepted, reason=decision.reason, version=version)

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
        ack = self._ack(decision)
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
        if (low := self.reputation.refused(sender, version=version)) is not None:  # also free
            return Ack(accepted=False, reason=f"fragment {index}: {low}", version=version)
        if msg.base_version > version:
            raise Stale(f"base version {msg.base_version} is ahead of the owner's {version}")
        try:  # malformed: a 4xx, whatever its base
            flat, norm = await asyncio.to_thread(self.intake.decode, msg, given)
        except DecodeError:  # NaN/Inf or a wrong shape: counts against the (authenticated) sender
            self.reputation.malformed(sender, version=self.version)
            raise
        refused = self.intake.screen(sender, msg, norm, self.merger.norm_reference())
        if refused is not None:
            self.intake.give_back(flat)
            if refused.counted == "out_of_bounds":  # acknowledged as taken, it was a free shot
                self.reputation.malformed(sender, version=self.version, counted=refused.counted)
                log.info("fragment %d: %s (from %s)", index, refused.reason, sender.hex()[:8])
            else:
                penalties[sender][f"refused_{refused.counted}"] += 1
                log.info("fragment %d: %s", index, refused.reason)
            return Ack(accepted=False, reason=refused.reason, version=self.version)
        return self._offer(sender, msg, flat, norm)

    def _offer(self, sender: bytes, msg: Contribution, flat: Delta, norm: float) -> Decision:
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
            self._declined.pop(sender, None)  # new work: what was declined is behind it
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

    async def wait_after(
        self, after: int, wait_s: float, *, asker: bytes | None = None
    ) -> Sealed | Declined | None:
        """The sealed state of the first version above ``after``, waiting up to ``wait_s``.

        None on timeout, or at once when this peer stops owning the fragment (``retire``), so
        long-polls move to the new owner without waiting out their timeout. ``asker``: the
        (authenticated) learner asking: when validation declined a candidate holding its work,
        ``Declined`` at once, told once.
        """

        def ready() -> bool:
            return self.version > after or self.retired or asker in self._declined

        async with self._changed:
            try:
                async with asyncio.timeout(wait_s):
                    await self._changed.wait_for(ready)
            except TimeoutError:
                return None
            if self.version > after:
                return self.latest  # the learner adopts it; a decline left is told next time
            declined = self._declined.pop(asker, None) if asker is not None else None
            return None if declined is None else Declined(declined)

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
            return await self._failed(exc, decision)
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

    async def _failed(self, exc: MergeFailed, decision: Decision) -> Decision:
        """Tell the merger a merge failed, dropping the work ``exc`` names, and count it; tell
        the senders of a declined candidate's dropped work (``decision``: the round's)."""
        if isinstance(exc, Rejected):
            await self._decline(exc.culprits, decision)
            self.reputation.rejected(
                exc.culprits,
                exc.helped,
                whole=exc.whole,
                version=self.version,
                severity=exc.severity,
            )
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
        self.reputation.dropped(exc.culprits)
        failed = self.merger.on_merge_failed(exc.reason, now=self.clock(), discard=exc.culprits)
        log.warning("fragment %d: %s", self.fragment.index, failed.reason)
        return failed

    async def _decline(self, dropped: frozenset[bytes], decision: Decision) -> None:
        """Note the bases of ``dropped`` senders' work in ``decision`` for their next long-poll
        (``wait_after``), and wake the long-polls waiting now."""
        for e in decision.entries:
            if e.peer in dropped:
                self._declined[e.peer] = self.version - e.staleness
        async with self._changed:
            self._changed.notify_all()

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
        held.remember(held.version, nxt.digest, nxt.message_digest)
        self.intake.spare_max = max(4, len(work.deltas))
        for d in work.deltas:  # merged and published: nothing refers to these buffers any more
            self.intake.give_back(d)
        if self.on_publish is not None:
            self.on_publish(self.fragment.index, held.version, nxt.digest)

    def _count(self, decision: Decision, nxt: NextVersion) -> None:
        """Count a published merge, per sender too, and log it."""
        self.counts.merged(decision.reason)
        self.reputation.published(decision, nxt.helped, version=self.version, dissent=nxt.dissent)
        log.info(
            "fragment %d: published version %d (%s)",
            self.fragment.index,
            self.version,
            decision.reason,
        )

    def _carried(self, version: int) -> Carried:
        """The reference and standing to hand to a replica or successor with ``version``."""
        return self.reputation.carried(version)

    # --- starting from a predecessor -----------------------------------------------------------
    async def catch_up(self, version: int, flat: torch.Tensor) -> bool:
        """Take over a newer version published by the previous owner, before our first merge
        (``Succession.catch_up``). Returns whether it was taken."""
        return await self._took(await self.succession.catch_up(version, flat))

    async def take_over(self, handed: Handed) -> bool:
        """Start from a state handed over by the previous owner (or to us as its replica), before
        our first merge (``Succession.take_over``). Returns whether it was taken."""
        return await self._took(await self.succession.take_over(handed))

    async def _took(self, taken: Taken | None) -> bool:
        """Wake the long-polls for a state taken over, and carry out what the merger decided."""
        if taken is None:
            return False
        async with self._changed:
            self._changed.notify_all()
        if taken.decision is not None:
            await self._apply(taken.decision)
        return True

    def hold_first_merge(self, seconds: float) -> None:
        """Merge nothing for ``seconds`` unless the previous owner's state comes first (a handoff,
        ``take_over``, releases the hold). A new owner whose predecessor may still be alive calls
        this before any contribution: merging first would make a version the predecessor's
        learners never see, and at the end of a run fork the swarm off a version it handed out
        as final. Contributions are accepted meanwhile and merge once the hold ends."""
        if self.succession.hold_first_merge(seconds):
            self._wake.set()

    async def release_first_merge(self, why: str) -> bool:
        """End a ``hold_first_merge`` hold before its time (``why``: for the log), and merge what
        waited on it. Returns whether a hold was released."""
        decision = self.succession.release_first_merge()
        if decision is None:
            return False
        log.info("fragment %d: first merge no longer held: %s", self.fragment.index, why)
        await self._apply(decision)
        return True

    # --- the end of a run, and of this term ------------------------------------------------------
    def idle(self) -> bool:
        """No contribution is waiting, no merge is running and no predecessor's state is
        awaited (``hold_first_merge``, by the clock: the merger sees time only at its events):
        the latest version is final. A new owner's version may be behind the one its live
        predecessor is about to hand it."""
        held = self.merger.held_until
        if held is not None and held > self.succession.clock():
            return False
        return self.merger.phase is Phase.COLLECTING and self.merger.count == 0

    def declare_final(self) -> Sealed:
        """The latest version, handed out as final (call when ``idle`` and no learner is left):
        contributions are refused for ``FINAL_HOLD_S`` after (``final_hold``)."""
        return self.succession.declare_final()

    def hold_final(self, version: int) -> None:
        """Hold ``version`` final as the previous owner did (``Succession.hold_final``)."""
        self.succession.hold_final(version)

    def _held_final(self) -> None:
        """The latest version is newly held final: tell ``on_final`` (the node hands that on to
        the fragment's replica, so a replica taking over within the hold holds it final too)."""
        if self.on_final is not None:
            self.on_final(self)

    def holds_final(self) -> bool:
        """Whether the latest version was handed out as final and the hold has not lapsed."""
        return self.succession.holds_final()

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
