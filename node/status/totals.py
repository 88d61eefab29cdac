"""What a node has done so far, read from the counters its parts already keep.

Nothing here counts anything itself: the transport counts bytes, the island its steps, stalls
and step times, the learner side its contributions, each fragment owner the contributions it
merged or refused per sender (``penalties``), its published versions and its time spent merging.
``read_totals`` sums them into one ``Totals`` for ``/metrics`` and the status page. Owners this
peer has stopped running keep their counts (``PeerNode.all_owners``), so every total only grows.

Goodput, for one node: the share of its contributions the owners accepted times the share of its
training time spent computing (a step's time less any wait for a merge): the per-peer term of
``node.run.chaos.goodput``, with sums in place of the median step time.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.peer import PeerNode

__all__ = ["BOUNDS", "GoodputSums", "IslandTotals", "OwnerTotals", "Totals", "read_totals"]

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


def read_totals(node: PeerNode, sums: GoodputSums) -> Totals:
    """Sum ``node``'s counters (on the node's event loop; the trainer thread only appends)."""
    members = node.membership.members if node.membership is not None else {}
    return Totals(
        bytes_sent=node.transport.bytes_sent,
        bytes_received=node.transport.bytes_received,
        direct_bodies=node.transport.direct_bodies,
        members=len(members),
        suspects=len(node.suspects()) if node.membership is not None else 0,
        remote_errors=dict(node.rpc.errors),
        island=_island(node, sums),
        owners=_owners(node),
    )


def _island(node: PeerNode, sums: GoodputSums) -> IslandTotals:
    if node.net is None:
        return IslandTotals()
    stats, ls = node.net.island.stats, node.net.stats
    sums.update(stats.step_times, stats.compute_times)
    return IslandTotals(
        inner_steps=stats.step,
        tokens_trained=stats.tokens_trained,
        stalled_steps=stats.stalled_steps,
        goodput=sums.goodput(ls.contributions_sent, ls.contributions_accepted),
        contributions={
            "sent": ls.contributions_sent,
            "accepted": ls.contributions_accepted,
            "refused": ls.contributions_refused,
            "undelivered": ls.send_failures,
        },
        resyncs=ls.resyncs,
        version_jumps=ls.version_jumps,
    )


def _owners(node: PeerNode) -> OwnerTotals:
    counts: collections.Counter[str] = collections.Counter()
    published, merge_s = 0, 0.0
    for owner in node.all_owners():
        published += owner.merges_done
        merge_s += owner.merge_seconds
        for per_sender in list(owner.penalties.values()):
            counts.update(per_sender)
    return OwnerTotals(
        merged=counts["merged"],
        late=counts["late"],
        dropped=counts["dropped"],
        refused={
            k.removeprefix("refused_"): v for k, v in counts.items() if k.startswith("refused_")
        },
        bounded={b: counts[b] for b in BOUNDS},
        versions_published=published,
        merge_seconds=merge_s if math.isfinite(merge_s) else 0.0,
        fragments_owned=len(node.owners),
        senders_refused={
            str(p): o.standing.below(version=o.version) for p, o in list(node.owners.items())
        },
        lowest_standing={
            str(p): low[0][1]
            for p, o in list(node.owners.items())
            if (low := o.standing.lowest(1, version=o.version))
        },
    )
