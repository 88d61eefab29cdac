"""A version published with two contents while a roster settles (issue 52's safety bar, 96 peers
on a starved box: fragment 0's version 1 published by two owners, docs/scale_peers.md).

A joiner ranked above the live owner of a fragment takes it over before its learner has fetched
the owner's first version: it starts from version 0 and, without a hold, merges the work waiting
for it into a version 1 of its own. And an owner whose view names a better-ranked member by the
time a replica took its next version (its loop ran late, or the roster changed meanwhile) must
not publish it: that member publishes the same version number.

Each test failed before the fix: the joiner's first merge was not held at version 0, and the
owner published a version its view no longer gave it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types

import torch

from node.diloco.flat import flat_digest
from node.diloco.replica import encode_state
from node.peer import PeerNode
from node.peer.ownership import CATCH_UP_S
from protocol.dht.member_reads import ReadCadence
from protocol.wire.messages import ReplicaAck, ReplicaState
from tests.node.diloco.test_handoff_admission import (
    ATTACKER,
    ME,
    OWNER,
    _forged,
    _offer,
    _peer,
    _start_owner_of_0,
)
from tests.node.fakes import Tasks, contribution


def _joining(rank: list[bytes], *, last_owner: bytes | None) -> tuple[PeerNode, Tasks]:
    """This peer owning fragment 0 by ``rank``; its learner holds version 0 (it has not fetched
    the live owner's first version yet); ``last_owner``: whom its last ownership pass saw."""
    node = _peer(rank)
    theta = torch.zeros(node.replicas.numels[0])

    async def fetch(*a: object, **kw: object) -> None:
        return None  # the previous owner's version is not reachable yet

    node.net = types.SimpleNamespace(  # type: ignore[assignment]
        latest={},
        island_initial={0: theta, 1: torch.zeros(node.replicas.numels[1])},
        received={0: 0, 1: 0},
        received_at={},
        created=None,
        held_state=lambda p: None,
        fetch=fetch,
    )
    return node, _start_owner_of_0(node, last_owner)


async def test_a_joiner_that_displaces_a_live_owner_at_version_0_holds_its_first_merge() -> None:
    for last_owner in (None, OWNER.peer_id):  # just joined, or our last pass saw OWNER own it
        node, tasks = _joining([ME.peer_id, OWNER.peer_id], last_owner=last_owner)
        own = node.owners[0]
        held = own.merger.held_until
        assert own.version == 0 and held is not None
        assert 0 < held - time.monotonic() <= CATCH_UP_S
        # the live owner's version 1 comes as it retires: the joiner owns from it, one content
        theta = torch.full((node.replicas.numels[0],), 0.5)
        handed = _forged(node, epoch=0, version=1, final=False, theta=theta)
        assert (await _offer(node, OWNER, handed)).accepted
        assert own.version == 1 and own.digest_of(1) == flat_digest(theta)
        assert own.merger.held_until is None  # the handoff released the hold
        await tasks.cancel()


async def test_the_first_owner_of_a_new_swarm_is_not_held() -> None:
    """No live owner to displace (the swarm's first member): a healthy start is not slowed."""
    node, tasks = _joining([ME.peer_id], last_owner=None)
    assert node.owners[0].merger.held_until is None
    await tasks.cancel()


def _version(node: PeerNode, version: int) -> ReplicaState:
    theta = torch.full((node.replicas.numels[0],), float(version))
    return encode_state(
        swarm=node.cfg.swarm,
        fragment=0,
        epoch=0,
        version=version,
        digest=flat_digest(theta),
        theta=theta,
        momentum=None,
    )


async def test_an_owner_whose_view_names_another_owner_once_replicated_does_not_publish(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    from node.peer import handoffs

    node = _peer([ME.peer_id, OWNER.peer_id])
    membership = node.membership

    async def replica_takes_it_while_the_roster_changes(*a: object, **kw: object) -> ReplicaAck:
        # the handoff's await: meanwhile our view read a better-ranked member (OWNER)
        membership.rank = [OWNER.peer_id, ME.peer_id]  # type: ignore[union-attr]
        return ReplicaAck(accepted=True, reason="took it", epoch=0, version=1)

    monkeypatch.setattr(handoffs, "hand_over", replica_takes_it_while_the_roster_changes)
    reason = await node.handoffs.replicate(0, _version(node, 1))
    assert reason is not None and reason.startswith("fenced: this peer's view now names")
    assert node.handoffs.claimant_fences == 1

    membership.rank = [ME.peer_id, OWNER.peer_id]  # type: ignore[union-attr]
    monkeypatch.setattr(
        handoffs,
        "hand_over",
        lambda *a, **kw: _accepted(),
    )
    assert await node.handoffs.replicate(0, _version(node, 2)) is None  # still ours: published
    assert node.handoffs.claimant_fences == 1


async def _accepted() -> ReplicaAck:
    return ReplicaAck(accepted=True, reason="took it", epoch=0, version=2)


async def test_a_late_loop_is_fenced_by_the_lease_measured_after_the_handoff(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The lease was live when the merge began; the handoff ran so late on a starved loop that
    our record may have expired elsewhere by the time the replica answered."""
    from node.peer import handoffs

    node = _peer([ME.peer_id, OWNER.peer_id])
    node.presence.record_renewal().stored_at = time.monotonic()
    ttl = node.membership.ttl_s  # type: ignore[union-attr]

    async def slow(*a: object, **kw: object) -> ReplicaAck:
        node.presence.record_renewal().stored_at = (
            time.monotonic() - ttl
        )  # seconds passed meanwhile
        return ReplicaAck(accepted=True, reason="took it", epoch=0, version=1)

    monkeypatch.setattr(handoffs, "hand_over", slow)
    reason = await node.handoffs.replicate(0, dataclasses.replace(_version(node, 1)))
    assert reason is not None and reason.startswith("fenced: our member record")
    assert node.handoffs.lease_lapses == 1


async def test_a_held_first_merge_goes_ahead_once_the_owner_it_waits_for_refuses_connections(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """CI: a 2-peer join (tests/integration/test_join_nproc.py) ended with a fragment at version
    0. The joiner took it from a member that had just left (its record not yet expired) and held
    its first merge CATCH_UP_S for that member's handoff; the member refused the joiner's
    catch-up fetches, yet the hold ran on, and the joiner's 80 steps went by inside it. A member
    that refuses connections hands nothing over: the hold ends once it is a suspect (an
    unrelated suspect does not end it)."""
    from node.peer import handoffs

    monkeypatch.setattr(handoffs, "hand_over", lambda *a, **kw: _accepted())
    node, tasks = _joining([ME.peer_id, OWNER.peer_id, ATTACKER.peer_id], last_owner=None)
    node.net.owners_changed = lambda: None  # type: ignore[union-attr]
    node.membership.cadence = ReadCadence(base_s=2.0, max_s=6.0)  # type: ignore[union-attr]
    members = node.membership.members  # type: ignore[union-attr]
    for s in (OWNER, ATTACKER):  # records stored a while ago: a suspicion from now stands
        members[s.peer_id] = dataclasses.replace(members[s.peer_id], expires_at=time.time() + 30)
    own = node.owners[0]
    delta = torch.full((node.replicas.numels[0],), 0.01)
    await own.contribute(ME.peer_id, contribution(delta, node.shapes[0], owner=own))
    assert own.version == 0 and own.merger.held_until is not None  # held for OWNER's handoff

    node.presence.unreachable(ATTACKER.peer_id)  # not the owner we wait for
    await asyncio.wait_for(tasks.tasks[-1], 10)  # the reconcile a new suspect starts
    assert own.version == 0 and own.merger.held_until is not None

    node.presence.unreachable(OWNER.peer_id)  # the owner we took it from has gone
    await asyncio.wait_for(tasks.tasks[-1], 10)
    assert own.merger.held_until is None
    async with asyncio.timeout(10):  # the waiting work merges once its grace window closes
        while own.version == 0:
            await asyncio.sleep(0.05)
    await tasks.cancel()


async def test_the_catch_up_asks_the_owner_it_waits_for_first() -> None:
    """The owner our last pass saw (OWNER) is the one whose handoff the hold waits for, while the
    member ranked first without us is another (ATTACKER): the catch-up's first fetch goes to the
    owner waited for, so that its refusal, if it has gone, ends the hold at once."""
    asked: list[bytes] = []
    node, tasks = _joining([ME.peer_id, ATTACKER.peer_id, OWNER.peer_id], last_owner=OWNER.peer_id)

    async def fetch(p: int, *, owner: tuple[bytes, str], **kw: object) -> None:
        asked.append(owner[0])

    node.net.fetch = fetch  # type: ignore[union-attr]
    async with asyncio.timeout(10):
        while not asked:
            await asyncio.sleep(0.05)
    assert asked[0] == OWNER.peer_id and node.ownership._awaited == {0: OWNER.peer_id}
    await tasks.cancel()
