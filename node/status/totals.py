"""What a node has done so far: ``Totals``, summed from the counters its parts already keep.

Nothing here counts anything itself: ``node.peer.status.PeerReader`` reads the transport's
bytes, the island's steps, stalls and step times, the learner side's contributions and each
fragment owner's per-sender counts into one ``Totals`` for ``/metrics`` and the status page.

Goodput, for one node: the share of its contributions the owners accepted times the share of its
training time spent computing (a step's time less any wait for a merge): the per-peer term of
``node.run.chaos.goodput``, with sums in place of the median step time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BOUNDS", "GoodputSums", "IslandTotals", "OwnerTotals", "Totals"]

BOUNDS = (
    "clipped",
    "weight_capped",
    "steps_bounded",
    "tokens_bounded",
    "work_capped",
)  # owner.penalties keys


@dataclass(frozen=True, slots=True, kw_only=True)
class IslandTotals:
    """The island's and its network side's counts (all 0 before the node serves)."""

    inner_steps: int = 0
    tokens_trained: int = 0
    stalled_steps: int = 0
    goodput: float | None = None  # None until a step was timed and a contribution sent
    contributions: dict[str, int] = field(
        default_factory=dict
    )  # sent, accepted, refused, undelivered
    resyncs: int = 0
    version_jumps: int = 0  # versions refused as above what an honest owner can have reached


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerTotals:
    """What this node's fragment owners, current and retired, did with contributions."""

    merged: int = 0  # contributions merged into a published version
    late: int = 0  # ... of which arrived after their base's round had closed (carried, discounted)
    dropped: int = 0  # dropped from a merge that failed
    refused: dict[str, int] = field(default_factory=dict)  # by reason (base, closed, stale, ...)
    bounded: dict[str, int] = field(default_factory=dict)  # merged, but a bound bit (BOUNDS)
    versions_published: int = 0
    merge_seconds: float = 0.0  # time spent in the published merges, in all
    fragments_owned: int = 0
    # per fragment owned now: sender keys refused for low standing, and the lowest score
    # (``protocol.diloco.standing``; standing moves with the fragment, so retired owners have none)
    senders_refused: dict[str, int] = field(default_factory=dict)
    lowest_standing: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Totals:
    """One reading of a node's counters (see the module docstring); every count only grows."""

    bytes_sent: int = 0
    bytes_received: int = 0
    direct_bodies: int = 0  # large bodies read straight off their socket (``node.wire.direct``)
    members: int = 0
    suspects: int = 0
    remote_errors: dict[str, int] = field(default_factory=dict)  # requests refused, by error
    island: IslandTotals = field(default_factory=IslandTotals)
    owners: OwnerTotals = field(default_factory=OwnerTotals)


class GoodputSums:
    """Running sums of an island's step and compute times (its lists only grow: each reading
    adds the new entries, never the whole list again)."""

    def __init__(self) -> None:
        self._seen = {"step": 0, "compute": 0}
        self.step_s = 0.0
        self.compute_s = 0.0

    def update(self, step_times: Sequence[float], compute_times: Sequence[float]) -> None:
        new_steps = step_times[self._seen["step"] :]
        new_compute = compute_times[self._seen["compute"] :]
        self._seen["step"] += len(new_steps)
        self._seen["compute"] += len(new_compute)
        self.step_s += sum(new_steps)
        self.compute_s += sum(new_compute)

    def goodput(self, sent: int, accepted: int) -> float | None:
        if self.step_s <= 0 or sent <= 0:
            return None
        return min(1.0, accepted / sent) * min(1.0, self.compute_s / self.step_s)
