"""``PeerStatus``: one frozen reading of a peer, all that its status page and ``/metrics`` show.

The board, the metrics and the page read a ``PeerStatus``, never the peer itself: this module
is the one place in ``node/status/`` that knows a ``PeerNode``'s insides, so a peer that moves
its parts around changes ``PeerReader`` and nothing else here. ``PeerReader(node).status()``
builds a snapshot (on the node's event loop: the trainer thread only appends to what it reads);
``traffic()`` is the byte counters alone, cheap enough for the trainer's once-a-second history
point.

Every string another peer chose (a lab name, an address, a role) is cut to a few hundred
characters here, and the member list to ``MAX_MEMBERS`` (``members_total`` says how many there
are), so a snapshot is small whatever the swarm holds.

Totals (``node.status.totals``) are read from the counters the peer's parts already keep: the
transport's bytes, the island's steps, stalls and step times, the learner side's contributions,
each fragment owner's per-sender counts (``penalties``), published versions and merge time.
Owners the peer stopped running keep their counts (``PeerNode.all_owners``): every total only
grows.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from node.status.totals import BOUNDS, GoodputSums, IslandTotals, OwnerTotals, Totals

if TYPE_CHECKING:
    from node.dht.membership import Member
    from node.peer import PeerNode

__all__ = [
    "MAX_MEMBERS",
    "MAX_TEXT",
    "FragmentStatus",
    "MemberStatus",
    "PeerReader",
    "PeerStatus",
]

MAX_MEMBERS = 256  # members listed (``members_total`` says how many there are)
MAX_TEXT = 200  # characters of any string another peer chose
MAX_ROLES = 8
STANDING_LOWEST = 3  # the lowest standing scores shown per fragment owned


def _cut(value: object, limit: int = MAX_TEXT) -> str:
    return str(value)[:limit]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberStatus:
    """One member as this peer sees it (strings cut); ``is_self``: this peer's own record."""

    peer_id: str  # hex
    lab: str  # from its certificate; "" without one
    url: str
    roles: tuple[str, ...]
    reachable: bool
    learning: bool
    step: int
    is_self: bool
    suspect: bool  # it refused this peer's connections lately


@dataclass(frozen=True, slots=True, kw_only=True)
class FragmentStatus:
    """One fragment: who owns it, the version this peer's island holds, and, when this peer owns
    it, the version, epoch and standing (senders refused, the lowest scores) of its owner."""

    fragment: int
    owner_id: str | None  # hex
    owner_url: str | None
    version: int | None  # the island's
    owned: int | None
    epoch: int | None
    standing: dict[str, Any] | None  # ``FragmentOwner.standing_status``: JSON-ready


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerStatus:
    """One reading of a peer (see the module docstring)."""

    swarm: str
    peer_id: str  # hex
    url: str
    reachable: bool
    learning: bool
    step: int
    members: tuple[MemberStatus, ...]  # this peer first, then by peer id; at most MAX_MEMBERS
    members_total: int
    versions: tuple[int, ...]  # the island's, per fragment (empty before it serves)
    fragments: tuple[FragmentStatus, ...]
    totals: Totals


class PeerReader:
    """Reads one ``PeerNode`` for its status board: ``status()`` (the snapshot), ``traffic()``
    (the byte counters) and ``app`` (where the board's routes go)."""

    def __init__(self, node: PeerNode) -> None:
        self._node = node
        self._sums = GoodputSums()  # the island's step times, summed as they come

    @property
    def app(self) -> web.Application:
        return self._node.transport.app

    def traffic(self) -> tuple[int, int]:
        """(bytes sent, bytes received) so far; from any thread."""
        t = self._node.transport
        return t.bytes_sent, t.bytes_received

    def status(self) -> PeerStatus:
        """The peer's ``PeerStatus`` now (on the node's event loop)."""
        node = self._node
        versions = tuple(node.net.island.versions) if node.net is not None else ()
        members = node.membership.members if node.membership is not None else {}
        suspects = node.suspects() if node.membership is not None else set()
        return PeerStatus(
            swarm=node.cfg.swarm,
            peer_id=node.signer.peer_id.hex(),
            url=node.url,
            reachable=node.reachable,
            learning=node.learning,
            step=node.step,
            members=_members(members, node.signer.peer_id, suspects),
            members_total=len(members),
            versions=versions,
            fragments=tuple(_fragment(node, p, versions) for p in range(len(node.plan.fragments))),
            totals=Totals(
                bytes_sent=node.transport.bytes_sent,
                bytes_received=node.transport.bytes_received,
                direct_bodies=node.transport.direct_bodies,
                members=len(members),
                suspects=len(suspects),
                remote_errors=dict(node.rpc.errors),
                island=_island(node, self._sums),
                owners=_owners(node),
            ),
        )


def _members(
    members: dict[bytes, Member], me: bytes, suspects: set[bytes]
) -> tuple[MemberStatus, ...]:
    listed = sorted(members.values(), key=lambda m: (m.peer_id != me, m.peer_id))[:MAX_MEMBERS]
    return tuple(_member(m, is_self=m.peer_id == me, suspect=m.peer_id in suspects) for m in listed)


def _member(m: Member, *, is_self: bool, suspect: bool) -> MemberStatus:
    r = m.record
    return MemberStatus(
        peer_id=m.peer_id.hex(),
        lab=_cut(m.lab, 64),
        url=_cut(r.url),
        roles=tuple(_cut(role, 16) for role in list(r.roles)[:MAX_ROLES]),
        reachable=bool(r.reachable),
        learning=bool(r.learning),
        step=int(r.step),
        is_self=is_self,
        suspect=suspect,
    )


def _fragment(node: PeerNode, p: int, versions: tuple[int, ...]) -> FragmentStatus:
    owner = node.owner_of(p)
    running = node.owners.get(p)
    return FragmentStatus(
        fragment=p,
        owner_id=owner[0].hex() if owner else None,
        owner_url=_cut(owner[1]) if owner else None,
        version=versions[p] if p < len(versions) else None,
        owned=running.version if running is not None else None,
        epoch=running.epoch if running is not None else None,
        # senders refused for low standing now, and the lowest scores (issue 47)
        standing=running.standing_status(STANDING_LOWEST) if running is not None else None,
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
    running = list(node.owners.items())
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
        fragments_owned=len(running),
        senders_refused={str(p): o.standing.below(version=o.version) for p, o in running},
        lowest_standing={
            str(p): low[0][1]
            for p, o in running
            if (low := o.standing.lowest(1, version=o.version))
        },
    )
