"""The peer's status reading: ``PeerReader(node).status()`` builds the frozen ``PeerStatus`` its
board, page and ``/metrics`` show (on the node's event loop: the trainer thread only appends to
what it reads); ``traffic()`` is the byte counters alone, cheap enough for the trainer's
once-a-second history point.

This is the one place that reads the peer's parts for its status page. Totals are read from the
counters the parts already keep: the transport's bytes, the island's steps, stalls and step
times, the learner side's contributions, each fragment owner's per-sender counts
(``penalties``), published versions and merge time. Owners the peer stopped running keep their
counts (``PeerNode.all_owners``): every total only grows.
"""

from __future__ import annotations

import collections
import math
from typing import Protocol

from aiohttp import web

from node.config import RunConfig
from node.dht.membership import Member, Membership
from node.diloco.learner import IslandNet
from node.diloco.owner import FragmentOwner, OwnerCounts
from node.status.snapshot import (
    MAX_MEMBERS,
    MAX_ROLES,
    STANDING_LOWEST,
    FragmentStatus,
    MemberStatus,
    PeerStatus,
    cut,
)
from node.status.totals import BOUNDS, GoodputSums, IslandTotals, OwnerTotals, Totals
from node.wire.rpc import RpcServer
from node.wire.transport import Transport
from protocol.diloco.fragments import FragmentPlan
from protocol.wire.signing import Signer

__all__ = ["PeerReader", "ReadablePeer"]


class ReadablePeer(Protocol):
    """What the reader reads of a peer (``node.peer.node.PeerNode`` provides it)."""

    cfg: RunConfig
    signer: Signer
    plan: FragmentPlan
    transport: Transport
    rpc: RpcServer

    @property
    def url(self) -> str: ...
    @property
    def reachable(self) -> bool: ...
    @property
    def learning(self) -> bool: ...
    @property
    def step(self) -> int: ...
    @property
    def net(self) -> IslandNet | None: ...
    @property
    def membership(self) -> Membership | None: ...
    @property
    def owners(self) -> dict[int, FragmentOwner]: ...

    def suspects(self) -> set[bytes]: ...

    def owner_of(self, p: int) -> tuple[bytes, str] | None: ...

    def all_owners(self) -> list[OwnerCounts]: ...


class PeerReader:
    """Reads one ``ReadablePeer`` for its status board: ``status()`` (the snapshot), ``traffic()``
    (the byte counters) and ``app`` (where the board's routes go)."""

    def __init__(self, node: ReadablePeer) -> None:
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
        lab=cut(m.lab, 64),
        url=cut(r.url),
        roles=tuple(cut(role, 16) for role in list(r.roles)[:MAX_ROLES]),
        reachable=bool(r.reachable),
        learning=bool(r.learning),
        step=int(r.step),
        is_self=is_self,
        suspect=suspect,
    )


def _fragment(node: ReadablePeer, p: int, versions: tuple[int, ...]) -> FragmentStatus:
    owner = node.owner_of(p)
    running = node.owners.get(p)
    return FragmentStatus(
        fragment=p,
        owner_id=owner[0].hex() if owner else None,
        owner_url=cut(owner[1]) if owner else None,
        version=versions[p] if p < len(versions) else None,
        owned=running.version if running is not None else None,
        epoch=running.epoch if running is not None else None,
        # senders refused for low standing now, and the lowest scores (issue 47)
        standing=running.standing_status(STANDING_LOWEST) if running is not None else None,
    )


def _island(node: ReadablePeer, sums: GoodputSums) -> IslandTotals:
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


def _owners(node: ReadablePeer) -> OwnerTotals:
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
