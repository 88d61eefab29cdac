"""PeerNode's admission of sealed requests: members at once, a new member after one lookup of
its record, strangers refused without costing more than one rate-limited lookup."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import Callable

import pytest
import torch

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord
from node.peer import PeerNode
from protocol.dht.member_lookups import MemberLookups
from protocol.dht.member_reads import ReadCadence
from protocol.wire.messages import ReplicaState
from tests.node.fakes import Tasks, signer, tiny_model, tiny_plan


@dataclasses.dataclass
class FakeMembership:
    """The DHT's member records, as ``refresh`` would find them."""

    records: dict[bytes, Member]
    members: dict[bytes, Member] = dataclasses.field(default_factory=dict)
    refreshes: int = 0
    ttl_s: float = 60.0
    cadence: ReadCadence = dataclasses.field(default_factory=ReadCadence)
    lookups: MemberLookups = dataclasses.field(default_factory=MemberLookups)

    async def refresh(self, *, full: bool = False) -> dict[bytes, Member]:
        self.refreshes += 1
        self.members = dict(self.records)
        return self.members

    def want(self, peer_id: bytes) -> None:
        """A view that reads every record: nothing to look up by id."""

    def read_age(self) -> float:
        """``records`` are the view as a read just now would find them."""
        return 0.0

    async def refresh_if_due(self) -> dict[bytes, Member]:
        """Every pass reads here (no cadence)."""
        return await self.refresh()

    async def look_up(self) -> dict[bytes, Member]:
        """A view that reads every record looks a stranger up with a whole read."""
        return await self.refresh()

    def offers_to_own(self, me: bytes, exclude: object = ()) -> bool:
        """No cap on the roster here: every reachable member may offer to own."""
        return True

    def owner_of(
        self, swarm: str, fragment: int, *, exclude: object = ()
    ) -> tuple[bytes, str] | None:
        """The first member that may own, by peer id (a plain stand-in for the rendezvous rank)."""
        ranked = sorted(
            pid for pid, m in self.members.items() if m.certified_owner and pid not in exclude
        )  # type: ignore[operator]
        return (ranked[0], self.members[ranked[0]].record.url) if ranked else None


def _member(peer_id: bytes) -> Member:
    record = MemberRecord(
        url="http://127.0.0.1:1", roles=("learner",), reachable=False, manifest="m", learning=True
    )
    return Member(peer_id, record, expires_at=2e9)


def _node() -> tuple[PeerNode, FakeMembership]:
    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    old, new = signer(2).peer_id, signer(3).peer_id
    membership = FakeMembership(records={old: _member(old), new: _member(new)})
    membership.members = {
        old: membership.records[old]
    }  # the new member published after our last read
    node.membership = membership  # type: ignore[assignment]
    return node, membership


def _successor_and_retiring() -> tuple[PeerNode, PeerNode]:
    """Two peers of one swarm: the successor (key 2) sees the retiring owner (key 1) as a member
    that may own fragments."""
    model = tiny_model()
    successor = PeerNode(RunConfig(max_tokens_per_step=64), signer(2), model, tiny_plan(model))
    retiring = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    record = MemberRecord(
        url="http://127.0.0.1:1",
        roles=("learner", "owner"),
        reachable=True,
        manifest="m",
        learning=True,
    )
    successor.membership = FakeMembership(records={})  # type: ignore[assignment]
    successor.membership.members = {
        signer(1).peer_id: Member(signer(1).peer_id, record, 2e9, certified_owner=True)
    }
    return successor, retiring


def _hand_in_memory(retiring: PeerNode, successor: PeerNode) -> list[ReplicaState]:
    """Route ``retiring``'s handoffs to ``successor``'s handler in memory, refusing as ``_hand_to``
    does (a fenced refusal raises ``_FencedBy``); returns the states sent, in order."""
    import types

    from node.peer.handoffs import _FencedBy

    sent: list[ReplicaState] = []

    async def hand_to(p: int, target: tuple[bytes, str], state: ReplicaState) -> bool:
        sent.append(state)
        ack = await successor.ownership.on_replica_state(
            types.SimpleNamespace(
                peer_id=retiring.signer.peer_id,  # type: ignore[arg-type]
                message=state,
                blobs_digest=None,
            )
        )
        if not ack.accepted and ack.reason.startswith("fenced"):
            raise _FencedBy(ack)
        return ack.accepted

    retiring.handoffs._hand_to = hand_to  # type: ignore[method-assign]
    return sent


async def test_a_new_member_is_admitted_after_one_lookup() -> None:
    node, membership = _node()
    assert await node.presence.authorize(signer(2).peer_id) and membership.refreshes == 0
    assert await node.presence.authorize(signer(3).peer_id) and membership.refreshes == 1
    assert await node.presence.authorize(signer(3).peer_id) and membership.refreshes == 1


async def test_strangers_cost_at_most_one_lookup_per_gap() -> None:
    node, membership = _node()
    stranger, other = signer(40).peer_id, signer(41).peer_id
    assert not await node.presence.authorize(stranger) and membership.refreshes == 1
    assert (
        not await node.presence.authorize(stranger) and membership.refreshes == 1
    )  # remembered: no lookup
    assert (
        not await node.presence.authorize(other) and membership.refreshes == 1
    )  # inside the gap: no lookup
    assert other not in node.presence._unknown  # refused unread: may be looked up after the gap
    for n in range(100, 200):
        assert not await node.presence.authorize(signer(n).peer_id)
    assert membership.refreshes == 1 and node.presence.member_lookups == 1


def test_the_token_cap_must_come_from_the_swarm_config() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        PeerNode(RunConfig(), signer(1), model, tiny_plan(model))


async def test_long_polls_are_capped_per_key_and_per_anonymous_address() -> None:
    """Held long-polls tie up connections: a key may hold two per fragment, an address that
    names no key a bounded number; the next one is refused with 429, not queued."""
    import asyncio

    from aiohttp.test_utils import make_mocked_request

    from node.diloco.owner import FragmentOwner, OwnerConfig, OwnerStart
    from node.wire.admission import ADMITTED, Admitted
    from node.wire.transport import Busy
    from protocol.diloco.merge import MergeConfig
    from protocol.diloco.outer import OuterConfig
    from tests.node.fakes import flat_of, shapes_of

    model = tiny_model()
    plan = tiny_plan(model)
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, plan)
    node.owners[0] = FragmentOwner(
        OwnerConfig(
            swarm="atoll-local",
            fragment=plan.fragments[0],
            shapes=tuple(shapes_of(model, plan)[0]),
            merge=MergeConfig(),
            outer=OuterConfig(),
        ),
        OwnerStart(
            theta=flat_of(model, plan, 0),
        ),
        signer=signer(1),
    )

    def poll(key: bytes | None) -> object:
        request = make_mocked_request(
            "GET", "/v1/fragments/0/next?after=0&wait=5", match_info={"p": "0", "kind": "next"}
        )
        if key is not None:
            request[ADMITTED] = Admitted(key, None)
        return request

    cap = 2 * len(plan.fragments) + 2
    held = [asyncio.create_task(node.serving.on_fetch(poll(b"k" * 32))) for _ in range(cap)]  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    with pytest.raises(Busy, match="long-polls from key:"):
        await node.serving.on_fetch(poll(b"k" * 32))  # type: ignore[arg-type]
    other = asyncio.create_task(
        node.serving.on_fetch(poll(b"o" * 32))
    )  # another key is not affected
    await asyncio.sleep(0.05)
    assert not other.done()
    await node.owners[0].retire()  # releases every long-poll at once
    await asyncio.gather(*held, other)
    assert not node.serving._long_polls  # all given back


async def test_a_stale_fence_is_passed_with_a_higher_epoch_and_a_real_one_is_not() -> None:
    """After an owner and its replica both die, the new owner starts from the newest published
    version with an epoch from its own older records. A replica whose highest epoch ended at an
    older version than ours is stale news: the handoff goes again above it. A fence that knows
    our version or a later one is real: the owner stops."""
    from protocol.wire.messages import ReplicaAck
    from tests.node.fakes import FakeClock, flat_of, make_owner, shapes_of

    model = tiny_model()
    plan = tiny_plan(model)
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, plan)
    owner = make_owner(
        plan, shapes_of(model, plan), 0, flat_of(model, plan, 0), FakeClock(), version=184
    )
    node.owners[0] = owner
    state = owner.snapshot()
    state = dataclasses.replace(state, version=185)  # the next version's handoff, at epoch 0

    def ack(epoch: int, version: int) -> ReplicaAck:
        return ReplicaAck(
            accepted=False,
            epoch=epoch,
            version=version,
            reason=f"fenced: fragment 0 is at epoch {epoch} here (version {version})",
        )

    assert (
        node.handoffs._above_stale_fence(0, state, ack(3, 184)) is None
    )  # it knows our version: real
    assert node.handoffs._above_stale_fence(0, state, ack(3, 200)) is None  # ahead of us: real
    assert node.handoffs._above_stale_fence(0, state, ack(0, 100)) is None  # not a higher epoch
    bumped = node.handoffs._above_stale_fence(0, state, ack(3, 130))
    assert bumped is not None and bumped.epoch == owner.epoch == 4 and bumped.version == 185
    assert node.replicas.held[0].epoch == 4  # and this peer now refuses handoffs below it


async def test_a_retiring_owner_hands_its_newer_state_past_a_successors_stale_fence() -> None:
    """The successor owned the fragment twice from version 0 while it joined (its fence: epoch 1,
    version 0) and does not own it now. The retiring owner's version 40, at epoch 0, was refused
    ("fenced: fragment 0 is at epoch 1 here (version 0)") and dropped: the successor then owned the
    fragment from version 0 and refused every learner's work as ahead of it. Handed again under
    the fence's epoch it is taken, momentum included; a fence at our version still turns it away."""

    import torch

    from node.diloco.replica import encode_state

    successor, retiring = _successor_and_retiring()
    n = successor.replicas.numels[0]
    sent = _hand_in_memory(retiring, successor)
    target = (signer(2).peer_id, "http://127.0.0.1:2")
    successor.replicas.fence(0, 1, 0, b"\x00" * 32)  # its own brief ownership, from version 0
    newest = encode_state(
        swarm=successor.cfg.swarm,
        fragment=0,
        epoch=0,
        version=40,
        digest=b"\x07" * 32,
        theta=torch.ones(n),
        momentum=torch.full((n,), 0.5),
    )
    await retiring.handoffs.hand_on(0, target, newest)
    assert [x.epoch for x in sent] == [0, 1]  # refused at epoch 0, taken under the fence's epoch
    taken = successor.replicas.states[0]
    assert (taken.version, taken.epoch) == (40, 1) and taken.momentum is not None
    assert successor.replicas.held[0].version == 40
    sent.clear()
    successor.replicas.fence(0, 3, 40, b"\x07" * 32)  # a fence at our version is real: no retry
    await retiring.handoffs.hand_on(0, target, dataclasses.replace(newest, epoch=2))
    assert [x.epoch for x in sent] == [2] and successor.replicas.states[0].epoch == 1


async def test_a_replica_hands_its_state_to_a_successor_it_refused() -> None:
    """The replica of a failed owner holds version 84 from epoch 1; the rendezvous made another
    peer the owner, which synced version 84 and hands its version 85 at epoch 0: refused. The
    replica then hands that successor its state (momentum included), once, instead of leaving
    the fragment to an owner that steps back."""
    import torch

    from node.diloco.replica import Handed

    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    n = node.replicas.numels[0]
    node.replicas.restore(
        Handed(0, 1, 84, b"\x07" * 32, torch.ones(n), torch.full((n,), 0.5), b"", {})
    )
    handed: list[tuple[int, tuple[bytes, str], ReplicaState]] = []

    async def record(p: int, target: tuple[bytes, str], state: ReplicaState) -> None:
        handed.append((p, target, state))

    node.handoffs.hand_on = record  # type: ignore[method-assign]
    node.started.tg = Tasks()  # type: ignore[assignment]
    successor = signer(5).peer_id

    def refused(version: int, epoch: int) -> ReplicaState:
        return dataclasses.replace(handed_state, version=version, epoch=epoch)

    from node.diloco.replica import encode_state

    handed_state = encode_state(
        swarm=node.cfg.swarm,
        fragment=0,
        epoch=0,
        version=85,
        digest=b"\x08" * 32,
        theta=torch.zeros(n),
        momentum=None,
    )
    node.handoffs.pass_on_held(
        refused(86, 0), "http://127.0.0.1:9", successor
    )  # not built on what we hold
    node.handoffs.pass_on_held(
        refused(85, 1), "http://127.0.0.1:9", successor
    )  # not from a lower epoch
    await asyncio.sleep(0)
    assert handed == []
    node.handoffs.pass_on_held(refused(85, 0), "http://127.0.0.1:9", successor)
    node.handoffs.pass_on_held(refused(85, 0), "http://127.0.0.1:9", successor)  # once per version
    await asyncio.sleep(0)
    assert len(handed) == 1
    p, target, state = handed[0]
    assert (p, target, state.version, state.epoch) == (0, (successor, "http://127.0.0.1:9"), 84, 1)
    assert state.momentum  # the momentum goes with it
    # the same version with another content: the owner we hold it from died before publishing
    # it; a new owner at a higher epoch that merged its own gets ours, under its epoch
    other = signer(6).peer_id
    node.handoffs.pass_on_held(
        dataclasses.replace(handed_state, version=84, epoch=3), "http://127.0.0.1:8", other
    )
    node.handoffs.pass_on_held(
        dataclasses.replace(handed_state, version=84, epoch=3, digest=b"\x07" * 32),
        "http://127.0.0.1:8",
        signer(7).peer_id,
    )  # the same content: nothing to pass on
    await asyncio.sleep(0)
    assert len(handed) == 2
    assert (handed[1][1][0], handed[1][2].version, handed[1][2].epoch) == (other, 84, 3)
    # an owner behind us: a retiring owner handed its newest (84) to us, the successor in its
    # view, while the others' view made another peer the owner from its own older state (82,
    # its own epoch 5); it steps back when we refuse its 83, and takes ours under its epoch
    behind = signer(8).peer_id
    node.handoffs.pass_on_held(
        dataclasses.replace(handed_state, version=83, epoch=5), "http://127.0.0.1:7", behind
    )
    await asyncio.sleep(0)
    assert len(handed) == 3
    assert (handed[2][1][0], handed[2][2].version, handed[2][2].epoch) == (behind, 84, 5)


def test_a_synchronous_round_waits_for_every_provisioned_learner_but_the_finished() -> None:
    """Synchronous DiLoCo is not elastic: a learner that died is waited for until it is back
    (the paper's baseline); one that finished training is not. Decoupled waits for live ones."""
    model = tiny_model()
    node = PeerNode(
        RunConfig(max_tokens_per_step=64, mode="sync", peers=4), signer(1), model, tiny_plan(model)
    )
    ids = [signer(n).peer_id for n in (2, 3, 4)]
    membership = FakeMembership(records={})
    membership.members = {pid: _member(pid) for pid in ids}  # three of four are up so far
    node.membership = membership  # type: ignore[assignment]
    assert node.expected.expected_learners() == 4
    del membership.members[ids[0]]  # killed: its record lapsed
    assert node.expected.expected_learners() == 4  # still waited for
    done = _member(ids[1])
    membership.members[ids[1]] = Member(
        ids[1], dataclasses.replace(done.record, learning=False), 2e9
    )
    assert node.expected.expected_learners() == 3  # finished: no longer waited for


async def test_replicas_that_do_not_see_us_stop_the_version_and_dead_ones_do_not(
    monkeypatch,
) -> None:
    """A version published while no replica holds it could get a second content from the owner
    the others' views name. Replicas that cannot be reached may be dead: publish, counted as
    unreplicated. A replica that answers 403 (we are not a member in its view) is alive and
    routes around us: do not publish (fenced), and hand nothing to a successor that refuses so."""
    import aiohttp
    import torch

    from node.diloco.replica import NotAMemberThere, encode_state
    from node.peer import handoffs

    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    replicas = [(signer(n).peer_id, f"http://127.0.0.1:{n}") for n in (2, 3)]

    class Members(FakeMembership):
        ttl_s = 20.0

        def ranked(
            self, swarm: str, p: int, r: int, *, exclude: object = ()
        ) -> list[tuple[bytes, str]]:
            return [t for t in replicas if t[0] not in exclude][:r]  # type: ignore[operator]

    node.membership = Members(records={})  # type: ignore[assignment]
    n = node.replicas.numels[0]
    state = encode_state(
        swarm=node.cfg.swarm,
        fragment=0,
        epoch=0,
        version=5,
        digest=b"\x01" * 32,
        theta=torch.zeros(n),
        momentum=None,
    )
    asked: list[str] = []

    async def refusing(
        transport: object, signer_: object, target: tuple[bytes, str], *_: object, **__: object
    ) -> None:
        asked.append(target[1])
        raise NotAMemberThere(
            "handoff refused (403): peer is not a member of this swarm", penalty=0.0
        )

    monkeypatch.setattr(handoffs, "hand_over", refusing)
    reason = await node.handoffs.replicate(0, state)
    assert reason is not None and reason.startswith("fenced") and "not a member" in reason
    # the first refusal stops it: a peer further down the list may not have seen the other owner
    assert asked == ["http://127.0.0.1:2"] and node.handoffs.unreplicated == 0
    await node.handoffs.hand_on(
        0, replicas[0], state
    )  # a successor that does not see us: nothing raised
    assert len(asked) == 2

    async def unreachable(*_: object, **__: object) -> None:
        raise aiohttp.ClientConnectorError(None, OSError("connection refused"))  # type: ignore[arg-type]

    monkeypatch.setattr(handoffs, "hand_over", unreachable)
    monkeypatch.setattr(node.presence, "unreachable", lambda peer_id: None)
    assert await node.handoffs.replicate(0, state) is None and node.handoffs.unreplicated == 1


async def test_a_retiring_owner_hands_a_state_the_successor_holds_by_reference() -> None:
    """A fragment moves to the peer that was its replica: that peer took the retiring owner's
    newest version already, so the handoff names it (no tensors) and the successor takes it from
    its store; a successor that holds something else refuses, and the whole state follows."""

    import torch

    from node.diloco.replica import encode_state

    successor, retiring = _successor_and_retiring()
    n = successor.replicas.numels[0]
    sent = _hand_in_memory(retiring, successor)
    target = (signer(2).peer_id, "http://127.0.0.1:2")
    theta = torch.linspace(-1, 1, n)
    v7 = encode_state(
        swarm=successor.cfg.swarm,
        fragment=0,
        epoch=0,
        version=7,
        digest=b"\x07" * 32,
        theta=theta,
        momentum=None,
    )
    assert successor.replicas.offer(
        signer(1).peer_id, v7
    ).accepted  # as our replica, before we published 7
    await retiring.handoffs.hand_on(0, target, dataclasses.replace(v7, epoch=1))
    assert len(sent) == 1 and sent[0].theta == () and sent[0].base_version == 7  # by reference only
    assert (
        torch.equal(successor.replicas.states[0].theta, theta)
        and successor.replicas.states[0].epoch == 1
    )
    sent.clear()
    v8 = encode_state(
        swarm=successor.cfg.swarm,
        fragment=0,
        epoch=1,
        version=8,
        digest=b"\x08" * 32,
        theta=theta + 1,
        momentum=None,
    )
    await retiring.handoffs.hand_on(
        0, target, v8
    )  # version 8 never reached it: refused by reference, then whole
    assert [len(s.theta) for s in sent] == [0, 1]
    assert successor.replicas.states[0].version == 8 and torch.equal(
        successor.replicas.states[0].theta, theta + 1
    )


async def test_a_running_owner_behind_a_retiring_owners_epoch_and_version_steps_back_for_its_state() -> (
    None
):
    """Views differed: peer B owned fragment 0 at epoch 6 and merged up to version 32, while peer A
    took the fragment over at epoch 7 and published 33; then the views moved it to B and A handed
    its version 33 on. B refused it as "moved on" and later published another 33 (one version,
    two contents, in a 32-peer run). Now B takes the state, stops publishing, and the next
    membership pass owns the fragment again from A's 33. A handoff that is not above B in both
    epoch and version is still refused, and B keeps owning."""
    import types

    import torch

    from node.diloco.replica import encode_state
    from tests.node.fakes import FakeClock, contribution, flat_of, make_owner, shapes_of

    successor, retiring = _successor_and_retiring()
    model = tiny_model()
    plan = tiny_plan(model)
    shapes, clock = shapes_of(model, plan), FakeClock()
    owner = make_owner(plan, shapes, 0, flat_of(model, plan, 0), clock, who=signer(2), version=31)
    owner.epoch = 6
    delta = torch.linspace(-0.05, 0.05, owner.theta.numel())
    assert (
        await owner.contribute(
            signer(4).peer_id, contribution(delta, shapes[0], base_version=31, owner=owner)
        )
    ).accepted
    clock.advance(60.0)
    await owner.tick()
    assert (owner.version, owner.merges_done) == (32, 1)
    successor.owners[0] = owner
    successor.replicas.fence(0, 6, 32, owner.digest_of(32))
    reconciles: list[object] = []

    class Tasks:
        def create_task(self, coro):  # type: ignore[no-untyped-def]
            reconciles.append(coro.__qualname__)
            coro.close()

    successor.started.tg = Tasks()  # type: ignore[assignment]
    n = successor.replicas.numels[0]
    sent = _hand_in_memory(retiring, successor)
    target = (signer(2).peer_id, "http://127.0.0.1:2")

    def state(epoch: int, version: int, fill: float) -> ReplicaState:
        return encode_state(
            swarm=successor.cfg.swarm,
            fragment=0,
            epoch=epoch,
            version=version,
            digest=bytes([version]) * 32,
            theta=torch.full((n,), fill),
            momentum=None,
        )

    for epoch, version in ((7, 32), (5, 33), (6, 33)):  # not above it in both: refused, B owns on
        ack = await successor.ownership.on_replica_state(
            types.SimpleNamespace(
                peer_id=signer(1).peer_id,  # type: ignore[arg-type]
                message=state(epoch, version, 1.0),
                blobs_digest=None,
            )
        )
        assert not ack.accepted and ack.reason.startswith("fenced") and owner.fenced is None
    assert 0 not in successor.replicas.states and reconciles == []

    await retiring.handoffs.hand_on(0, target, state(7, 33, 2.0))
    assert (
        sent and sent[-1].theta
    )  # by reference refused (B never held A's 33), then the whole state: taken
    handed = successor.replicas.states[0]
    assert (handed.version, handed.epoch) == (33, 7) and torch.equal(
        handed.theta, torch.full((n,), 2.0)
    )
    assert owner.fenced is not None and "past this owner's version 32 at epoch 6" in owner.fenced
    assert owner.retired and owner.version == 32  # B published nothing more
    assert reconciles == ["Ownership.reconcile"]  # owning again from A's 33 comes next


async def test_a_retired_owner_leaves_its_counts_and_not_its_state() -> None:
    """A peer whose fragments change hands often (views that flap under load) ran a new owner
    each time, and kept every retired one whole for its counts: theta, momentum, spare buffers
    and sealed versions, ~100 fragment vectors on one owner of a 32-peer run. Now only the
    counts stay, and they still add up."""
    import asyncio
    import gc
    import weakref

    import torch

    from tests.node.fakes import FakeClock, contribution, flat_of, make_owner, shapes_of

    node, _ = _node()
    model = tiny_model()
    plan = tiny_plan(model)
    shapes, clock = shapes_of(model, plan), FakeClock()
    owner = make_owner(plan, shapes, 0, flat_of(model, plan, 0), clock, who=signer(1), version=3)
    delta = torch.linspace(-0.05, 0.05, owner.theta.numel())
    assert (
        await owner.contribute(
            signer(4).peer_id, contribution(delta, shapes[0], base_version=3, owner=owner)
        )
    ).accepted
    clock.advance(60.0)
    await owner.tick()
    assert owner.merges_done == 1

    class Task:
        def cancel(self) -> None:
            pass

    node.owners[0], node.ownership._owner_tasks[0] = owner, Task()  # type: ignore[assignment]
    gone, theta = weakref.ref(owner), weakref.ref(owner.theta)
    node.ownership._drop_owner(0)
    del owner
    for _ in range(3):  # the loop lets go of the merge's finished future
        await asyncio.sleep(0)
    gc.collect()
    assert gone() is None and theta() is None
    (counts,) = node.all_owners()
    assert counts.merges_done == 1 and counts.penalties[signer(4).peer_id]["merged"] == 1
    assert node.penalties()[signer(4).peer_id.hex()]["merged"] == 1


def test_a_fragment_retired_many_times_keeps_two_counts_that_add_up() -> None:
    """Views that flap start and retire an owner of the same fragment again and again: the
    counts kept do not grow with it (the earlier ones folded into one, the last kept live for a
    merge that may still finish), and every total still adds up."""
    from node.diloco.owner import OwnerCounts

    node, _ = _node()

    class Retired:
        def __init__(self, n: int) -> None:
            self.counts = OwnerCounts(0, merges_done=n)
            self.counts.penalties[signer(4).peer_id]["merged"] += n

    class Task:
        def cancel(self) -> None:
            pass

    for n in range(1, 101):
        node.owners[0], node.ownership._owner_tasks[0] = Retired(n), Task()  # type: ignore[assignment]
        node.ownership._drop_owner(0)
    assert len(node.ownership.retired[0]) == 2
    assert sum(c.merges_done for c in node.all_owners()) == 5050
    assert node.penalties()[signer(4).peer_id.hex()]["merged"] == 5050
    node.ownership.retired[0][-1].merged("a merge that finished after its owner retired")
    assert sum(c.merges_done for c in node.all_owners()) == 5051


async def test_a_final_version_from_an_owner_that_moved_is_asked_of_the_new_one() -> None:
    """Seen once in a 32-peer run slowed by tracing: views of the members differed for minutes, a
    successor that had split off declared its version 15 of fragment 2 final while the owner the
    others saw published 19, and two peers ended on 15. After the finals are in, a fresh read of
    the members moved the fragment back; the learner now asks the new owner again."""
    import types

    import torch

    node, membership = _node()
    x, y = signer(5).peer_id, signer(6).peer_id
    q = len(node.shapes) - 1  # the fragment whose views differ
    assert q >= 1
    owner_now = {p: (x if p == q else y) for p in range(len(node.shapes))}
    refreshes_before = membership.refreshes

    async def refresh(*, full: bool = False) -> dict[bytes, Member]:
        assert full
        membership.refreshes += 1
        owner_now[q] = y  # the view settles: y owns the fragment again
        return membership.members

    membership.refresh = refresh  # type: ignore[method-assign]
    node.presence.owner_of = lambda p: (owner_now[p], f"http://{owner_now[p].hex()[:8]}")  # type: ignore[method-assign]
    asked: list[tuple[int, bytes, int]] = []

    async def fetch(p: int, *, after: int, wait_s: float, final: bool, owner: tuple[bytes, str]):  # type: ignore[no-untyped-def]
        assert final
        asked.append((p, owner[0], after))
        version = 15 if owner[0] == x else 19
        return version, torch.full((4,), float(version))

    node.net = types.SimpleNamespace(received=collections.defaultdict(int), fetch=fetch)  # type: ignore[assignment]
    out = await node.fetch_final(settle_s=0.01)
    assert {p: v for p, (v, _) in out.items()} == {p: 19 for p in range(len(node.shapes))}
    # and then asked whether 19 is still its final version (it is)
    assert [a for a in asked if a[0] == q] == [(q, x, 0), (q, y, 0), (q, y, 19)]
    assert (
        membership.refreshes == refreshes_before + 2
    )  # one full read moved it, the next found it still

    owner_now[q] = (
        x  # views that never converge: asked again at most `rechecks` times, then it ends
    )
    membership.refresh = FakeMembership.refresh.__get__(membership)  # type: ignore[method-assign]

    def flapping(p: int) -> tuple[bytes, str]:
        if p == q:
            owner_now[q] = x if owner_now[q] == y else y
        return owner_now[p], "http://flapping"

    node.presence.owner_of = flapping  # type: ignore[method-assign]
    asked.clear()
    await node.fetch_final(settle_s=0.01, rechecks=2)
    assert len([a for a in asked if a[0] == q]) == 3


async def test_a_final_version_its_owner_replaced_with_a_newer_one_is_taken_again() -> None:
    """Seen in a chaos run (4 peers, an owner killed and restarted from its checkpoint): the
    restarted owner declared its checkpoint's version 32 of a fragment final, a learner took it,
    and 50 ms later the owner took over version 53 from the live owner's handoff and held that
    final; the learner ended on 32, the others on 53. The owner has not moved, so the learner
    now asks it whether the final version it holds is still the final one."""
    import types

    import torch

    node, membership = _node()
    y = signer(6).peer_id
    q = len(node.shapes) - 1
    finals = {p: 53 for p in range(len(node.shapes))}
    finals[q] = 32  # what the owner says first; it holds 53 final right after
    node.presence.owner_of = lambda p: (y, "http://y")  # type: ignore[method-assign]
    asked: list[tuple[int, int]] = []

    async def fetch(p: int, *, after: int, wait_s: float, final: bool, owner: tuple[bytes, str]):  # type: ignore[no-untyped-def]
        assert final and owner[0] == y
        asked.append((p, after))
        version = finals[p]
        if p == q:
            finals[q] = 53  # the handoff lands
        return version, torch.full((4,), float(version))

    node.net = types.SimpleNamespace(received=collections.defaultdict(int), fetch=fetch)  # type: ignore[assignment]
    out = await node.fetch_final(settle_s=0.01)
    assert {p: v for p, (v, _) in out.items()} == {p: 53 for p in range(len(node.shapes))}
    assert torch.equal(out[q][1], torch.full((4,), 53.0))
    # asked once, again over the 32 it got, and once more to see 53 is still the final one
    assert [a for a in asked if a[0] == q] == [(q, 0), (q, 32), (q, 53)]


async def test_our_record_is_republished_while_the_membership_loop_is_held_up(monkeypatch) -> None:
    """Under load a membership pass can take longer than the record's TTL (a slow read, a
    handoff, a merge that ``set_expected`` starts): our record is kept live by a loop of its own,
    so others do not hand our fragments to a successor meanwhile."""
    import asyncio

    import node.peer.presence as presence
    import node.peer.renewal as renewal

    monkeypatch.setattr(renewal, "REPUBLISH_S", 0.05)
    monkeypatch.setattr(presence, "RECORD_CHECK_S", 0.01)
    node, membership = _node()
    published: list[MemberRecord] = []

    async def publish(record: MemberRecord, on_held: Callable[[], None]) -> int:
        published.append(record)
        on_held()
        return 1

    async def held_up() -> None:
        await asyncio.sleep(3600)

    membership.publish = publish  # type: ignore[attr-defined]
    node.ownership.reconcile = held_up  # type: ignore[method-assign]
    loops = [
        asyncio.create_task(node._membership_loop()),
        asyncio.create_task(node.presence.record_loop()),
    ]
    await asyncio.sleep(0.5)
    for loop in loops:
        loop.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    assert membership.refreshes == 1  # the membership loop is stuck in its first pass
    assert len(published) >= 4 and node.presence.record_published_at is not None


async def test_an_owner_whose_record_may_have_expired_does_not_publish(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An owner's member record last stored longer ago than its TTL less a margin may have
    expired in others' views, and a successor may be merging the fragment: the next version is
    not handed on (the owner retires, fenced) unless our record is stored again within
    ``LEASE_WAIT_S`` (here cut short)."""
    import time

    from node.peer import handoffs
    from node.peer.handoffs import LEASE_MARGIN_S

    monkeypatch.setattr(handoffs, "LEASE_WAIT_S", 0.05)

    node, membership = _node()
    membership.ttl_s = 20.0  # type: ignore[attr-defined]
    membership.ranked = lambda *a, **k: []  # type: ignore[attr-defined]  # no replica: nothing else fences
    import torch

    from node.diloco.replica import encode_state

    state = encode_state(
        swarm="s",
        fragment=0,
        epoch=0,
        version=3,
        digest=bytes(32),
        theta=torch.zeros(4),
        momentum=None,
        merged={},
    )
    node.presence.record_renewal().stored_at = time.monotonic() - (20.0 - LEASE_MARGIN_S) + 2.0
    assert await node.handoffs.replicate(0, state) is None
    node.presence.record_renewal().stored_at = time.monotonic() - (20.0 - LEASE_MARGIN_S) - 0.5
    reason = await node.handoffs.replicate(0, state)
    assert (
        reason is not None
        and reason.startswith("fenced: our member record")
        and node.handoffs.lease_lapses == 1
    )


async def test_an_owner_handing_out_a_final_version_tells_its_replica_once() -> None:
    """Should the owner die within the final hold, its replica takes the fragment over: it must
    hold the version final too. The first final answer hands the replica a reference to the
    version it holds, marked final (no tensors travel); later answers send nothing more."""
    from tests.node.fakes import SWARM, FakeClock, flat_of, make_owner, shapes_of

    replica, owner_node = _successor_and_retiring()
    replica.replicas.swarm = SWARM  # the fake owner's
    sent = _hand_in_memory(owner_node, replica)
    model = tiny_model()
    plan = tiny_plan(model)
    owner = make_owner(
        plan, shapes_of(model, plan), 0, flat_of(model, plan, 0), FakeClock(), version=7
    )
    owner.on_final = owner_node.handoffs.final_declared  # as _start_owner wires it
    owner_node.owners[0] = owner
    assert replica.replicas.offer(
        signer(1).peer_id, owner.snapshot()
    ).accepted  # handed before publishing
    assert not replica.replicas.states[0].final
    membership = FakeMembership(records={})
    membership.ranked = lambda swarm, p, n, exclude: [(signer(2).peer_id, "http://127.0.0.1:2")]  # type: ignore[attr-defined]
    owner_node.membership = membership  # type: ignore[assignment]
    owner_node.expected.expected_learners = lambda: 0  # type: ignore[method-assign]
    owner_node.presence.suspects = lambda: set()  # type: ignore[method-assign]
    tasks = Tasks()
    owner_node.started.tg = tasks  # type: ignore[assignment]
    assert await owner_node.finals.wait(owner, 1.0) is owner.latest
    await tasks.done()
    assert [(s.version, s.final, s.theta, s.base_version) for s in sent] == [
        (7, True, (), 7)
    ]  # by reference
    held = replica.replicas.states[0]
    assert held.final and held.version == 7 and held.digest == owner.digest_of(7)
    assert await owner_node.finals.wait(owner, 1.0) is owner.latest
    await tasks.done()
    assert len(sent) == 1


def _owning_node(*, latest: dict[int, int]) -> tuple[PeerNode, torch.Tensor, Tasks]:
    """A node that can start owning fragment 0 (``_start_owner``): its learner holds fragment 0
    at each version in ``latest`` with the initial state, its tasks in a ``Tasks``."""
    import types

    from tests.node.fakes import flat_of

    model = tiny_model()
    plan = tiny_plan(model)
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, plan)
    theta = flat_of(model, plan, 0)
    tasks = Tasks()
    node.started.tg = tasks  # type: ignore[assignment]
    node.net = types.SimpleNamespace(
        latest={p: (v, theta) for p, v in latest.items()},  # type: ignore[assignment]
        island_initial={0: theta, 1: flat_of(model, plan, 1)},
    )
    return node, theta, tasks


async def test_an_owner_started_from_a_state_handed_out_as_final_holds_it_final() -> None:
    """The replica of an owner that died within its final hold starts owning from the handed
    state: it refuses late work as the dead owner would have."""
    from node.diloco.replica import Handed

    node, theta, tasks = _owning_node(latest={})
    told: list[int] = []
    node.handoffs.final_declared = lambda owner: told.append(owner.version)  # type: ignore[method-assign]
    for final in (True, False):
        node.replicas.states[0] = Handed(
            0, 1, 12, b"\x07" * 32, theta.clone(), None, signer(2).peer_id, {}, final=final
        )
        node.ownership._start_owner(0)
        owner = node.owners.pop(0)
        assert owner.version == 12 and owner.holds_final() is final
        assert (owner.final_hold() is not None) is final
    assert told == [12]  # it tells its own replica in turn, so a chain of takeovers keeps the hold
    await tasks.cancel()


async def test_an_owner_that_displaces_a_live_one_holds_its_first_merge_and_a_failover_does_not() -> (
    None
):
    """A peer that comes back and takes its fragment back from the live owner that stood in
    starts from the version it holds: it merges nothing until that owner's handoff (or
    ``CATCH_UP_S``). A replica taking over from a dead owner starts from the state that owner
    handed it before publishing, and merges at once, as does one whose last seen owner has died
    (not a replica: the live one next in rank), and a swarm's first owner."""
    from node.diloco.replica import Handed
    from node.peer.ownership import CATCH_UP_S

    node, theta, tasks = _owning_node(latest={0: 5})
    membership = FakeMembership(records={})
    membership.owner_of = lambda swarm, p, exclude: (signer(2).peer_id, "http://127.0.0.1:2")  # type: ignore[attr-defined]
    node.membership = membership  # type: ignore[assignment]
    node.presence.suspects = lambda: set()  # type: ignore[method-assign]
    node.ownership._start_owner(0)
    owner = node.owners.pop(0)
    held = owner.merger.held_until
    assert (
        owner.version == 5
        and held is not None
        and held == pytest.approx(owner.clock() + CATCH_UP_S, abs=1.0)
    )
    node.replicas.states[0] = Handed(
        0, 1, 5, owner.digest_of(5), theta.clone(), None, signer(2).peer_id, {}
    )
    node.ownership._start_owner(0)
    assert node.owners.pop(0).merger.held_until is None  # from the dead owner's handoff
    node.replicas.states.clear()
    # the owner the last ownership pass saw: taken from it while it lives, not once it is gone
    dead = signer(3).peer_id
    node.ownership._last_owner[0] = dead
    membership.members = {dead: _member(dead)}
    node.ownership._start_owner(0)
    assert node.owners.pop(0).merger.held_until is not None
    node.presence.suspects = lambda: {dead}  # type: ignore[method-assign]
    node.ownership._start_owner(0)
    assert node.owners.pop(0).merger.held_until is None
    node.presence.suspects = lambda: set()  # type: ignore[method-assign]
    membership.members = {}
    node.ownership._start_owner(0)
    assert node.owners.pop(0).merger.held_until is None
    node.net.latest.clear()  # type: ignore[attr-defined]
    node.ownership._last_owner.clear()
    node.ownership._start_owner(0)
    # at version 0 too while a live owner ranks next: it may have published a version 1 we have
    # not fetched yet (two contents of version 1 at 96 peers, docs/scale_peers.md)
    assert node.owners.pop(0).merger.held_until is not None
    membership.owner_of = lambda swarm, p, exclude: None  # type: ignore[attr-defined]
    node.ownership._start_owner(0)
    assert (
        node.owners.pop(0).merger.held_until is None
    )  # a swarm's first owner: nobody to take the fragment from, nothing merged to hand over
    await tasks.cancel()


def test_events_from_two_threads_reach_the_launcher_as_whole_lines() -> None:
    """The trainer says "ready" while the node's thread says "published": with ``print`` the two
    lines could interleave (text, other text, newline, newline), the launcher skipped both, and a
    restarted peer waited for a "start" that never came (about 500 lines in 20,000 here)."""
    import json
    import subprocess
    import sys

    script = (
        "import sys, threading\n"
        "from node.peer import emit\n"
        "sys.setswitchinterval(1e-6)\n"
        "def work(i):\n"
        "    for k in range(3000):\n"
        "        emit('published', fragment=i, version=k, digest='ab' * 16)\n"
        "ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lines = out.stdout.splitlines()
    events = [json.loads(line) for line in lines]  # raises on a broken line
    assert len(events) == 12000
    assert {(e["fragment"], e["version"]) for e in events} == {
        (i, k) for i in range(4) for k in range(3000)
    }


def _ending_owner(members: dict[bytes, bool], **merge: object) -> tuple[PeerNode, object, object]:
    """A node owning fragment 0 (fake clock, version 3, no replica) whose member records say
    ``members`` (peer id -> learning); returns (node, owner, clock)."""
    from tests.node.fakes import FakeClock, flat_of, make_owner, shapes_of

    model = tiny_model()
    plan = tiny_plan(model)
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, plan)
    clock = FakeClock()
    owner = make_owner(
        plan,
        shapes_of(model, plan),
        0,
        flat_of(model, plan, 0),
        clock,
        version=3,
        **{"quorum": 1, **merge},
    )
    node.owners[0] = owner
    records = {}
    for pid, learning in members.items():
        record = MemberRecord(
            url="http://127.0.0.1:1",
            roles=("learner",),
            reachable=False,
            manifest="m",
            learning=learning,
        )
        records[pid] = Member(pid, record, expires_at=2e9)
    membership = FakeMembership(records=records, members=dict(records))
    membership.learners = lambda: sum(m.record.learning for m in membership.members.values())  # type: ignore[attr-defined]
    membership.ranked = lambda *a, **k: []  # type: ignore[attr-defined]
    node.membership = membership  # type: ignore[assignment]
    node.presence.suspects = lambda: set()  # type: ignore[method-assign]
    return node, owner, clock


async def test_a_member_claiming_to_learn_that_never_sends_does_not_hold_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer that joined and never trained (once: a restarted peer the launcher never started),
    or a hostile member republishing "learning" for ever, held every final fetch until it timed
    out. With nobody's pace known the owner now waits 120 s from when it began owning, then
    declares the fragment final and says whom it did not wait for."""
    silent = signer(7).peer_id
    node, owner, clock = _ending_owner({signer(1).peer_id: False, silent: True})
    assert await node.finals.wait(owner, 0.2) is None  # owning since t = 1000: waits
    clock.advance(119.0)
    assert await node.finals.wait(owner, 0.2) is None
    clock.advance(1.0)
    with caplog.at_level("WARNING", logger="atoll.peer"):
        final = await node.finals.wait(owner, 0.2)
    assert final is owner.latest and owner.holds_final
    assert (
        f"not waiting for member {silent.hex()[:8]}" in caplog.text
        and "never heard from" in caplog.text
    )


async def _contribute(owner, who: bytes, *, steps: int = 4, step_time: float = 1.0):  # type: ignore[no-untyped-def]
    import dataclasses

    import torch

    from tests.node.fakes import contribution, shapes_of

    shapes = shapes_of(tiny_model(), tiny_plan(tiny_model()))[0]
    delta = torch.full((owner.theta.numel(),), 0.01)
    msg = contribution(delta, shapes, base_version=owner.version, owner=owner)
    return await owner.contribute(
        who, dataclasses.replace(msg, steps=steps, sender_step=steps, step_time=step_time)
    )


async def test_a_learner_still_sending_is_waited_for_until_three_of_its_intervals_pass() -> None:
    """A slow learner at work (here one contribution every 10 s) keeps the fragment open: silence
    counts from its last contribution, and only 30 s (its floor; 3 x 10 s) of nothing ends the wait."""
    learner = signer(7).peer_id
    node, owner, clock = _ending_owner({signer(1).peer_id: False, learner: True})
    for i in range(3):  # at t = 1000, 1010, 1020
        if i:
            clock.advance(10.0)
            await owner.tick()  # the round's grace window is over: merged
        assert (await _contribute(owner, learner)).accepted
    clock.advance(5.0)
    await owner.tick()
    assert await node.finals.wait(owner, 0.2) is None  # the end asked at t = 1025
    clock.advance(24.0)
    assert await node.finals.wait(owner, 0.2) is None  # t = 1049: 29 s quiet, still at work
    clock.advance(1.0)
    assert await node.finals.wait(owner, 0.2) is owner.latest
    assert owner.version == 6  # its three contributions merged; nothing dropped


async def test_members_that_claim_to_learn_and_send_nothing_cannot_stall_the_merges(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seven identities whose records say learning and that never contribute raised the quorum
    (half the learners expected) to 5 of 10, which the three learners at work can never reach:
    no merge, ever. Now, once they have been silent three times the learners' usual interval
    (4 s of work a contribution: 12 s), the owner stops counting them and the round closes on its
    quorum of 2 of 3."""
    real = [signer(10 + i).peer_id for i in range(3)]
    fake = [signer(20 + i).peer_id for i in range(7)]
    node, owner, clock = _ending_owner(
        {pid: True for pid in real + fake}, quorum=1, quorum_fraction=0.5
    )
    await node.expected.tell_expected(owner)
    for pid in real:
        ack = await _contribute(owner, pid)  # 4 steps of 1 s: the usual interval 4 s
        assert ack.accepted and "quorum 5 (K = 5: 0.5 of the 10 learners expected)" in ack.reason
        clock.advance(0.5)
    await owner.tick()
    assert owner.version == 3 and owner.merger.contributors == set(real)  # these are never silent
    clock.advance(10.0)  # the fakes, seen at t = 1000, silent 11.5 s: still counted
    await node.expected.tell_expected(owner)
    await owner.tick()
    assert owner.version == 3
    clock.advance(0.5)
    with caplog.at_level("WARNING", logger="atoll.peer"):
        waited = node.expected.learner_ids_waited_for(owner)
    assert (
        waited == set(real) and caplog.text.count("not waiting for member") == 7
    )  # the fakes, once each
    with caplog.at_level(
        "WARNING", logger="atoll.peer"
    ):  # the end's view (30 s floor), then the rounds' again
        assert node.expected.learner_ids_waited_for(owner, at_end=True) == set(real + fake)
        assert node.expected.learner_ids_waited_for(owner) == set(real)
    assert caplog.text.count("not waiting for member") == 7  # not logged again
    assert await node.expected.tell_expected(owner) == 3 and owner.merger.learners == set(real)
    await owner.tick()
    assert owner.version == 4  # merged: the three learners' work


async def test_identities_that_stopped_without_contributing_do_not_shrink_the_merges() -> None:
    """Fifty identities publish "learning", then "stopped", and never contribute. Counted as
    learners that finished, they put a merge's share at 27 of 53 and scaled every merge of the
    three learners at work to 2/27 of a step; counted only once their work was taken, they count
    for nothing, and the learners' merge is a whole step."""
    real = [signer(10 + i).peer_id for i in range(3)]
    fake = [signer(40 + i).peer_id for i in range(50)]
    node, owner, clock = _ending_owner(
        {pid: True for pid in real + fake}, quorum=1, quorum_fraction=0.5
    )
    node.expected.finished_learners()  # the first read: all fifty seen learning
    members = node.membership.members  # type: ignore[union-attr]

    def stop(pid: bytes) -> None:
        members[pid] = dataclasses.replace(
            members[pid], record=dataclasses.replace(members[pid].record, learning=False)
        )

    for pid in fake:
        stop(pid)
    assert node.expected.finished_learners() == 50
    assert node.expected.finished_learners_heard(owner) == 0
    await node.expected.tell_expected(owner)
    for pid in real[:2]:
        ack = await _contribute(owner, pid)
        assert ack.accepted and "(K = 2: 0.5 of the 3 learners expected)" in ack.reason
    clock.advance(5.0)
    await owner.tick()
    assert owner.version == 4 and "scaled" not in owner.merges[-1]
    stop(real[0])
    assert (
        node.expected.finished_learners_heard(owner) == 0
    )  # one merge of its work: as good as a sybil's (issue 47)
    stop(real[1])
    ack = await _contribute(owner, real[0])  # its end-of-run flush, say: a second merge of its work
    await node.expected.tell_expected(owner)
    clock.advance(5.0)
    await owner.tick()
    assert owner.version == 5 and owner.merger.merges_of(real[0]) == 2
    assert (
        node.expected.finished_learners_heard(owner) == 1
    )  # a learner whose work was taken twice, now finished


async def test_a_joining_peer_asks_the_next_members_when_the_presumed_owner_does_not_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At join a fragment's latest version is asked of the member ranked first without us. With
    bounded loads that need not be the member that took the fragment while we were away (a
    restarted peer then took the fragment over from its own checkpoint two versions behind, and
    refused every learner's work as ahead of it). The next-ranked members are asked in turn;
    only the owner answers, and its version is the one kept."""
    import types

    import torch

    import node.peer.presence as presence
    from node.state.sync import SyncFailed

    node, _ = _node()
    ids = [signer(20 + i).peer_id for i in range(3)]
    ranking = [(pid, f"http://127.0.0.1:{9000 + i}") for i, pid in enumerate(ids)]
    node.membership.members = {pid: _member(pid) for pid in ids}  # type: ignore[union-attr]
    node.membership.ranked = lambda swarm, p, r, exclude=(): ranking[:r]  # type: ignore[union-attr]
    real_owner = {0: ids[0], 1: ids[2]}  # fragment 1 moved to the third-ranked member
    asked: list[tuple[int, bytes]] = []

    async def fake_sync(transport, owner_of, n, shapes, *, swarm, held_versions, max_size):  # type: ignore[no-untyped-def]
        fetched, failures = {}, {}
        for p in range(n):
            source = owner_of(p)
            if source is None:
                failures[p] = "no owner known"
                continue
            asked.append((p, source[0]))
            if source[0] == real_owner[p]:
                fetched[p] = (
                    11,
                    torch.full((sum(int(torch.Size(s).numel()) for s in shapes[p]),), float(p)),
                )
            else:
                failures[p] = f"answered 404 for fragment {p}"
        if failures:
            raise SyncFailed(failures, fetched, n)
        return fetched

    monkeypatch.setattr(presence, "sync_fragments", fake_sync)
    remembered: dict[int, int] = {}
    node.net = types.SimpleNamespace(  # type: ignore[assignment]
        latest={},
        version_jump=lambda p, v: None,
        remember=lambda p, v, flat, digest: remembered.__setitem__(p, v),
        island=types.SimpleNamespace(deliver=lambda p, v, flat: None),
    )
    await node.presence.sync()
    assert remembered == {0: 11, 1: 11}
    assert asked == [(0, ids[0]), (1, ids[0]), (1, ids[1]), (1, ids[2])]
    # the owner, found second, has nothing newer than we hold: synced, and no warning either
    real_owner[1] = ids[1]
    node.net.latest = {1: (11, None)}  # type: ignore[union-attr]
    remembered.clear()

    async def nothing_newer(transport, owner_of, n, shapes, *, swarm, held_versions, max_size):  # type: ignore[no-untyped-def]
        failures = {
            p: "answered 404"
            for p in range(n)
            if owner_of(p) is not None and owner_of(p)[0] != real_owner[p]
        }
        fetched = {
            p: (11, torch.zeros(1))
            for p in range(n)
            if held_versions[p] < 11 and p not in failures and owner_of(p) is not None
        }
        if failures:
            raise SyncFailed(failures, fetched, n)
        return fetched

    monkeypatch.setattr(presence, "sync_fragments", nothing_newer)
    with caplog.at_level("WARNING", logger="atoll.peer"):
        await node.presence.sync()
    assert remembered == {0: 11} and "state sync incomplete" not in caplog.text


async def test_a_new_owner_asks_the_next_ranked_members_for_its_predecessors_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The previous owner is presumed to be the member ranked first without us; when it is
    another (bounded loads), the next-ranked members are asked in turn, and the one that owned
    the fragment hands over its newer version before our first merge."""
    import types

    import node.peer.ownership as owning
    from protocol.errors import RemoteProtocolError

    monkeypatch.setattr(owning, "CATCH_UP_S", 3.0)
    node, owner, clock = _ending_owner({})
    ids = [signer(30 + i).peer_id for i in range(3)]
    ranking = [(pid, f"http://127.0.0.1:{9100 + i}") for i, pid in enumerate(ids)]
    node.membership.ranked = lambda swarm, p, r, exclude=(): ranking[:r]  # type: ignore[union-attr]
    asked: list[bytes] = []
    newer = owner.theta + 0.5

    async def fetch(p: int, *, after: int, wait_s: float, owner: tuple[bytes, str]):  # type: ignore[no-untyped-def]
        asked.append(owner[0])
        if owner[0] != ids[2]:
            raise RemoteProtocolError(f"answered 404 for fragment {p}")
        return (7, newer.clone()) if after < 7 else None

    node.net = types.SimpleNamespace(fetch=fetch)  # type: ignore[assignment]
    task = asyncio.create_task(node.ownership._run_owner(owner, ranking[0]))
    try:
        async with asyncio.timeout(5.0):
            while owner.version != 7:
                await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert asked[:3] == ids and torch.equal(owner.theta, newer)


def test_the_learners_reply_cap_follows_the_fragment_plan() -> None:
    """A version reply is taken up to the largest fragment's bytes (``max_rpc_body``), no more:
    ~1 MiB for the tiny model, where a fixed 256 MiB let any owner make a learner buffer that much,
    and a model whose fragments are larger than 256 MiB is not refused."""
    from node.wire.rpc import max_rpc_body
    from protocol.diloco.fragments import plan_fragments

    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    cap = node.learner_config().max_message
    assert cap == max_rpc_body(f.numel for f in node.plan.fragments) < 4 << 20
    big = plan_fragments([("w", (20_000, 4_096))], 1)  # 82M elements: 328 MB in fp32
    assert max_rpc_body(f.numel for f in big.fragments) > 4 * 20_000 * 4_096 > 256 << 20
