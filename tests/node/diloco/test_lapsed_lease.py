"""An owner fenced by its own lapsed lease, and how soon the fragment has an owner again (issue 52,
32 peers at load ~48: fragment 3 waited more than 2H).

The owner's loop ran late through a handoff: the replica took version 1, but by then our record
was last stored longer ago than its TTL less the margin, so version 1 was not published. Nobody
else is known to own the fragment (every view still names us while our record is live there).
Before the fix the owner stepped back for ``FENCE_BACKOFF_S`` as if a successor had taken over,
owned again from version 0 and merged nothing for ``CATCH_UP_S``; its next merge then made a
version 1 of another content, which the replica refused (it holds ours): a second fence, and
the round's work lost twice. Now it owns again as soon as its record is stored again, from the
version 1 the replica took, once that replica takes it again under the new epoch; when it will
not (a successor took the fragment over there), nothing is resumed."""

from __future__ import annotations

import asyncio
import time
import types

import pytest
import torch

from node.config import RunConfig
from node.diloco.flat import flat_digest
from node.diloco.replica import encode_state
from node.peer import PeerNode
from node.peer.handoffs import _FencedBy
from node.peer.ownership import FENCE_BACKOFF_S
from protocol.wire.messages import ReplicaState
from tests.node.diloco.test_handoff_admission import (
    ME,
    OWNER,
    _member,
    _peer,
    _RankedMembership,
    _start_owner_of_0,
)
from tests.node.fakes import Tasks, tiny_model, tiny_plan

pytestmark = pytest.mark.timeout(60)

REPLICA = OWNER  # ranked second: fragment 0's replica, its successor should our record lapse


def _replica_node(rank: list[bytes]) -> PeerNode:
    """The replica's peer: it sees ME and itself as members that may own, ranked ``rank``."""
    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), REPLICA, model, tiny_plan(model))
    members = {s.peer_id: _member(s) for s in (ME, REPLICA)}
    node.membership = _RankedMembership({p: members[p] for p in rank}, rank)  # type: ignore[assignment]
    return node


def _route(owner: PeerNode, replica: PeerNode, *, lapse_on_first: bool) -> None:
    """``owner``'s handoffs go to ``replica``'s handler in memory; with ``lapse_on_first`` the
    first one returns so late that our record's lease has lapsed meanwhile."""
    lapses = [lapse_on_first]

    async def hand_to(
        p: int, target: tuple[bytes, str], state: ReplicaState, digest: bytes | None = None
    ) -> bool:
        ack = await replica.ownership.on_replica_state(
            types.SimpleNamespace(peer_id=ME.peer_id, message=state, blobs_digest=None)
        )
        if lapses.pop() if lapses else False:
            ttl = owner.membership.ttl_s  # type: ignore[union-attr]
            owner.presence.record_renewal().stored_at = time.monotonic() - ttl
        if not ack.accepted and ack.reason.startswith("fenced"):
            raise _FencedBy(ack)
        return ack.accepted

    owner.handoffs._hand_to = hand_to  # type: ignore[method-assign]


def _owner_node() -> tuple[PeerNode, Tasks]:
    node = _peer([ME.peer_id, REPLICA.peer_id])
    node.presence.record_renewal().stored_at = time.monotonic()

    async def fetch(*a: object, **kw: object) -> None:
        return None

    node.net = types.SimpleNamespace(  # type: ignore[assignment]
        latest={},
        island_initial={
            0: torch.zeros(node.replicas.numels[0]),
            1: torch.zeros(node.replicas.numels[1]),
        },
        received={0: 0, 1: 0},
        received_at={},
        created=None,
        held_state=lambda p: None,
        fetch=fetch,
        owners_changed=lambda: None,
    )
    return node, _start_owner_of_0(node, ME.peer_id)


def _version_1(node: PeerNode, epoch: int) -> tuple[ReplicaState, bytes]:
    theta = torch.full((node.replicas.numels[0],), 0.25)
    digest = flat_digest(theta)
    state = encode_state(
        swarm=node.cfg.swarm,
        fragment=0,
        epoch=epoch,
        version=1,
        digest=digest,
        theta=theta,
        momentum=None,
    )
    return state, digest


async def _fenced_by_the_lease(node: PeerNode) -> bytes:
    """Version 1 handed to the replica, then not published: the lease lapsed meanwhile. The owner
    stops as ``FragmentOwner._failed`` stops it for a ``Fenced`` merge."""
    own = node.owners[0]
    state, digest = _version_1(node, own.epoch)
    reason = await node.handoffs.replicate(0, state)
    assert reason is not None and reason.startswith("fenced: our member record"), reason
    own.fenced = reason
    await own.retire()
    return digest


async def _owner_at(node: PeerNode, version: int) -> None:
    async with asyncio.timeout(20):
        while 0 not in node.owners or node.owners[0].version != version:
            await asyncio.sleep(0.01)


async def test_an_owner_fenced_by_its_lease_resumes_from_the_version_its_replica_took() -> None:
    node, tasks = _owner_node()
    replica = _replica_node([ME.peer_id, REPLICA.peer_id])
    _route(node, replica, lapse_on_first=True)
    digest = await _fenced_by_the_lease(node)
    assert replica.replicas.held[0].version == 1  # the replica holds the version we did not publish

    await node.ownership.reconcile()  # the lease is still lapsed: not owned, but no step back
    assert 0 not in node.owners
    assert 0 not in node.ownership._fenced_until  # not FENCE_BACKOFF_S: nobody took over

    node.presence.record_renewal().stored_at = time.monotonic()  # our record is stored again
    started = time.monotonic()
    await node.ownership.reconcile()
    await _owner_at(node, 1)
    own = node.owners[0]
    assert own.digest_of(1) == digest and own.merges_done == 0  # the content the replica holds
    assert node.handoffs.resumed == 1
    assert replica.replicas.held[0].epoch == 1  # taken again under the new owner's epoch
    assert time.monotonic() - started < FENCE_BACKOFF_S  # owned again at once, not after a backoff
    await tasks.cancel()


async def test_nothing_is_resumed_where_the_replica_no_longer_sees_us() -> None:
    """Our record did lapse in the replica's view: it may be the fragment's owner by now. The
    owner starts from its last published version, its first merge held, and publishes nothing
    of the version it did not publish."""
    node, tasks = _owner_node()
    replica = _replica_node([ME.peer_id, REPLICA.peer_id])
    _route(node, replica, lapse_on_first=True)
    await _fenced_by_the_lease(node)
    await node.ownership.reconcile()
    replica.membership = _RankedMembership(  # type: ignore[assignment]
        {REPLICA.peer_id: _member(REPLICA)}, [REPLICA.peer_id]
    )
    node.presence.record_renewal().stored_at = time.monotonic()
    await node.ownership.reconcile()
    await _owner_at(node, 0)
    own = node.owners[0]
    async with asyncio.timeout(20):  # by reference, then whole: refused both times
        while replica.replicas.refusals["not-a-member"] < 2:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert own.version == 0 and node.handoffs.resumed == 0
    assert own.merger.held_until is not None  # merges nothing before the catch-up ends
    await tasks.cancel()


async def test_a_version_made_while_the_lease_lapsed_waits_for_the_record_not_the_next_round() -> (
    None
):
    """The merge ended while our record went unstored (no node answered in time): nothing has
    left this peer, so the version waits for the record to be stored again and is then handed
    on and published, with the round's work in it. Before, it was dropped at once (fenced), and
    the fragment waited for the learners' next round (3.5 min at 32 peers, load ~50)."""
    node, tasks = _owner_node()
    replica = _replica_node([ME.peer_id, REPLICA.peer_id])
    _route(node, replica, lapse_on_first=False)
    ttl = node.membership.ttl_s  # type: ignore[union-attr]
    node.presence.record_renewal().stored_at = time.monotonic() - ttl  # lapsed as the merge ends
    state, _ = _version_1(node, node.owners[0].epoch)
    publishing = asyncio.ensure_future(node.handoffs.replicate(0, state))
    await asyncio.sleep(0.3)
    assert not publishing.done() and 0 not in replica.replicas.held  # held here, not handed
    node.presence.record_renewal().stored_at = time.monotonic()  # the record loop stored it
    async with asyncio.timeout(20):
        assert await publishing is None  # handed on, and published
    assert replica.replicas.held[0].version == 1 and node.handoffs.lease_lapses == 0
    await tasks.cancel()
