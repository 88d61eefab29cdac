"""A version published with two contents from a starved owner's stale view (issue 52: a 32-peer
run at load ~8.6 published fragment 2's version 2 twice; its dissent log shows peer 6 naming
itself the owner for 10+ s after the roster moved the fragment to peer 9, docs/scale_peers.md
"Two contents on a starved box").

Owner A's last read of the members is older than the record of B, a member ranked above it for
fragment 0 that has taken the fragment over and merges version v itself. A merges its own
version v, a replica that has not heard of B takes it (the two owners hand to disjoint replicas,
so neither replica fences the other), and the publication gate asked only that A's own view
still name A: on a loop that has not read the members since, it does, and A published v with
another content than B's. Now a publication from a view whose last read began ``VIEW_FRESH_S``
or more ago awaits a fresh read first (bounded by the same time), and is fenced when that read
names another owner or does not come in time.

Real objects: ``PeerNode``'s handoffs and presence over a real ``Membership`` reading an
in-memory DHT (``KeyedDHT``); only the replica's answer is given (it takes every version).
``test_a_stale_view_that_missed_a_better_ranked_owner_does_not_publish`` failed before the fix
(the version was published)."""

from __future__ import annotations

import asyncio
import time

import pytest

from node.config import RunConfig
from node.dht.membership import READ_QUORUM, Membership, roster_key
from node.peer import PeerNode, handoffs
from node.peer.handoffs import VIEW_FRESH_S
from node.peer.ownership import CATCH_UP_S
from protocol.dht.records import SignedRecord, sign_record
from protocol.wire.messages import ReplicaAck
from protocol.wire.signing import Signer
from tests.node.dht.test_membership import KeyedDHT, _record
from tests.node.diloco.test_first_version_fence import _version
from tests.node.fakes import signer, tiny_model, tiny_plan

pytestmark = pytest.mark.timeout(60)

A = signer(2)  # this peer: the owner whose view goes stale
STALE_S = 10.0  # how long ago its loop last read the members (the run's peer 6: 10+ s)


def _roster(*members: Signer) -> list[SignedRecord]:
    key = roster_key(RunConfig().swarm)
    expiry = time.time() + 60
    return [
        sign_record(s, key, _record(url=f"http://127.0.0.1:{9000 + s.peer_id[0]}").encode(), expiry)
        for s in members
    ]


def _ranks(members: list[Signer], n_fragments: int) -> list[bytes]:
    """Fragment 0's owner, then its replica, as a view of ``members`` ranks them."""
    view = Membership(KeyedDHT(), RunConfig().swarm, "m", n_fragments=n_fragments)  # type: ignore[arg-type]
    view._records = {r.subkey: r for r in _roster(*members)}
    view._rebuild(time.time())
    return [pid for pid, _ in view.ranked(RunConfig().swarm, 0, 2)]


def _cast(n_fragments: int) -> tuple[Signer, Signer]:
    """REPLICA: A's replica while A owns fragment 0 among {A, REPLICA}; B: a member that, once
    in the roster, owns fragment 0 above A (the rendezvous hash decides; found by search)."""
    seeds = [signer(n) for n in range(3, 64)]
    replica = next(s for s in seeds if _ranks([A, s], n_fragments) == [A.peer_id, s.peer_id])
    b = next(
        s
        for s in seeds
        if s is not replica and _ranks([A, replica, s], n_fragments)[0] == s.peer_id
    )
    return replica, b


class _ViewDHT(KeyedDHT):
    """``KeyedDHT`` that notes each read's quorum, and never answers once ``stuck`` (a starved
    box, responders that do not answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.quorums: list[int] = []
        self.stuck = False

    async def get(self, key: bytes, **kw: object) -> list:  # type: ignore[override]
        self.quorums.append(int(kw.get("quorum", 1)))  # type: ignore[call-overload]
        if self.stuck:
            await asyncio.Event().wait()
        return await super().get(key, **kw)  # type: ignore[arg-type]


def _owner_a() -> tuple[PeerNode, Membership, _ViewDHT, Signer]:
    """A, owning fragment 0 by its last read (of A and its replica); returns B, not yet seen."""
    model = tiny_model()
    plan = tiny_plan(model)
    node = PeerNode(RunConfig(max_tokens_per_step=64), A, model, plan)
    replica, b = _cast(len(plan.fragments))
    dht = _ViewDHT()
    dht.by_key[roster_key(node.cfg.swarm)] = _roster(A, replica)
    view = Membership(dht, node.cfg.swarm, "m", n_fragments=len(plan.fragments))  # type: ignore[arg-type]
    node.membership = view
    return node, view, dht, b


def _replica_takes_every_version(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A's replica takes whatever A hands it (it has not heard of B); the versions it took."""
    took: list[int] = []

    async def hand_over(transport, signer, target, msg, replay, **kw) -> ReplicaAck:  # type: ignore[no-untyped-def]
        took.append(msg.version)
        return ReplicaAck(accepted=True, reason="took it", epoch=msg.epoch, version=msg.version)

    monkeypatch.setattr(handoffs, "hand_over", hand_over)
    return took


async def _stale_owner_a(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[PeerNode, Membership, _ViewDHT, list[int]]:
    """``_owner_a`` whose replica takes every version, read once, its last read ``STALE_S`` old;
    with the versions its replica took."""
    node, view, dht, _ = _owner_a()
    took = _replica_takes_every_version(monkeypatch)
    await view.refresh()
    view.read_at = time.monotonic() - STALE_S
    return node, view, dht, took


def test_a_fresh_view_is_one_read_within_the_joiners_hold() -> None:
    # a member that displaces a live owner merges nothing for CATCH_UP_S, fetching its versions:
    # a version published from a view read VIEW_FRESH_S before comes within that hold
    assert 0 < VIEW_FRESH_S < CATCH_UP_S


async def test_a_stale_view_that_missed_a_better_ranked_owner_does_not_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node, view, dht, b = _owner_a()
    took = _replica_takes_every_version(monkeypatch)
    await view.refresh()
    assert node.presence.owner_of(0)[0] == A.peer_id  # type: ignore[index]
    # B joins and takes fragment 0 over (its record is in the roster); A's starved loop does not
    # read the members again: its last read began STALE_S ago, and its view still names A
    dht.by_key[roster_key(node.cfg.swarm)] += _roster(b)
    view.read_at = time.monotonic() - STALE_S
    assert node.presence.owner_of(0)[0] == A.peer_id  # type: ignore[index]

    reason = await node.handoffs.replicate(0, _version(node, 1))

    assert took == [1]  # A's replica took A's version 1: no replica fences it
    assert reason is not None and reason.startswith("fenced: this peer's view now names")
    assert node.handoffs.claimant_fences == 1 and node.handoffs.view_reads == 1
    assert node.presence.owner_of(0)[0] == b.peer_id  # type: ignore[index]


async def test_a_fresh_view_publishes_without_another_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # a healthy loop read the members a moment ago: a publication costs no read of its own
    node, view, dht, _ = _owner_a()
    _replica_takes_every_version(monkeypatch)
    await view.refresh()
    reads = len(dht.reads)
    assert await node.handoffs.replicate(0, _version(node, 1)) is None
    assert len(dht.reads) == reads and node.handoffs.view_reads == 0


async def test_a_stale_view_read_again_that_still_names_us_publishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node, view, dht, _ = await _stale_owner_a(monkeypatch)
    reads = len(dht.reads)
    assert await node.handoffs.replicate(0, _version(node, 1)) is None
    assert len(dht.reads) > reads and view.read_age() < VIEW_FRESH_S
    # a quorum read: a record one responder lacks is missed only if every one of them lacks it
    assert set(dht.quorums[reads:]) == {READ_QUORUM}
    assert node.handoffs.view_reads == 1 and node.handoffs.stale_view_fences == 0


async def test_a_stale_view_that_cannot_be_read_in_time_does_not_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node, view, dht, _ = await _stale_owner_a(monkeypatch)
    monkeypatch.setattr(handoffs, "VIEW_FRESH_S", 0.2)  # the deadline, short for the test
    dht.stuck = True
    reason = await node.handoffs.replicate(0, _version(node, 1))
    assert reason is not None and reason.startswith("fenced: this peer's view of the members")
    assert node.handoffs.stale_view_fences == 1 and node.handoffs.claimant_fences == 0
    assert node.status()["replicas"]["stale_view_fences"] == 1  # type: ignore[index]


async def test_a_version_fenced_by_a_stale_view_is_owned_from_again_not_made_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the replica took version 1 before the gate fenced it: the owner must own on from that
    # version 1 (as after a lapsed lease), never merge a version 1 of other content, which the
    # replica refuses (32 peers at load ~38: fragment 1 went 295 s without a version so)
    node, view, dht, took = await _stale_owner_a(monkeypatch)
    monkeypatch.setattr(handoffs, "VIEW_FRESH_S", 0.2)  # the deadline, short for the test
    dht.stuck = True
    fenced = _version(node, 1)
    assert await node.handoffs.replicate(0, fenced) is not None
    kept = node.handoffs.lapsed[0]
    assert kept is not None and kept.state.digest == fenced.digest
    dht.stuck = False
    handed = await node.handoffs.resume(0, 1, after=0)  # the owner started again, epoch 1
    assert handed is not None and handed.version == 1
    assert took[-1] == 1 and node.handoffs.resumed == 1 and 0 not in node.handoffs.lapsed


async def test_owners_publishing_at_once_share_one_fresh_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, view, _, _ = await _stale_owner_a(monkeypatch)
    before = view.reads
    await asyncio.gather(view.fresh(VIEW_FRESH_S), view.fresh(VIEW_FRESH_S))
    assert view.reads == before + 1


async def test_a_read_that_fails_leaves_the_view_as_old_as_it_was() -> None:
    # only a completed read makes the view fresh: a failed one must not let a stale view publish
    _, view, dht, _ = _owner_a()
    await view.refresh()
    view.read_at = time.monotonic() - STALE_S

    async def unreachable(key: bytes, **kw: object) -> list:
        raise ConnectionError("no responder answered")

    dht.get = unreachable  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await view.fresh(VIEW_FRESH_S)
    assert view.read_age() >= STALE_S
