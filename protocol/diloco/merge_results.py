"""What an owner's round returns: a ``Decision`` (accept, refuse, wait or merge, with its reason)
and, for a merge, one ``Entry`` per contribution with its weight, clip and the bounds that bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Decision", "DecisionKind", "Entry", "Refusal"]

DecisionKind = Literal["accept", "refuse", "wait", "merge"]
Refusal = Literal["invalid", "future", "stale", "closed", "duplicate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One contribution in a merge: its (clamped, discounted) weight and staleness; ``clip``, the
    scale to apply to its payload (1.0: not clipped; the norm clip times ``work_scale``); which bounds bit; ``norm``, the payload's
    norm as the node reported it with the contribution (before clipping; None: not reported)."""

    peer: bytes
    payload: object
    weight: float
    staleness: int
    clip: float = 1.0
    norm: float | None = None
    weight_capped: bool = False
    steps_bounded: bool = False
    tokens_bounded: bool = False
    work_scale: float = (
        1.0  # its payload's share kept by ``MergeConfig.max_work_steps`` (in ``clip``)
    )
    last: bool = False  # the sender's end-of-run flush (see ``Decision.ends_runs``)
    overclaim: float = 1.0  # claimed / counted steps or tokens when bounded (``Pending.overclaim``)


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What the merger decided. ``version``: the version it holds (collecting for, or merging).

    ``kind``: "accept" (contribution stored), "refuse" (see ``refusal``), "wait" (nothing to do
    yet) or "merge" (run the outer step on ``entries``; the contribution that triggered it, if
    any, was accepted: ``accepted``).
    """

    kind: DecisionKind
    reason: str
    version: int
    accepted: bool = False
    refusal: Refusal | None = None
    entries: tuple[Entry, ...] = ()
    scale: float = 1.0  # of the merge's aggregate: its share of the round's quorum (see ``protocol.diloco.merge``)
    # the round an accepted contribution joined, by the version it merges on: ``version``, or
    # ``version + 1`` for one carried while the round for ``version`` merges (-1: none accepted).
    # Its sender sends that fragment again only once the round has closed: sooner, the owner
    # would refuse it as a duplicate
    joined: int = -1

    @property
    def ends_runs(self) -> bool:
        """A merge holding a learner's end-of-run flush: its contributions are averaged with equal
        weights (``weigh``) and no norm rescaling (``aggregate``), so the final version is the
        mean of the islands' last states, not of their last works scaled to one norm."""
        return any(e.last for e in self.entries)

    def aggregate(self, configured: str) -> str:
        """The aggregate this merge uses: ``mean`` when it ``ends_runs``, else ``configured``."""
        return "mean" if self.ends_runs else configured
