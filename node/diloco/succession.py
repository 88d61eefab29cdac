"""How an owner's term starts and ends: taking over from its predecessor, finality, retiring.

``OwnerSuccession`` is mixed into ``FragmentOwner`` (which provides the attributes below). A new
owner starts from the state its predecessor handed over (``take_over``: global fragment,
momentum, version and digest, under a higher epoch) or from the newest version it published
(``catch_up``), either only before its own first merge. At the end of a run the latest version
is handed out as final (``declare_final``) and work arriving within ``FINAL_HOLD_S`` after is
refused (``final_hold``); an owner that stops owning the fragment releases every long-poll
(``retire``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from node.diloco.eventlog import LoggedMerger
from node.diloco.replica import Handed
from protocol.diloco.fragments import Fragment
from protocol.diloco.merge import Decision, FragmentMerger, Phase
from protocol.diloco.norms import all_finite, norm64
from protocol.diloco.outer import OuterConfig
from protocol.diloco.reference import HandedNorm, update_norm_estimate
from protocol.wire.signing import Sealed

__all__ = ["FINAL_HOLD_S", "OwnerSuccession", "measured_updates"]

log = logging.getLogger("node.diloco.owner")

# once a version was handed out as final (a learner ending its run takes it and leaves), work that
# arrives this long after is refused: merging it would leave that learner on another model. An
# idle swarm that someone joins later merges again once the hold lapses
FINAL_HOLD_S = 120.0
# two states further apart than this many versions tell little of one update's norm: successive
# updates partly cancel, so the displacement per version shrinks with the gap
MAX_MEASURED_GAP = 4


def measured_updates(
    then: torch.Tensor, then_version: int, now: torch.Tensor, now_version: int, *, lr: float
) -> list[float]:
    """Per-version update norm estimates between two states of a fragment this peer holds (none
    when they are the same version, or too far apart to tell one update's size): what checks or
    seeds a new owner's clip reference (``protocol.diloco.reference``)."""
    if not 0 < now_version - then_version <= MAX_MEASURED_GAP or then.numel() != now.numel():
        return []
    estimate = update_norm_estimate(norm64(now - then), now_version - then_version, lr=lr)
    return [] if estimate is None else [estimate]


class OwnerSuccession:
    """The succession side of ``FragmentOwner``."""

    fragment: Fragment
    theta: torch.Tensor
    buffer: torch.Tensor | None
    version: int
    epoch: int
    latest: Sealed
    update: Sealed | None
    residual: torch.Tensor | None
    merger: FragmentMerger
    log: LoggedMerger | None
    clock: Callable[[], float]
    retired: bool
    final_declared: tuple[int, float] | None
    on_final: Callable[[Any], None] | None  # called with the FragmentOwner
    _merged_base: dict[bytes, int]
    outer_cfg: OuterConfig
    _changed: asyncio.Condition
    _retired_event: asyncio.Event
    _wake: asyncio.Event

    if TYPE_CHECKING:  # FragmentOwner's and VersionSealing's

        @property
        def merges_done(self) -> int: ...

        async def _apply(self, decision: Decision) -> None: ...

        def start_reference(
            self, handed: Sequence[HandedNorm | float], measured: Sequence[float] = ()
        ) -> str: ...

        def take_standing(self, standing: tuple[tuple[bytes, ...], tuple[float, ...]]) -> None: ...

        def _seal_state(
            self,
            version: int,
            theta: torch.Tensor,
            *,
            known_finite: bool = False,
        ) -> tuple[Sealed, bytes, bytes]: ...

        def _remember_digests(self, version: int, state_digest: bytes, *others: bytes) -> None: ...

    # --- starting from a predecessor -----------------------------------------------------------
    async def catch_up(self, version: int, flat: torch.Tensor) -> bool:
        """Take over a newer version published by the previous owner, before our first merge.

        Returns whether it was taken. Contributions accepted so far stay (their staleness
        counts against the new version; those beyond the staleness bound are dropped).
        """
        if version <= self.version or self.merges_done or self.merger.phase is Phase.MERGING:
            return False
        if flat.numel() != self.theta.numel() or not all_finite(flat):
            log.warning(
                "fragment %d: the previous owner's version %d is malformed; not taken",
                self.fragment.index,
                version,
            )
            return False
        theta = flat.detach().float().clone()
        latest, *digests = await asyncio.to_thread(self._seal_state, version, theta)
        measured = await asyncio.to_thread(
            self._measure_updates, self.theta, self.version, theta, version
        )
        if version <= self.version or self.merges_done or self.merger.phase is Phase.MERGING:
            return False  # a merge or another catch-up ran while we sealed
        if not self.merger.reference():  # none handed: seed it from the updates between the two
            self.start_reference((), measured)
        decision = self.merger.rebase(version, now=self.clock())
        self.theta, self.version, self.latest = theta, version, latest
        self.update, self.residual = None, None
        if self.log is not None:
            self.log.note_state(self.theta, self.buffer)
        self._remember_digests(version, *digests)
        async with self._changed:
            self._changed.notify_all()
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
        if handed.version < self.version or self.merges_done or self.merger.phase is Phase.MERGING:
            return False
        theta = handed.theta.detach().float().clone()
        latest, digest, message_digest = await asyncio.to_thread(
            self._seal_state, handed.version, theta
        )
        measured = await asyncio.to_thread(
            self._measure_updates, self.theta, self.version, theta, handed.version
        )
        if handed.version < self.version or self.merges_done or self.merger.phase is Phase.MERGING:
            return False
        if digest != handed.digest:
            log.warning(
                "fragment %d: handed version %d does not hash to its digest; not taken",
                self.fragment.index,
                handed.version,
            )
            return False
        now = self.clock()
        if (
            handed.final and self.merger.count
        ):  # late work: the predecessor's learners left without it
            self.merger.drop_round(
                f"version {handed.version} was handed out as final by the previous owner", now=now
            )
        decision = (
            self.merger.rebase(handed.version, now=now) if handed.version > self.version else None
        )
        self.theta, self.version, self.latest = theta, handed.version, latest
        self.update, self.residual = (
            None,
            None,
        )  # the residual is not handed over: it starts at zero
        self.buffer = None if handed.momentum is None else handed.momentum.detach().float().clone()
        self.epoch = max(self.epoch, handed.epoch + 1)
        for peer, base in handed.merged.items():
            if self._merged_base.get(peer, -1) < base:
                self._merged_base[peer] = base
        self.start_reference(handed.norms, measured)  # the predecessor's reference, when plausible
        self.take_standing(handed.standing)
        if self.log is not None:
            self.log.note_state(self.theta, self.buffer)
        self._remember_digests(handed.version, digest, message_digest)
        async with self._changed:
            self._changed.notify_all()
        log.info(
            "fragment %d: took over version %d with its momentum (epoch %d)",
            self.fragment.index,
            handed.version,
            self.epoch,
        )
        if handed.final:
            self.hold_final(handed.version)
        if (decision is None or decision.kind != "merge") and self.merger.held_until is not None:
            decision = self.merger.hold_until(
                now, now=now
            )  # the predecessor's state is in: merge freely
        if decision is not None:
            await self._apply(decision)
        return True

    def _measure_updates(
        self, then: torch.Tensor, then_version: int, now: torch.Tensor, now_version: int
    ) -> list[float]:
        return measured_updates(then, then_version, now, now_version, lr=self.outer_cfg.lr)

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
        newly = not self.holds_final()
        if self.final_declared is None or self.final_declared[0] != self.version:
            log.info("fragment %d: version %d is final", self.fragment.index, self.version)
        self.final_declared = (self.version, self.clock())
        if newly:
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
        newly = not self.holds_final()
        self.final_declared = (version, self.clock())
        if newly:
            self._held_final()

    def _held_final(self) -> None:
        """The latest version is newly held final: tell ``on_final`` (the node hands that on to
        the fragment's replica, so a replica taking over within the hold holds it final too)."""
        if self.on_final is not None:
            self.on_final(self)

    def holds_final(self) -> bool:
        """Whether the latest version was handed out as final and the hold has not lapsed."""
        return (
            self.final_declared is not None
            and self.final_declared[0] == self.version
            and self.final_hold() is not None
        )

    def final_hold(self) -> str | None:
        """Why a contribution is refused now: a final version was handed out under ``FINAL_HOLD_S``
        ago, to learners that took it and left; merging would fork them off the rest."""
        if self.final_declared is None:
            return None
        version, at = self.final_declared
        age = self.clock() - at
        if age >= FINAL_HOLD_S:
            return None
        return (
            f"fragment {self.fragment.index}: version {version} was handed out as final "
            f"{age:.1f} s ago (the swarm's run ended); contribution not merged, "
            f"take the final version instead"
        )

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
        self.retired = True
        if self.log is not None:
            self.log.close()
        async with self._changed:
            self._changed.notify_all()
        self._retired_event.set()

    async def wait_retired(self) -> None:
        await self._retired_event.wait()
