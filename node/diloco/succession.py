"""How an owner's term starts and ends: what it takes over, finality, retiring.

A new owner starts from the state its predecessor handed over (``FragmentOwner.take_over``: global
fragment, momentum, version and digest, under a higher epoch) or from the newest version it
published (``FragmentOwner.catch_up``), either only before its own first merge; ``prepare`` seals
and measures such a state off the event loop. ``Succession`` holds how the term ends: at the end
of a run the latest version is handed out as final and work arriving within ``FINAL_HOLD_S`` after
is refused (``protocol.diloco.intake.FinalHold``); an owner that stops owning the fragment, or is
fenced off by a successor, retires and releases every long-poll.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.diloco.sealing import Sealer
from protocol.diloco.intake import FINAL_HOLD_S, FinalHold
from protocol.diloco.norms import norm64
from protocol.diloco.reference import update_norm_estimate
from protocol.wire.signing import Sealed

__all__ = ["FINAL_HOLD_S", "Prepared", "Succession", "measured_updates", "prepare"]

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
class Prepared:
    """A predecessor's state, copied and sealed by this owner, ready to be taken."""

    theta: torch.Tensor
    latest: Sealed
    digest: bytes  # of the state as learners decode it
    message_digest: bytes  # of the sealed message
    measured: list[float]  # update norm estimates from the state held to this one


async def prepare(
    sealer: Sealer,
    flat: torch.Tensor,
    version: int,
    *,
    held: torch.Tensor,
    held_version: int,
    lr: float,
) -> Prepared:
    """Copy ``flat`` as ``version``, seal it and measure the updates from ``held`` (at
    ``held_version``) to it, each off the event loop."""
    theta = flat.detach().float().clone()
    latest, digest, message_digest = await asyncio.to_thread(sealer.state, version, theta)
    measured = await asyncio.to_thread(measured_updates, held, held_version, theta, version, lr=lr)
    return Prepared(theta, latest, digest, message_digest, measured)


class Succession:
    """How one owner's term ends: its final hold, and whether it retired (or was fenced)."""

    def __init__(self, fragment: int, clock: Callable[[], float]) -> None:
        self.fragment, self.clock = fragment, clock
        self.hold = FinalHold()
        self.retired = False
        self.fenced: str | None = None  # why a replica refused our next version
        self._retired_event = asyncio.Event()

    @property
    def final_declared(self) -> tuple[int, float] | None:
        """(version, when) the latest version was last handed out as final."""
        return self.hold.declared

    def declare(self, version: int) -> bool:
        """Hold ``version`` final from now; whether it was not held final before."""
        return self.hold.declare(version, self.clock())

    def holds_final(self, version: int) -> bool:
        """Whether ``version`` was handed out as final and the hold has not lapsed."""
        return self.hold.holds(version, self.clock())

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
