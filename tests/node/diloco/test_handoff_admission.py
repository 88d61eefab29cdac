"""Issue 48: who may hand a fragment over (``protocol.diloco.replica.admit`` as ``PeerNode``
applies it), and which refusals a primary trusts.

Each test failed before the fix: the forged handoffs were taken (and ``final`` and the merged
bases honoured as sent), a non-member's refusal was an unsigned 403 that stopped its primary, and
any "fenced" answer stopped it too."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import types
from collections.abc import AsyncIterator

import pytest
import torch

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord
from node.diloco.flat import flat_digest
from node.diloco.replica import NOT_A_MEMBER, NotAMemberThere, encode_state, hand_over
from node.peer import PeerNode
from node.peer.handoffs import _FencedBy
from node.wire.transport import Reply
from protocol.diloco.replica import MAX_EPOCH, PREDECESSOR_LEAD
from protocol.errors import RemoteProtocolError
from protocol.wire.codec import encode
from protocol.wire.messages import ReplicaAck, ReplicaState
from protocol.wire.signing import ReplayWindow, seal
from tests.node.fakes import SWARM, Tasks, signer, tiny_model, tiny_plan

OWNER, ME, ATTACKER, LEARNER = signer(1), signer(2), signer(3), signer(4)


@dataclasses.dataclass
class _RankedMembership:
    """Members and a fixed rank (first: the owner of every fragment), as the rendezvous would give."""

    members: dict[bytes, Member]
    rank: list[bytes]
    ttl_s: float = 60.0
    refused: dict[bytes, str] = dataclasses.field(default_factory=dict)

    def owner_of(
        self, swarm: str, fragment: int, *, exclude: object = ()
    ) -> tuple[bytes, str] | None:
        left = [p for p in self.rank if p not in exclude]  # type: ignore[operator]
        return (left[0], self.members[left[0]].record.url) if left else None

    def ranked(
        self, swarm: str, fragment: int, n: int, *, exclude: object = ()
    ) -> list[tuple[bytes, str]]:
        left = [p for p in self.rank if p not in exclude]  # type: ignore[operator]
        return [(p, self.members[p].record.url) for p in left[:n]]

    def read_age(self) -> float:
        """The rank is the view, as a read just now found it."""
        return 0.0


def _member(s, *, owner: bool = True) -> Member:  # type: ignore[no-untyped-def]
    record = MemberRecord(
        url=f"http://127.0.0.1:{s.peer_id[0]}",
        roles=("learner", "owner") if owner else ("learner",),
        reachable=True,
        manifest="m",
        learning=True,
    )
    return Member(s.peer_id, record, 2e9, certified_owner=owner)


def _start_owner_of_0(node: PeerNode, last_owner: bytes | None) -> Tasks:
    """Start ``node``'s owner of fragment 0 as its ownership pass would, ``last_owner`` being whom
    its last pass saw own it; the owner's tasks go to the returned stand-in task group."""
    tasks = Tasks()
    node.started.tg = tasks  # type: ignore[assignment]
    if last_owner is not None:
        node.ownership._last_owner[0] = last_owner
    node.ownership._start_owner(0)
    return tasks


def _peer(rank: list[bytes]) -> PeerNode:
    """This peer (ME) with OWNER, ATTACKER (owner-certified) and LEARNER as members, ranked ``rank``."""
    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), ME, model, tiny_plan(model))
    members = {
        s.peer_id: _member(s, owner=s is not LEARNER) for s in (OWNER, ME, ATTACKER, LEARNER)
    }
    node.membership = _RankedMembership(members, rank)  # type: ignore[assignment]
    return node


def _forged(
    node: PeerNode,
    *,
    epoch: int = 2**62,
    version: int = 1,
    final: bool = True,
    theta: torch.Tensor | None = None,
) -> ReplicaState:
    """A handoff of fragment 0 with ``theta`` (default: the attacker's own weights)."""
    if theta is None:
        theta = torch.full((node.replicas.numels[0],), 7.0)
    return encode_state(
        swarm=node.cfg.swarm,
        fragment=0,
        epoch=epoch,
        version=version,
        digest=flat_digest(theta),
        theta=theta,
        momentum=None,
        merged={ATTACKER.peer_id: version, OWNER.peer_id: version},
        final=final,
    )


async def _offer(node: PeerNode, sender, msg: ReplicaState) -> ReplicaAck:  # type: ignore[no-untyped-def]
    return await node.ownership.on_replica_state(
        types.SimpleNamespace(
            peer_id=sender.peer_id,
            message=msg,  # type: ignore[arg-type]
            blobs_digest=None,
        )
    )


async def test_a_certified_owner_that_neither_owns_nor_precedes_a_fragment_cannot_hand_it_over() -> (
    None
):
    node = _peer([OWNER.peer_id, ME.peer_id, ATTACKER.peer_id])  # we are the owner's replica
    ack = await _offer(node, ATTACKER, _forged(node))
    assert not ack.accepted and ack.reason.startswith("refused") and "not taken" in ack.reason
    assert 0 not in node.replicas.states and 0 not in node.replicas.held
    assert node.replicas.status()["handoff_refusals"] == {"not-entitled": 1}
    ok = await _offer(node, OWNER, _forged(node, epoch=0))  # the owner itself is taken
    assert ok.accepted, ok.reason


async def test_a_predecessor_may_not_jump_the_epoch_hand_a_version_far_ahead_or_declare_it_final() -> (
    None
):
    node = _peer([ME.peer_id, ATTACKER.peer_id, OWNER.peer_id])  # we own; the attacker ranks next
    n = node.replicas.numels[0]
    theta0 = torch.zeros(n)
    node.replicas.fence(0, 0, 0, flat_digest(theta0))  # as starting to own at version 0 does
    assert not (await _offer(node, ATTACKER, _forged(node))).accepted  # epoch 2^62
    far = PREDECESSOR_LEAD + 1  # a version further past ours than a displaced owner can have merged
    assert not (await _offer(node, ATTACKER, _forged(node, epoch=1, version=far))).accepted
    assert node.replicas.status()["handoff_refusals"] == {"epoch-jump": 1, "ahead-of-known": 1}
    assert node.replicas.held[0].version == 0 and 0 not in node.replicas.states


async def test_final_is_honoured_only_from_the_owner_and_merged_bases_are_clamped_below_the_version() -> (
    None
):
    node2 = _peer([OWNER.peer_id, ME.peer_id])
    ack = await _offer(node2, OWNER, _forged(node2, epoch=0, version=5))
    taken = node2.replicas.states[0]
    assert (
        ack.accepted and taken.final and set(taken.merged.values()) == {4}
    )  # bases clamped to 5 - 1
    node3 = _peer([ME.peer_id, ATTACKER.peer_id, OWNER.peer_id])
    n = node3.replicas.numels[0]
    theta = torch.full((n,), 7.0)
    node3.replicas.fence(0, 0, 3, flat_digest(theta))  # version 3 with that content is held here
    ack = await _offer(
        node3, ATTACKER, dataclasses.replace(_forged(node3, epoch=1, version=3), final=True)
    )
    assert (
        ack.accepted and not node3.replicas.states[0].final
    )  # the predecessor's "final" is not honoured
    assert node3.replicas.status()["handoff_refusals"] == {"final-ignored": 1}


async def test_a_member_that_may_not_own_gets_a_signed_refusal_not_an_unsigned_403() -> None:
    node = _peer([OWNER.peer_id, ME.peer_id])
    ack = await _offer(
        node, LEARNER, _forged(node)
    )  # an answer the RPC layer seals, not a NotAuthorized
    assert not ack.accepted and ack.reason.startswith(NOT_A_MEMBER)
    assert node.replicas.status()["handoff_refusals"] == {"not-a-member": 1}


class _Pool:
    def give(self, buf: bytearray) -> None:
        pass


class _Answering:
    """A transport whose every request is answered with ``status`` and ``body``."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body, self.pool = status, body, _Pool()

    async def request(self, *a: object, **kw: object) -> tuple[int, bytearray, int, dict[str, str]]:
        return self.status, bytearray(self.body), len(self.body), {}

    @contextlib.asynccontextmanager
    async def reply(self, *a: object, **kw: object) -> AsyncIterator[Reply]:
        yield Reply(self.status, memoryview(self.body), {})


def _state() -> ReplicaState:
    theta = torch.zeros(4)
    return encode_state(
        swarm=SWARM,
        fragment=0,
        epoch=0,
        version=1,
        digest=flat_digest(theta),
        theta=theta,
        momentum=None,
    )


async def test_an_unsigned_403_does_not_stop_a_primary_and_a_signed_not_a_member_does() -> None:
    target = (ME.peer_id, "http://127.0.0.1:2")
    with pytest.raises(RemoteProtocolError) as refused:
        await hand_over(_Answering(403, b"forbidden"), OWNER, target, _state(), ReplayWindow())  # type: ignore[arg-type]
    assert not isinstance(refused.value, NotAMemberThere)  # anyone on the path can send a 403
    signed = seal(
        encode(ReplicaAck(accepted=False, reason=f"{NOT_A_MEMBER}: x", epoch=-1, version=-1)),
        ME,
        now=time.time(),
        nonce=os.urandom(16),
        recipient=OWNER.peer_id,
    ).tobytes()
    with pytest.raises(NotAMemberThere):
        await hand_over(_Answering(200, signed), OWNER, target, _state(), ReplayWindow())  # type: ignore[arg-type]
    forged = seal(
        encode(ReplicaAck(accepted=False, reason=f"{NOT_A_MEMBER}: x", epoch=-1, version=-1)),
        ATTACKER,
        now=time.time(),
        nonce=os.urandom(16),
        recipient=OWNER.peer_id,
    ).tobytes()
    with pytest.raises(RemoteProtocolError) as other:  # signed, but not by the replica asked
        await hand_over(_Answering(200, forged), OWNER, target, _state(), ReplayWindow())  # type: ignore[arg-type]
    assert not isinstance(other.value, NotAMemberThere)


async def test_a_fenced_answer_that_names_no_fence_is_routed_around(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from node.peer import handoffs

    node = _peer([OWNER.peer_id, ME.peer_id])
    answer = ReplicaAck(accepted=False, reason="fenced: trust me", epoch=0, version=0)

    async def answering(*a: object, **kw: object) -> ReplicaAck:
        return answer

    monkeypatch.setattr(handoffs, "hand_over", answering)
    state = dataclasses.replace(_state(), epoch=3, version=9)
    assert (
        await node.handoffs._hand_to(0, (ATTACKER.peer_id, "http://x"), state) is False
    )  # no fence: not stopped
    answer = ReplicaAck(accepted=False, reason="fenced: epoch 4", epoch=4, version=8)
    with pytest.raises(_FencedBy):
        await node.handoffs._hand_to(0, (ATTACKER.peer_id, "http://x"), state)


def test_the_peer_level_attacks_parse_and_the_address_attacker_is_learner_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from node.run.attack import parse_local_attack
    from node.run.attack_peer import is_peer_attack
    from node.run.local import LaunchPlan, LocalSwarm
    from node.wire.identity import load_certificate

    assert parse_local_attack("1:forge-handoffs") == (1, "forge-handoffs")
    assert parse_local_attack("2:claim-address") == (2, "claim-address")
    assert is_peer_attack("forge-handoffs") and not is_peer_attack("scale=10")
    extra = {1: ["--attack", "forge-handoffs"], 2: ["--attack", "claim-address"]}
    LocalSwarm(RunConfig(peers=3), tmp_path, LaunchPlan(extra_peer_args=extra)).make_swarm()
    roles = [load_certificate(tmp_path / "swarm" / f"peer{i}.cert").roles for i in range(3)]
    assert roles == [("learner", "owner"), ("learner", "owner"), ("learner",)]


def _coming_back(
    *, last_owner: bytes | None, rank: tuple[object, ...] = (ME, OWNER, ATTACKER)
) -> tuple[PeerNode, Tasks]:
    """This peer ranked first for fragment 0, OWNER next (or as ``rank`` says); its learner holds
    version 5 (as state sync gives a peer that comes back); ``last_owner``: whom its last
    ownership pass saw."""
    node = _peer([s.peer_id for s in rank])  # type: ignore[attr-defined]
    theta = torch.zeros(node.replicas.numels[0])
    node.net = types.SimpleNamespace(  # type: ignore[assignment]
        latest={0: (5, theta)},
        island_initial={0: theta, 1: torch.zeros(node.replicas.numels[1])},
        received={0: 5, 1: 0},
        received_at={0: time.time()},
        created=None,
        held_state=lambda p: None,
    )
    return node, _start_owner_of_0(node, last_owner)


async def test_a_peer_that_comes_back_holds_final_what_the_owner_that_stood_in_handed_out_final() -> (
    None
):
    """A chaos run (an owner killed, restarted after the swarm's run had ended) ended on two
    models: the owner that stood in had handed version 5 out as final to the peers that ended,
    the returning peer took the fragment back with no ownership pass behind it, ignored the
    handoff's ``final`` as a mere predecessor's, merged its own late work and published 6 final.
    The owner it takes the fragment from is the one ranked first without it, whose ``final``
    counts; a peer whose last pass saw itself own the fragment still ignores a predecessor's."""
    node, tasks = _coming_back(last_owner=None)
    held = torch.zeros(node.replicas.numels[0])  # version 5 as we hold it
    handed = _forged(node, epoch=1, version=5, theta=held)
    assert (await _offer(node, OWNER, handed)).accepted
    assert node.owners[0].version == 5 and node.owners[0].holds_final()
    assert node.owners[0].final_hold() is not None  # late work is refused, not merged
    await tasks.cancel()
    node, tasks = _coming_back(last_owner=ME.peer_id)  # we owned it all along: OWNER precedes us
    assert (await _offer(node, OWNER, handed)).accepted
    assert not node.owners[0].holds_final()
    assert node.replicas.status()["handoff_refusals"] == {"final-ignored": 1}
    await tasks.cancel()


async def test_the_owner_that_owned_while_alone_hands_its_state_to_a_joiner_and_ends_its_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 3-peer standin swarm in CI (a busy box) ended with two fragments at version 1: the first
    peer owned every fragment while alone; the joiners that took two of them held their first
    merge CATCH_UP_S for its state, but refused its handoff (their view named the member ranked
    first without them as the predecessor, which never owned them), so the whole 3 s run went
    by in the hold. A new owner takes its catch-up sources' handoffs before its first merge."""
    node, tasks = _coming_back(last_owner=None, rank=(ME, ATTACKER, OWNER))
    own = node.owners[0]
    assert own.succession.merger.held_until is not None  # it displaces a live owner: held
    state = _forged(node, epoch=1, version=5, theta=torch.zeros(node.replicas.numels[0]))
    assert (await _offer(node, OWNER, state)).accepted  # the third ranked: a catch-up source
    assert own.succession.merger.held_until is None and own.version == 5
    await tasks.cancel()
    monkeypatch.setattr("node.peer.handoffs.CATCH_UP_SOURCES", 2)
    node, tasks = _coming_back(last_owner=None, rank=(ME, ATTACKER, LEARNER, OWNER))
    ack = await _offer(node, OWNER, state)  # ranked past the two sources: not taken
    assert not ack.accepted and node.owners[0].succession.merger.held_until is not None
    await tasks.cancel()


async def test_an_epoch_past_the_cap_is_taken_neither_from_an_owner_nor_from_a_replicas_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An owner's handoff at epoch 2^63 - 1 was taken: the owner here adopted epoch 2^63, past the
    wire's signed 64 bits, so its every replica state failed to build and every merge failed
    with the round's work discarded, for good. A replica's "fenced" answer at that epoch did
    the same through the owner's bump above a stale fence. Neither is taken past ``MAX_EPOCH``;
    an epoch at the cap is, and leaves the owner's next handoff buildable."""
    from node.peer import handoffs

    node, tasks = _coming_back(last_owner=None, rank=(ME, OWNER, ATTACKER))  # OWNER: a predecessor
    own = node.owners[0]
    theta = torch.zeros(node.replicas.numels[0])
    ack = await _offer(node, OWNER, _forged(node, epoch=2**63 - 1, version=5, theta=theta))
    assert not ack.accepted and node.replicas.status()["handoff_refusals"] == {"epoch-cap": 1}
    assert own.epoch == 0
    assert (
        await _offer(node, OWNER, _forged(node, epoch=MAX_EPOCH, version=5, theta=theta))
    ).accepted
    assert own.epoch == MAX_EPOCH + 1
    encode_state(  # what its next merge hands its replica: still a valid message
        swarm=node.cfg.swarm,
        fragment=0,
        epoch=own.epoch,
        version=6,
        digest=flat_digest(theta),
        theta=theta,
        momentum=None,
    )
    await tasks.cancel()

    answer = ReplicaAck(accepted=False, reason="fenced: epoch 2^63 - 1", epoch=2**63 - 1, version=0)

    async def answering(*a: object, **kw: object) -> ReplicaAck:
        return answer

    monkeypatch.setattr(handoffs, "hand_over", answering)
    state = dataclasses.replace(_state(), epoch=3, version=9)
    assert await node.handoffs._hand_to(0, (ATTACKER.peer_id, "http://x"), state) is False
