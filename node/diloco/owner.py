"""The owner of a fragment: drives ``protocol.diloco.merge`` and publishes global versions.

For each fragment this peer owns, ``FragmentOwner`` holds the global fragment Θ_p (one flat fp32
vector), its Nesterov buffer and version, and a ``FragmentMerger`` state machine. Contributions
arrive through ``rpc`` and are checked, decoded and fed to the merger (``node.diloco.intake``)
with ``now`` from the owner's ``clock`` (``time.monotonic``; tests pass a fake one). The timer
task calls ``tick`` at the merger's deadline. When the merger says "merge", the owner aggregates
(the configured aggregate, or a weighted mean for embedding fragments) and applies the outer
Nesterov step off the event loop, hands the new state to a replica, seals the new version with
its own key (``node.diloco.sealing``) and wakes every long-poll waiting for it. How its term
starts from a predecessor's state and ends (finality, retiring) is ``node.diloco.succession``.

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
import dataclasses
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from node.diloco.eventlog import Content, LoggedMerger
from node.diloco.flat import flat_digest
from node.diloco.intake import ContributionIntake
from node.diloco.replica import Carried
from node.diloco.sealing import VersionSealing
from node.diloco.succession import FINAL_HOLD_S, OwnerSuccession
from node.diloco.validation import OwnerValidation
from protocol.diloco.activity import LearnerActivity
from protocol.diloco.fragments import Fragment
from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig, Phase
from protocol.diloco.norms import all_finite, norm64
from protocol.diloco.outer import OuterConfig, merge_update
from protocol.diloco.reference import HandedNorm, starting_history
from protocol.diloco.standing import Event, Standing
from protocol.diloco.updates import encode_update
from protocol.wire.messages import Ack, Contribution, ReplicaState
from protocol.wire.signing import Sealed, Signer

__all__ = ["FINAL_HOLD_S", "FragmentOwner", "MergeFailed", "OwnerCounts"]

log = logging.getLogger(__name__)


class MergeFailed(Exception):
    """A merge could not produce a finite global fragment; ``culprits`` are the peers to drop."""

    def __init__(self, reason: str, culprits: frozenset[bytes]) -> None:
        super().__init__(reason)
        self.reason, self.culprits = reason, culprits


MERGED_BASES_KEPT = 100_000  # senders whose newest merged base is remembered


class Rejected(MergeFailed):
    """Validation kept the candidate from being published: ``culprits`` hurt the loss alone (or,
    when none did, are the whole round); ``helped`` lowered it alone."""

    def __init__(
        self, reason: str, culprits: frozenset[bytes], helped: frozenset[bytes], whole: bool
    ) -> None:
        super().__init__(reason, culprits)
        self.helped, self.whole = helped, whole


class Fenced(MergeFailed):
    """A replica refused this owner's next version: another owner has taken over."""


@dataclass(frozen=True, slots=True)
class _Next:
    """A merge's next version, computed off the event loop."""

    theta: torch.Tensor
    buffer: torch.Tensor | None
    latest: Sealed  # the full state, sealed
    digest: bytes  # of the flat state
    message_digest: bytes  # of the sealed full state's message
    state: ReplicaState | None  # the whole state for the replica
    update: Sealed | None = None  # with updates: the sealed update over the version before
    residual: torch.Tensor | None = None  # and the error feedback it leaves
    state_update: ReplicaState | None = None  # ``state`` as that update (no momentum only)
    theta_digest: bytes | None = (
        None  # BLAKE3 of ``state``'s blobs (fp32 theta, no momentum), when known
    )
    helped: frozenset[bytes] = (
        frozenset()
    )  # validation scored their work alone: it lowered the loss


@dataclass
class OwnerCounts:
    """What an owner did, in counts: all a peer keeps of an owner once it retires (its tensors,
    buffers and sealed versions go with it; a peer whose fragments change hands often would
    otherwise hold every retired owner's state). A merge that finishes after the retirement
    still counts here."""

    RECENT = 16  # merge reasons kept (the report shows the last few)

    fragment: int
    merges_done: int = 0
    merge_seconds: float = 0.0  # from each published round's close to its publication, in all
    checks: int = 0  # candidate versions validated before publication (node.diloco.validation)
    rejected: int = 0  # of them, not published
    check_seconds: float = 0.0  # spent evaluating them
    recent: collections.deque[str] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=OwnerCounts.RECENT)
    )
    # per sender: how often a bound bit (clipped, weight_capped, steps_bounded, tokens_bounded, work_capped),
    # its contribution was dropped from a failed merge, or refused (refused_<why>)
    penalties: collections.defaultdict[bytes, collections.Counter[str]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )

    def merged(self, reason: str) -> None:
        self.merges_done += 1
        self.recent.append(reason)

    def fold(self, other: OwnerCounts) -> None:
        """Add ``other``'s counts to these (a peer keeps one ``OwnerCounts`` per fragment for all
        the owners of it it retired, however often the fragment comes and goes)."""
        self.merges_done += other.merges_done
        self.merge_seconds += other.merge_seconds
        self.checks += other.checks
        self.rejected += other.rejected
        self.check_seconds += other.check_seconds
        self.recent.extend(other.recent)
        for peer, counts in other.penalties.items():
            self.penalties[peer].update(counts)


class FragmentOwner(ContributionIntake, VersionSealing, OwnerSuccession):
    """Merges contributions for one fragment and serves its versions."""

    def __init__(
        self,
        *,
        swarm: str,
        fragment: Fragment,
        shapes: Sequence[tuple[int, ...]],
        initial: torch.Tensor,
        version: int = 0,
        merge_cfg: MergeConfig,
        outer_cfg: OuterConfig,
        signer: Signer,
        download_codec: str = "none",
        update_codec: str | None = None,
        block_size: int = 64,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        epoch: int = 0,
        momentum: torch.Tensor | None = None,
        replicate: Callable[
            [ReplicaState, ReplicaState | None, bytes | None], Awaitable[str | None]
        ]
        | None = None,
        on_publish: Callable[[int, int, bytes], None] | None = None,
        on_final: Callable[[FragmentOwner], None] | None = None,
        event_log: Path | None = None,
        merged: Mapping[bytes, int] | None = None,
        round_steps: int = 0,
        validation: OwnerValidation | None = None,
        reference: Sequence[HandedNorm | float] = (),
        measured: Sequence[float] = (),
        standing: tuple[tuple[bytes, ...], tuple[float, ...]] | None = None,
    ) -> None:
        """``epoch``: this ownership's epoch (a takeover starts one above the state it took
        over); ``momentum``: the outer Nesterov buffer taken over with ``initial``;
        ``replicate``: hands each next version's whole state to a replica before it is
        published (and the same state as an update over the version before, when there is one,
        and the BLAKE3 of the state's fp32 bytes when its seal computed that already), returning None when a replica took it (or none can) and the reason when this owner has
        been replaced ("fenced: ..."), after which it stops publishing and retires;
        ``on_final``: called with this owner the first time its latest version is held final
        (handed out as final here, or taken over as final from the previous owner);
        ``merged``: per sender, the newest base version of its work merged into ``initial`` (taken
        over with it), so that work is refused if it is sent again; ``update_codec``: also publish
        each version as an update over the one before, compressed with it (see
        ``protocol.diloco.updates``; the full versions are then fp32, ``download_codec`` none);
        ``round_steps``: the inner steps a learner may train between two contributions to a
        fragment (2H), which tells how long one at work may stay silent
        (``protocol.diloco.activity``); ``validation``: check each candidate version on the
        swarm's validation set before publishing it (``node.diloco.validation``; None: off);
        ``reference``: the predecessor's clip reference (recent accepted norms), taken when it is
        plausible against ``measured``, estimates from published updates this peer could measure
        (``protocol.diloco.reference``), which seed it otherwise; ``standing``: the predecessor's
        standing per sender key (``Standing.export``)."""
        self.clock, self.wall_clock = clock, wall_clock
        self.epoch, self.replicate, self.on_publish, self.on_final = (
            epoch,
            replicate,
            on_publish,
            on_final,
        )
        self.fenced: str | None = None
        self.swarm, self.fragment, self.shapes = swarm, fragment, list(shapes)
        self.theta = initial.detach().float().clone()  # [numel_p] fp32
        # Nesterov momentum, created on first merge (or taken over from the previous owner)
        self.buffer: torch.Tensor | None = (
            None if momentum is None else momentum.detach().float().clone()
        )
        self.outer_cfg, self.signer, self.download_codec = outer_cfg, signer, download_codec
        if update_codec is not None and download_codec != "none":
            raise ValueError(
                "updates are applied to fp32 full versions: download_codec must be none"
            )
        self.update_codec, self.block_size = update_codec, block_size
        # with updates: what the last update rounded away (sent with the next), and the sealed
        # update from version - 1 to version (None until this owner has merged once)
        self.residual: torch.Tensor | None = None
        self.update: Sealed | None = None
        start = clock()
        merger = FragmentMerger(fragment.index, merge_cfg, version=version, now=start)
        # with ``event_log``, every merger call and decision is logged for ``atoll replay``
        content = Content(
            shapes=self.shapes,
            download_codec=download_codec,
            outer=outer_cfg,
            embedding=fragment.is_embedding,
            update_codec=update_codec,
            block_size=block_size,
        )
        self.log = (
            LoggedMerger(
                merger,
                event_log,
                fragment=fragment.index,
                config=merge_cfg,
                version=version,
                now=start,
                content=content,
            )
            if event_log is not None
            else None
        )
        self.merger: FragmentMerger = (
            cast(FragmentMerger, self.log) if self.log is not None else merger
        )
        self.version = version
        # digest of each recent version's state as learners decode it: a contribution is applied
        # only to the state it was measured against (version numbers alone can name two contents)
        self.digests: dict[int, set[bytes]] = {}
        self._state_digest: dict[
            int, bytes
        ] = {}  # the one of them any owner computes: handoffs, fences
        self._merged_base: dict[bytes, int] = dict(
            merged or {}
        )  # sender -> newest base of its merged work
        self.resyncs_owed: dict[bytes, tuple[int, int, bool]] = {}
        self._last_from: set[bytes] = set()  # senders whose last contribution was taken (``last``)
        # when each sender's contributions were taken: a member claiming to learn that has long
        # sent nothing is not waited for (``protocol.diloco.activity``)
        self.activity = LearnerActivity(min_steps=round_steps)
        self.started_at = start
        self.not_waited_for: dict[bytes, float] = {}  # members found silent, and when it was logged
        self._keep_digests = merge_cfg.staleness_bound + 2
        # decoded contributions' buffers, reused once their merge is published (fresh memory is
        # slow to fill); at most as many as the last published merge had contributions
        self._spare: list[torch.Tensor] = []
        self._borrowed: dict[
            int, weakref.ref[torch.Tensor]
        ] = {}  # local contributions' vectors, by id
        self._theta_norm: tuple[weakref.ref[torch.Tensor], float] | None = (
            None  # a merge's result and its norm64
        )
        self._spare_max = 4
        self._background: set[asyncio.Task[None]] = set()  # merges started by ``receive``
        self.latest, *digests = self._seal_state(version, self.theta)
        if self.log is not None:
            self.log.note_state(self.theta, self.buffer)
        self._remember_digests(
            version, *digests, flat_digest(self.theta)
        )  # and v0 unrounded (bf16 download)
        self.counts = OwnerCounts(self.fragment.index)  # what outlives this owner once it retires
        self.validation = validation
        # per sender key: what its work came to here, carried to successors (``protocol.diloco.standing``)
        self.standing = Standing()
        self.reference_note = ""  # where the clip reference came from (status)
        self.start_reference(reference, measured)
        if standing is not None:
            self.take_standing(standing)
        self.step_bounds = 0  # merges whose aggregate was scaled down to max_delta_ratio * |Theta|
        self.retired = False
        self.final_declared: tuple[int, float] | None = (
            None  # (version, when) it was last handed out as final
        )
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._retired_event = asyncio.Event()

    # --- inbound -------------------------------------------------------------------------------
    async def contribute(
        self, sender: bytes, msg: Contribution, flat: torch.Tensor | None = None
    ) -> Ack:
        """Check and feed one contribution to the merger; the merge it completes (if any) has
        run when this returns (``flat``: see ``_decode``). Raises ``RemoteProtocolError``."""
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
        t0 = self.clock()
        deltas = [cast(torch.Tensor, e.payload) for e in decision.entries]  # set by ``contribute``
        weights = [e.weight for e in decision.entries]
        peers = [e.peer for e in decision.entries]
        clips = [e.clip for e in decision.entries]
        norms = [e.norm for e in decision.entries]  # measured by ``_decode``: the merge reuses them
        merged = dict(self._merged_base)  # as it will be once this merge is published
        for e in decision.entries:
            merged[e.peer] = max(merged.get(e.peer, -1), self.version - e.staleness)
        carry = self._carried(self.version + 1)  # read here, on the event loop: intake changes them
        try:  # one worker-thread hop: the outer step, the sealed version and the replica's state
            nxt = await asyncio.to_thread(
                self._next_version,
                self.version + 1,
                peers,
                deltas,
                weights,
                clips,
                merged,
                decision.scale,
                norms,
                decision.aggregate(self.outer_cfg.aggregate),
                carry,
            )
            if nxt.state is not None and self.replicate is not None:
                fence = await self.replicate(nxt.state, nxt.state_update, nxt.theta_digest)
                if fence is not None:
                    raise Fenced(fence, frozenset(peers))
            if (
                self.retired
            ):  # retired while merging (past the wait): the successor owns the next version
                raise Fenced(
                    f"retired before publishing version {self.version + 1}", frozenset(peers)
                )
        except Rejected as exc:
            self._rejected(exc)
            failed = self.merger.on_merge_failed(exc.reason, now=self.clock(), discard=exc.culprits)
            log.warning(
                "fragment %d: version %d not published: %s",
                self.fragment.index,
                self.version + 1,
                exc.reason,
            )
            return failed
        except Fenced as exc:
            self.fenced = exc.reason
            log.warning("fragment %d: stopped publishing: %s", self.fragment.index, exc.reason)
            await self.retire()
            return self.merger.on_merge_failed(exc.reason, now=self.clock(), discard=exc.culprits)
        except MergeFailed as exc:
            for peer in exc.culprits:
                self.penalties[peer]["dropped"] += 1
            failed = self.merger.on_merge_failed(exc.reason, now=self.clock(), discard=exc.culprits)
            log.warning("fragment %d: %s", self.fragment.index, failed.reason)
            return failed
        except Exception as exc:  # an unforeseen failure must not kill the owner, nor loop forever
            log.exception("fragment %d: merge failed", self.fragment.index)
            failed = self.merger.on_merge_failed(
                f"merge failed: {exc!r}", now=self.clock(), discard=peers
            )
            log.warning("fragment %d: %s", self.fragment.index, failed.reason)
            return failed
        self._merged_base = merged  # their bases, so that a second send of the same work is refused
        while len(self._merged_base) > MERGED_BASES_KEPT:
            self._merged_base.pop(next(iter(self._merged_base)))
        self.theta, self.buffer, self.version, self.latest = (
            nxt.theta,
            nxt.buffer,
            self.version + 1,
            nxt.latest,
        )
        self.update, self.residual = nxt.update, nxt.residual
        self._remember_digests(self.version, nxt.digest, nxt.message_digest)
        self._spare_max = max(4, len(deltas))
        for d in deltas:  # merged and published: nothing refers to these buffers any more
            self._give_back(d)
        if self.on_publish is not None:
            self.on_publish(self.fragment.index, self.version, nxt.digest)
        self.counts.merged(decision.reason)
        for e in decision.entries:
            counts = self.penalties[e.peer]
            counts["merged"] += 1
            for flag in ("weight_capped", "steps_bounded", "tokens_bounded"):
                counts[flag] += int(getattr(e, flag))
            counts["clipped"] += int(
                e.clip < e.work_scale
            )  # the norm clip bit (clip is it times work_scale)
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
        async with self._changed:
            self._changed.notify_all()
        now = self.clock()
        self.counts.merge_seconds += now - t0
        return self.merger.on_published(self.version, sync_time=now - t0, now=now)

    def _next_version(
        self,
        version: int,
        peers: list[bytes],
        deltas: list[torch.Tensor],
        weights: list[float],
        clips: list[float],
        merged: Mapping[bytes, int],
        scale: float = 1.0,
        norms: Sequence[float | None] | None = None,
        aggregate: str | None = None,
        carry: Carried | None = None,
    ) -> _Next:
        """The merge's new state, sealed as ``version``, the state to hand to a replica, and with
        updates the sealed update from ``version - 1`` and the new error-feedback residual."""
        theta, buffer = self._outer(peers, deltas, weights, clips, scale, norms, aggregate)
        tensors, residual = None, None
        if self.update_codec is not None:  # publish what learners compute from the update
            tensors, theta, residual = encode_update(
                theta,
                self.theta,
                self.residual,
                self.shapes,
                self.update_codec,
                block_size=self.block_size,
            )
        helped: frozenset[bytes] = frozenset()
        if (
            self.validation is not None
        ):  # before anything is sealed: a rejected candidate leaves no trace
            helped = self._validate(
                version, theta, peers, deltas, weights, clips, scale, norms, aggregate
            )
        checked = (
            tensors is None
        )  # _outer checked theta and buffer; an update's result is checked when sealed
        latest, digest, message_digest = self._seal_state(version, theta, known_finite=checked)
        state = (
            self._replica_state(
                version, digest, theta, buffer, merged, known_finite=checked, carry=carry
            )
            if self.replicate
            else None
        )
        # an fp32 version's state digest is its bytes' BLAKE3, the handoff's blobs when there is no momentum
        theta_digest = digest if self.download_codec == "none" and buffer is None else None
        if tensors is None:
            return _Next(
                theta,
                buffer,
                latest,
                digest,
                message_digest,
                state,
                theta_digest=theta_digest,
                helped=helped,
            )
        update = self._seal_update(version, tensors, digest)
        base_digest = self.digest_of(version - 1)
        state_update = (
            dataclasses.replace(
                state,
                theta=tuple(tensors),
                momentum=(),
                base_version=version - 1,
                base_digest=base_digest,
            )
            if state is not None and buffer is None
            else None
        )
        return _Next(
            theta,
            buffer,
            latest,
            digest,
            message_digest,
            state,
            update,
            residual,
            state_update,
            theta_digest,
            helped,
        )

    def _validate(
        self,
        version: int,
        theta: torch.Tensor,
        peers: list[bytes],
        deltas: list[torch.Tensor],
        weights: list[float],
        clips: list[float],
        scale: float,
        norms: Sequence[float | None] | None,
        aggregate: str | None,
    ) -> frozenset[bytes]:
        """Check the candidate ``theta`` (``node.diloco.validation``); log the check. Returns the
        senders whose work, scored alone, lowered the loss; raises ``Rejected`` when it is not to be
        published."""
        assert self.validation is not None

        def alone() -> dict[bytes, torch.Tensor]:  # per sender, the outer step over its work only
            out: dict[bytes, torch.Tensor] = {}
            for peer in dict.fromkeys(peers):
                mine = [i for i, p in enumerate(peers) if p == peer]
                out[peer] = merge_update(
                    self.theta,
                    self.buffer,
                    [deltas[i] for i in mine],
                    [weights[i] for i in mine],
                    [clips[i] for i in mine],
                    self.outer_cfg,
                    embedding=self.fragment.is_embedding,
                    scale=scale,
                    norms=None if norms is None else [norms[i] for i in mine],
                    aggregate=aggregate,
                ).theta
            return out

        check = self.validation.check(self.fragment.index, version, self.theta, theta, alone)
        if check is None:
            return frozenset()
        self.counts.checks += 1
        self.counts.rejected += int(not check.verdict.publish)
        self.counts.check_seconds += check.seconds
        if self.log is not None:
            self.log.note_validation(check.record)
        verdict = check.verdict
        if not verdict.publish:
            raise Rejected(verdict.reason, verdict.drop, verdict.helped, whole=verdict.whole)
        return verdict.helped

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
    def start_reference(
        self, handed: Sequence[HandedNorm | float], measured: Sequence[float] = ()
    ) -> str:
        """Start the merger's clip reference from a predecessor's (``handed``) when it is plausible
        against ``measured`` (estimates from published updates), else from ``measured``
        (``protocol.diloco.reference``); only before the first merge. Returns why."""
        if self.merges_done:
            return "this owner has merged already: its own reference stands"
        # a norm longer than the fragment itself is no honest reference (``starting_reference``)
        ceiling = norm64(self.theta) if handed or measured else math.inf
        reference, why = starting_history(handed, measured, ceiling=ceiling)  # senders kept
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

    def _outer(
        self,
        peers: list[bytes],
        deltas: list[torch.Tensor],
        weights: list[float],
        clips: list[float],
        scale: float = 1.0,
        norms: Sequence[float | None] | None = None,
        aggregate: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Clip, aggregate, scale, bound and apply the outer step. Raises ``MergeFailed`` naming the
        peers to drop. (Every payload's shape, finiteness and norm were checked by ``_decode``.)"""
        known = self._theta_norm
        update = merge_update(
            self.theta,
            self.buffer,
            deltas,
            weights,
            clips,
            self.outer_cfg,
            embedding=self.fragment.is_embedding,
            scale=scale,
            norms=norms,
            aggregate=aggregate,
            theta_norm=known[1] if known is not None and known[0]() is self.theta else None,
        )
        self.step_bounds += int(update.bounded)
        theta, buffer = update.theta, update.buffer
        theta_norm = norm64(
            theta
        )  # finite exactly when every value is; the next merge's bound needs it
        if not (math.isfinite(theta_norm) and (buffer is None or all_finite(buffer))):
            raise MergeFailed(
                f"the outer step over {len(peers)} contributions is not finite; "
                "no single one is to blame, all are dropped",
                frozenset(peers),
            )
        self._theta_norm = (
            weakref.ref(theta),
            theta_norm,
        )  # used once ``theta`` is the published one
        return theta, buffer
