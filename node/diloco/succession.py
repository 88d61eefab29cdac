"""How an owner's term starts and ends: taking over from its predecessor, finality, retiring.

A new owner starts from the state its predecessor handed over (``take_over``: global fragment,
momentum, version and digest, under a higher epoch) or from the newest version it published
(``catch_up``), either only before its own first merge. At the end of a run the latest version
is handed out as final (``declare_final``) and work arriving within ``FINAL_HOLD_S`` after is
refused (``final_hold``, ``protocol.diloco.intake.FinalHold``); an owner that stops owning the
fragment, or is fenced off by a successor, retires. ``Succession`` changes the owner's state
and merger and returns what the merger then decided, for the owner to carry out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.diloco.owner_state import OwnerConfig, OwnerState
from node.diloco.replica import Handed
from node.diloco.reputation import Reputation
from node.diloco.sealing import Sealer
from protocol.diloco.intake import FINAL_HOLD_S, FinalHold
from protocol.diloco.merge import Decision, Phase
from protocol.diloco.norms import all_finite, norm64
from protocol.diloco.reference import update_norm_estimate
from protocol.wire.signing import Sealed

__all__ = ["FINAL_HOLD_S", "Succession", "Taken", "measured_updates"]

log = logging.getLogger("node.diloco.owner")

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


@dataclass(frozen=True, slots=True, eq=False)
class _Prepared:
    """A predecessor's state, copied and sealed by this owner, ready to be taken."""

    theta: torch.Tensor
    latest: Sealed
    digest: bytes  # of the state as learners decode it
    message_digest: bytes  # of the sealed message
    measured: list[float]  # update norm estimates from the state held to this one


async def _prepare(
    sealer: Sealer,
    flat: torch.Tensor,
    version: int,
    *,
    held: torch.Tensor,
    held_version: int,
    lr: float,
) -> _Prepared:
    """Copy ``flat`` as ``version``, seal it and measure the updates from ``held`` (at
    ``held_version``) to it, each off the event loop."""
    theta = flat.detach().float().clone()
    latest, digest, message_digest = await asyncio.to_thread(sealer.state, version, theta)
    measured = await asyncio.to_thread(measured_updates, held, held_version, theta, version, lr=lr)
    return _Prepared(theta, latest, digest, message_digest, measured)


@dataclass(frozen=True, slots=True)
class Taken:
    """A predecessor's state was taken; ``decision``: what the merger then decided (None:
    nothing to carry out)."""

    decision: Decision | None


class Succession:
    """One owner's term: taking over a predecessor's state, its final hold, retiring."""

    def __init__(
        self,
        config: OwnerConfig,
        held: OwnerState,
        sealer: Sealer,
        reputation: Reputation,
        *,
        clock: Callable[[], float],
        on_final: Callable[[], None],
    ) -> None:
        """``reputation``: the owner's record of its senders, whose merger and counts are the
        ones a takeover rebases and retiring reads; ``on_final``: called the first time the
        latest version is held final."""
        self.fragment, self.lr = config.fragment.index, config.outer.lr
        self.held, self.sealer, self.reputation, self.clock = held, sealer, reputation, clock
        self.merger, self.counts = reputation.merger, reputation.counts
        self.on_final = on_final
        self.hold = FinalHold()
        self.retired = False
        self.fenced: str | None = None  # why this owner stopped publishing
        self._retired_event = asyncio.Event()

    # --- starting from a predecessor -----------------------------------------------------------
    def before_first_merge(self) -> bool:
        """A predecessor's state may still be taken: no merge is done or under way."""
        return not self.counts.merges_done and self.merger.phase is not Phase.MERGING

    async def catch_up(self, version: int, flat: torch.Tensor) -> Taken | None:
        """Take over a newer version published by the previous owner, before our first merge
        (None: not taken). Contributions accepted so far stay (their staleness counts against
        the new version; those beyond the staleness bound are dropped)."""
        held = self.held
        if version <= held.version or not self.before_first_merge():
            return None
        if flat.numel() != held.theta.numel() or not all_finite(flat):
            log.warning(
                "fragment %d: the previous owner's version %d is malformed; not taken",
                self.fragment,
                version,
            )
            return None
        new = await self._prepare(flat, version)
        if version <= held.version or not self.before_first_merge():
            return None  # a merge or another catch-up ran while we sealed
        if not self.merger.reference():  # none handed: seed it from the updates between the two
            self.reputation.start_reference((), new.measured, theta=held.theta)
        decision = self.merger.rebase(version, now=self.clock())
        self._adopt(new, version)
        log.info(
            "fragment %d: caught up with the previous owner at version %d (%s)",
            self.fragment,
            version,
            decision.reason,
        )
        return Taken(decision)

    async def take_over(self, handed: Handed) -> Taken | None:
        """Start from a state handed over by the previous owner (or to us as its replica), before
        our first merge: the same global fragment, momentum, version and digest, under an epoch
        above it (None: not taken; it must not be behind what we hold)."""
        held = self.held
        if handed.version < held.version or not self.before_first_merge():
            return None
        new = await self._prepare(handed.theta, handed.version)
        if handed.version < held.version or not self.before_first_merge():
            return None
        if new.digest != handed.digest:
            log.warning(
                "fragment %d: handed version %d does not hash to its digest; not taken",
                self.fragment,
                handed.version,
            )
            return None
        now = self.clock()
        if handed.final and self.merger.count:  # late work: the predecessor's learners left
            self.merger.drop_round(
                f"version {handed.version} was handed out as final by the previous owner", now=now
            )
        decision = (
            self.merger.rebase(handed.version, now=now) if handed.version > held.version else None
        )
        self._adopt(new, handed.version, handed)
        log.info(
            "fragment %d: took over version %d with its momentum (epoch %d)",
            self.fragment,
            handed.version,
            held.epoch,
        )
        if handed.final:
            self.hold_final(handed.version)
        if (decision is None or decision.kind != "merge") and self.merger.held_until is not None:
            decision = self.merger.hold_until(now, now=now)  # the predecessor's state is in
        return Taken(decision)

    async def _prepare(self, flat: torch.Tensor, version: int) -> _Prepared:
        return await _prepare(
            self.sealer,
            flat,
            version,
            held=self.held.theta,
            held_version=self.held.version,
            lr=self.lr,
        )

    def _adopt(self, new: _Prepared, version: int, handed: Handed | None = None) -> None:
        """Hold a predecessor's state ``new`` as ``version`` (with what ``handed`` carries: its
        momentum, epoch, merged bases, reference and standing)."""
        held = self.held
        held.theta, held.version, held.latest = new.theta, version, new.latest
        held.update, held.residual = None, None  # the residual is not handed over: it starts at 0
        if handed is not None:
            held.buffer = (
                None if handed.momentum is None else handed.momentum.detach().float().clone()
            )
            held.epoch = max(held.epoch, handed.epoch + 1)
            held.take_merged(handed.merged)
            # the predecessor's reference, when plausible
            self.reputation.start_reference(handed.norms, new.measured, theta=held.theta)
            self.reputation.take_standing(handed.standing, version=held.version)
        held.note_state()
        held.remember(version, new.digest, new.message_digest)

    def hold_first_merge(self, seconds: float) -> bool:
        """Merge nothing for ``seconds`` unless the previous owner's state comes first (a handoff,
        ``take_over``, releases the hold). Returns whether the hold was set."""
        if self.counts.merges_done or self.merger.phase is Phase.MERGING:
            return False
        now = self.clock()
        self.merger.hold_until(now + seconds, now=now)  # setting a hold never merges
        return True

    def release_first_merge(self) -> Decision | None:
        """End a ``hold_first_merge`` hold now: the merger's decision (it may close the round
        the hold kept open), or None when no first merge is held."""
        if self.counts.merges_done or self.merger.held_until is None:
            return None
        now = self.clock()
        return self.merger.hold_until(now, now=now)

    # --- the end of a run, and of this term ------------------------------------------------------
    @property
    def final_declared(self) -> tuple[int, float] | None:
        """(version, when) the latest version was last handed out as final."""
        return self.hold.declared

    def declare_final(self) -> Sealed:
        """The latest version, handed out as final: contributions are refused for
        ``FINAL_HOLD_S`` after (``final_hold``)."""
        version = self.held.version
        declared = self.hold.declared
        if declared is None or declared[0] != version:
            log.info("fragment %d: version %d is final", self.fragment, version)
        if self.hold.declare(version, self.clock()):
            self.on_final()
        return self.held.latest

    def hold_final(self, version: int) -> None:
        """Hold ``version`` final as the previous owner did (its handoff said so): learners that
        ended their run took it from that owner, so work is refused here for the hold too."""
        if version != self.held.version:
            return
        log.info(
            "fragment %d: version %d was handed out as final by the previous owner; holding it final",
            self.fragment,
            version,
        )
        if self.hold.declare(version, self.clock()):
            self.on_final()

    def holds_final(self) -> bool:
        """Whether the latest version was handed out as final and the hold has not lapsed."""
        return self.hold.holds(self.held.version, self.clock())

    def final_hold(self) -> str | None:
        """Why a contribution is refused now: a final version was handed out under
        ``FINAL_HOLD_S`` ago, to learners that took it and left; merging would fork them off."""
        return self.hold.refusal(self.clock(), self.fragment)

    def retire(self) -> None:
        """The term is over: mark it, and wake ``wait_retired``."""
        self.retired = True
        self._retired_event.set()

    async def wait_retired(self) -> None:
        await self._retired_event.wait()
