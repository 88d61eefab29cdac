"""Owner replicas with a fake clock and in-memory handoffs: a replica takes over from exactly the
state its primary handed it (global fragment, Nesterov momentum, version, digest), and a replaced
primary that comes back is fenced off instead of publishing a second content for a version."""

from __future__ import annotations

import dataclasses

import torch

from node.diloco.flat import flat_digest
from node.diloco.owner import FragmentOwner, OwnerClocks, OwnerConfig, OwnerHooks, OwnerStart
from node.diloco.replica import ReplicaStore, encode_state
from protocol.diloco.merge import MergeConfig, Phase
from protocol.diloco.outer import OuterConfig
from protocol.wire.codec import encode
from protocol.wire.messages import ReplicaState
from protocol.wire.signing import message_digests, seal, verify_sealed
from tests.node.fakes import (
    SWARM,
    FakeClock,
    contribution,
    flat_of,
    shapes_of,
    signer,
    tiny_model,
    tiny_plan,
)

A, B, C = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3))


def _owner(plan, shapes, clock, initial, *, who, replicate=None, version=0, epoch=0, momentum=None):  # type: ignore[no-untyped-def]
    return FragmentOwner(
        OwnerConfig(
            swarm=SWARM,
            fragment=plan.fragments[0],
            shapes=tuple(shapes[0]),
            merge=MergeConfig(quorum=1, gamma=0.5, tau=2.0),
            outer=OuterConfig(lr=0.7, momentum=0.9),
        ),
        OwnerStart(
            theta=initial,
            version=version,
            epoch=epoch,
            momentum=momentum,
        ),
        signer=who,
        clocks=OwnerClocks(clock),
        hooks=OwnerHooks(replicate=replicate),
    )


def _handing_to(store: ReplicaStore):  # type: ignore[no-untyped-def]
    """A primary's replicate callback: hand each version to ``store`` as signer 1."""

    async def to_replica(
        state: ReplicaState, delta: ReplicaState | None = None, theta_digest: bytes | None = None
    ) -> str | None:
        ack = store.offer(signer(1).peer_id, state)
        return None if ack.accepted else ack.reason

    return to_replica


async def _merge_one(
    owner: FragmentOwner, clock: FakeClock, delta: torch.Tensor, shapes, sender: bytes
) -> None:  # type: ignore[no-untyped-def]
    ack = await owner.contribute(
        sender, contribution(delta, shapes[0], base_version=owner.version, owner=owner)
    )
    assert ack.accepted, ack.reason
    await owner.set_expected(1)
    clock.advance(30.0)
    await owner.tick()


async def test_the_replica_takes_over_with_the_momentum_intact_and_matches_an_uninterrupted_owner() -> (
    None
):
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    handed: list[ReplicaState] = []

    async def to_replica(
        state: ReplicaState, delta: ReplicaState | None = None, theta_digest: bytes | None = None
    ) -> str | None:
        handed.append(state)
        ack = store.offer(signer(1).peer_id, state)
        return None if ack.accepted else ack.reason

    primary = _owner(plan, shapes, clock, theta0, who=signer(1), replicate=to_replica)
    reference = _owner(plan, shapes, clock, theta0, who=signer(9))  # never fails
    deltas = [torch.linspace(-0.05, 0.05, theta0.numel()) * (i + 1) for i in range(3)]
    for d in deltas[:2]:
        await _merge_one(primary, clock, d, shapes, A)
        await _merge_one(reference, clock, d, shapes, A)
    assert primary.version == 2 and [s.version for s in handed] == [
        1,
        2,
    ]  # handed before publishing
    # the primary accepted a contribution for version 3 and died before merging it
    await primary.set_expected(2)  # it waits for a second learner's contribution, in vain
    await primary.contribute(B, contribution(deltas[2], shapes[0], base_version=2, owner=primary))

    state = store.states[0]
    replica = _owner(
        plan,
        shapes,
        clock,
        state.theta,
        who=signer(2),
        version=state.version,
        epoch=state.epoch + 1,
        momentum=state.momentum,
    )
    assert replica.version == 2 and replica.epoch == 1
    assert torch.equal(replica.theta, primary.theta) and torch.equal(replica.buffer, primary.buffer)
    assert replica.digests[2] & primary.digests[2]  # the same version 2, the same content
    await _merge_one(replica, clock, deltas[2], shapes, B)  # the lost contribution, sent again
    await _merge_one(reference, clock, deltas[2], shapes, B)
    assert replica.version == reference.version == 3
    assert torch.allclose(replica.theta, reference.theta, atol=1e-7)
    assert torch.allclose(replica.buffer, reference.buffer, atol=1e-7)


async def test_a_replaced_primary_is_fenced_and_publishes_nothing() -> None:
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    primary = _owner(plan, shapes, clock, theta0, who=signer(1), replicate=_handing_to(store))
    await _merge_one(primary, clock, torch.full_like(theta0, 0.01), shapes, A)
    assert primary.version == 1
    store.fence(0, epoch=1, version=1, digest=primary.digest_of(1))  # someone took over at epoch 1
    waiter_version = primary.version
    await primary.contribute(
        C, contribution(torch.full_like(theta0, 0.02), shapes[0], base_version=1, owner=primary)
    )
    await primary.set_expected(1)
    clock.advance(30.0)
    await primary.tick()
    assert primary.version == waiter_version == 1  # version 2 was never published
    assert primary.fenced is not None and primary.fenced.startswith("fenced:") and primary.retired


async def test_work_merged_into_a_handed_version_is_refused_by_the_successor_if_sent_again() -> (
    None
):
    """The primary merged A's contribution, handed the version to its replica and died before
    publishing it. A (its in-flight contribution unanswered by a version) sends the same work
    again to the successor: the handoff named it as merged, so it is refused with "resync" and
    counted once. B's work, never merged, is taken."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    primary = _owner(plan, shapes, clock, theta0, who=signer(1), replicate=_handing_to(store))
    delta = torch.linspace(-0.05, 0.05, theta0.numel())
    await _merge_one(primary, clock, delta, shapes, A)
    handed = store.states[0]
    assert handed.version == 1 and handed.merged == {A: 0}

    def successor() -> (
        FragmentOwner
    ):  # a peer that knew version 0, then takes over the handed state
        return FragmentOwner(
            OwnerConfig(
                swarm=SWARM,
                fragment=plan.fragments[0],
                shapes=tuple(shapes[0]),
                merge=MergeConfig(quorum=2, gamma=0.5, tau=2.0),
                outer=OuterConfig(lr=0.7, momentum=0.9),
            ),
            OwnerStart(
                theta=theta0,
            ),
            signer=signer(2),
            clocks=OwnerClocks(clock),
        )

    again = contribution(
        delta, shapes[0], base_version=0, owner=primary
    )  # measured against version 0
    told = successor()
    assert await told.take_over(handed)
    ack = await told.contribute(A, again)
    assert not ack.accepted and "merged already" in ack.reason
    ack = await told.contribute(B, contribution(delta, shapes[0], base_version=1, owner=told))
    assert ack.accepted, ack.reason
    assert (
        told.penalties[A]["refused_base"] == 1
    )  # refused by the handed merged set, before the merger


async def test_a_retiring_owner_lets_a_merge_under_way_publish_or_publishes_nothing() -> None:
    """Its replica may already hold the version a merge under way hands it: the retiring owner
    lets that merge finish (and the successor gets it in the handed state); past the wait it
    publishes nothing, so a successor's own version of that number is the only one."""
    import asyncio

    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    for wait_s, published in ((5.0, True), (0.05, False)):
        release = asyncio.Event()

        async def slow_replica(
            state: ReplicaState,
            delta: ReplicaState | None = None,
            theta_digest: bytes | None = None,
            release: asyncio.Event = release,
        ) -> str | None:
            await release.wait()  # the handoff is under way
            return None

        owner = _owner(plan, shapes, clock, theta0, who=signer(1), replicate=slow_replica)
        await owner.contribute(
            A,
            contribution(
                torch.linspace(-0.05, 0.05, theta0.numel()), shapes[0], base_version=0, owner=owner
            ),
        )
        merging = asyncio.ensure_future(owner.set_expected(1))  # closes the round: the merge starts
        await asyncio.sleep(0.1)
        assert owner.merger.phase is Phase.MERGING
        retiring = asyncio.ensure_future(owner.retire(finish_merge_s=wait_s))
        await asyncio.sleep(0.2)
        release.set()
        await asyncio.gather(merging, retiring)
        assert owner.retired
        assert (owner.version == 1) is published
        assert (owner.snapshot().version == 1) is published  # what the successor is handed


async def test_a_successor_takes_its_predecessors_state_of_the_version_it_holds_itself() -> None:
    """An owner knows each version by several digests (the state as learners decode it, the
    sealed message, and at version 0 the unrounded state), but hands over and fences with one: it
    must be the state's, the one any other owner computes for the same content. It was the first
    of a set, so about every other handoff of a version the successor also held was refused
    ("handed over with another content") or not taken ("does not hash to its digest"), and a
    fence could name a message digest no other peer can produce. Sixteen distinct states: each
    handoff is judged and taken."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    for i in range(16):
        theta = theta0 + 0.001 * i
        predecessor = _owner(plan, shapes, clock, theta, who=signer(1), version=5)
        successor = _owner(plan, shapes, clock, theta, who=signer(2), version=5, epoch=1)
        store = ReplicaStore(SWARM, [theta0.numel(), 0])
        store.fence(0, successor.epoch, 5, successor.state().digest)  # as ``_start_owner`` does
        ack = store.offer(signer(1).peer_id, predecessor.snapshot(), successor=True)
        assert ack.accepted, (i, ack.reason)
        assert await successor.take_over(store.states[0]), i
        assert successor.state().digest == predecessor.state().digest == store.held[0].digest


async def test_a_whole_fp32_handoff_is_known_to_hash_to_its_digest_from_the_digest_its_seal_computed() -> (
    None
):
    """The owner hashes a version's bytes once: the seal of its handoff reuses that digest, the
    replica's verified body yields it as the blobs' digest at no cost, and the store records the
    state as hashed, so its learner takes it without hashing it again. With momentum, another
    digest or a doctored state, it is not recorded so (the learner hashes it as before)."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    handed: list[tuple[ReplicaState, bytes | None]] = []

    async def to_replica(
        state: ReplicaState, delta: ReplicaState | None = None, theta_digest: bytes | None = None
    ) -> str | None:
        handed.append((state, theta_digest))
        return None

    owner = FragmentOwner(
        OwnerConfig(
            swarm=SWARM,
            fragment=plan.fragments[0],
            shapes=tuple(shapes[0]),
            merge=MergeConfig(quorum=1, gamma=0.5, tau=2.0),
            outer=OuterConfig(lr=1.0, momentum=0.0),
        ),
        OwnerStart(
            theta=theta0,
        ),
        signer=signer(1),
        clocks=OwnerClocks(clock),
        hooks=OwnerHooks(replicate=to_replica),
    )
    await _merge_one(owner, clock, torch.linspace(-0.05, 0.05, theta0.numel()), shapes, A)
    ((state, theta_digest),) = handed
    assert theta_digest == state.digest == flat_digest(owner.theta)
    wire = seal(
        encode(state), signer(1), now=1e6, nonce=bytes(16), blobs_digest=theta_digest
    ).tobytes()
    opened = verify_sealed(wire, max_size=1 << 24)  # the receiver computes the same digests itself
    assert opened.blobs_digest == state.digest and store.hashes_to_digest(
        state, opened.blobs_digest
    )
    assert store.offer(signer(1).peer_id, state, hashed=True).accepted
    assert store.version_from(0, signer(1).peer_id).hashed  # type: ignore[union-attr]
    reference = dataclasses.replace(
        state, theta=(), base_version=state.version, base_digest=state.digest
    )
    assert store.hashes_to_digest(reference, None)  # a reference to a state held as hashed
    assert not store.hashes_to_digest(state, bytes(32))  # another body digest
    momentum = encode_state(
        swarm=SWARM,
        fragment=0,
        epoch=0,
        version=1,
        digest=state.digest,
        theta=owner.theta,
        momentum=torch.zeros_like(owner.theta),
    )
    assert not store.hashes_to_digest(momentum, message_digests(encode(momentum).tobytes()).blobs)
    store.states[0] = dataclasses.replace(store.states[0], hashed=False)
    assert not store.hashes_to_digest(reference, None)  # the held state was not known to hash so

    # an owner whose versions go out as bf16: its state digest is not its fp32 bytes' hash
    bf16 = FragmentOwner(
        OwnerConfig(
            swarm=SWARM,
            fragment=plan.fragments[0],
            shapes=tuple(shapes[0]),
            merge=MergeConfig(quorum=1, gamma=0.5, tau=2.0),
            outer=OuterConfig(lr=1.0, momentum=0.0),
            download_codec="bf16",
        ),
        OwnerStart(
            theta=theta0,
        ),
        signer=signer(1),
        clocks=OwnerClocks(clock),
        hooks=OwnerHooks(replicate=to_replica),
    )
    await _merge_one(bf16, clock, torch.linspace(-0.05, 0.05, theta0.numel()), shapes, A)
    assert handed[-1][1] is None


async def test_a_version_handed_out_as_final_stays_final_with_the_successor() -> None:
    """Seen in CI's chaos run: an owner handed version 106 out as final and two learners left with
    it; then the fragment moved back to its restarted first owner, which took 106 over and merged
    the flushes of the late learners into 107 and 108, declared final to the other two: the swarm
    ended on two models. The handoff now says the version is final (on the wire), and the
    successor refuses late work for the hold as its predecessor did; a handoff of a version never
    handed out as final, or whose hold has lapsed, does not."""
    from node.diloco.owner import FINAL_HOLD_S
    from protocol.wire.decoding import decode

    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    delta = torch.linspace(-0.05, 0.05, theta0.numel())

    async def hand_on(predecessor: FragmentOwner) -> FragmentOwner:
        """Through the wire and a replica store, as a retiring owner's handoff reaches its successor."""
        msg = decode(encode(predecessor.snapshot()).tobytes(), max_size=1 << 24)
        assert isinstance(msg, ReplicaState)
        store = ReplicaStore(SWARM, [theta0.numel(), 0])
        successor = _owner(plan, shapes, clock, theta0, who=signer(2), epoch=1)
        store.fence(0, successor.epoch, 0, successor.state().digest)
        assert store.offer(signer(1).peer_id, msg, successor=True).accepted
        assert await successor.take_over(store.states[0])
        return successor

    predecessor = _owner(plan, shapes, clock, theta0, who=signer(1))
    await _merge_one(predecessor, clock, delta, shapes, A)
    assert not predecessor.snapshot().final  # merged, never handed out as final
    predecessor.declare_final()
    clock.advance(2.0)
    assert predecessor.snapshot().final
    successor = await hand_on(predecessor)
    assert successor.version == 1 and successor.holds_final()
    late = await successor.contribute(
        C, contribution(delta, shapes[0], base_version=1, owner=successor)
    )
    assert not late.accepted and "version 1 was handed out as final" in late.reason
    await successor.set_expected(1)
    clock.advance(30.0)
    await successor.tick()
    assert successor.version == 1 and successor.digest_of(1) == predecessor.digest_of(
        1
    )  # one model

    # a handoff of a version that was not handed out as final: the successor merges late work
    fresh = _owner(plan, shapes, clock, theta0, who=signer(1))
    await _merge_one(fresh, clock, delta, shapes, A)
    taken = await hand_on(fresh)
    assert not taken.holds_final()
    assert (
        await taken.contribute(C, contribution(delta, shapes[0], base_version=1, owner=taken))
    ).accepted
    # nor once the predecessor's hold has lapsed (an idle swarm joined much later merges again)
    clock.advance(FINAL_HOLD_S)
    assert not predecessor.holds_final() and not predecessor.snapshot().final


async def _hand(predecessor: FragmentOwner, successor: FragmentOwner, theta0: torch.Tensor) -> bool:
    """The predecessor's retiring handoff, through the wire and a replica store: whether the
    successor took it over (its store refuses a state behind the version it holds)."""
    from protocol.wire.decoding import decode

    msg = decode(encode(predecessor.snapshot()).tobytes(), max_size=1 << 24)
    assert isinstance(msg, ReplicaState)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    store.fence(0, successor.epoch, successor.version, successor.state().digest)
    if not store.offer(signer(1).peer_id, msg, successor=True).accepted:
        return False
    return await successor.take_over(store.states[0])


async def test_an_owner_awaiting_its_predecessor_s_state_has_no_final_version() -> None:
    """Seen in a chaos run: a peer restarted from its checkpoint took a fragment from the live
    owner at the checkpoint's version, declared that version final to a learner that asked,
    and took the live owner's newer version over from its handoff 50 ms later: that learner
    ended on the older one. An owner holding its first merge for its predecessor's state is not
    idle (nothing is final) until the handoff comes, or the hold ends (a predecessor that died)."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    delta = torch.linspace(-0.05, 0.05, theta0.numel())
    live = _owner(plan, shapes, clock, theta0, who=signer(1))
    await _merge_one(live, clock, delta, shapes, A)
    successor = _owner(plan, shapes, clock, theta0, who=signer(2), epoch=1)
    assert successor.idle()
    successor.hold_first_merge(6.0)
    assert not successor.idle()
    assert await _hand(live, successor, theta0)  # the handoff releases the hold
    assert successor.version == 1 and successor.idle()
    orphan = _owner(plan, shapes, clock, theta0, who=signer(3), epoch=2)
    orphan.hold_first_merge(6.0)
    clock.advance(5.9)
    assert not orphan.idle()
    clock.advance(0.2)  # no event reached the owner: the hold ends by the clock alone
    assert orphan.idle() and orphan.version == 0


async def test_a_new_owner_merges_nothing_before_its_predecessors_handoff() -> None:
    """The race left after the final hold travelled with the fragment: a restarted owner took its
    fragment back and merged a late flush before its predecessor's handoff (final) arrived, a
    version the peers that had left never saw. A new owner now holds its first merge until the
    handoff comes (or ``seconds`` pass): late work is dropped when the handoff says final, and
    merges at once when it does not."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    delta = torch.linspace(-0.05, 0.05, theta0.numel())

    async def successor_with_late_work(predecessor: FragmentOwner, *, hold: bool) -> FragmentOwner:
        successor = _owner(
            plan, shapes, clock, predecessor.theta, who=signer(2), version=1, epoch=1
        )
        if hold:
            successor.hold_first_merge(6.0)
        ack = await successor.contribute(
            C, contribution(delta, shapes[0], base_version=1, owner=successor)
        )
        assert ack.accepted, ack.reason
        await successor.set_expected(1)
        clock.advance(2.0)
        await successor.tick()
        return successor

    predecessor = _owner(plan, shapes, clock, theta0, who=signer(1))
    await _merge_one(predecessor, clock, delta, shapes, A)
    predecessor.declare_final()
    # without the hold: the late work makes version 2, and the final handoff comes too late
    unheld = await successor_with_late_work(predecessor, hold=False)
    assert unheld.version == 2 and not await _hand(predecessor, unheld, theta0)
    # with it: nothing merged until the handoff, which drops the late work and holds version 1 final
    held = await successor_with_late_work(predecessor, hold=True)
    assert held.version == 1 and held.merger.count == 1 and held.merger.phase is Phase.GRACE
    assert await _hand(predecessor, held, theta0)
    assert held.holds_final() and held.merger.count == 0
    clock.advance(30.0)
    await held.tick()
    assert held.version == 1 and held.digest_of(1) == predecessor.digest_of(1)  # one model

    # a predecessor whose version is not final: its handoff releases the hold, the work merges
    live = _owner(plan, shapes, clock, theta0, who=signer(1))
    await _merge_one(live, clock, delta, shapes, A)
    released = await successor_with_late_work(live, hold=True)
    assert released.version == 1
    assert await _hand(live, released, theta0)
    assert released.version == 2 and not released.holds_final()
    # and no handoff at all (a predecessor that died): it merges when the hold ends
    orphan = await successor_with_late_work(live, hold=True)
    clock.advance(3.9)
    await orphan.tick()
    assert orphan.version == 1
    clock.advance(0.1)
    await orphan.tick()
    assert orphan.version == 2


async def test_a_state_from_an_earlier_tenure_is_not_offered_to_the_learner_once_the_store_is_fenced_past_it() -> (
    None
):
    """Ownership moved 1 -> this peer -> 1 again: the state 1 handed over in its first tenure is
    not 1's latest, so this peer's learner must not take it as 1's version (a resync asking for
    "the latest" took it, went back to version 0, and was refused by 1 as unknown for ever, in
    the averaging bench's kill test). A handoff of 1's new tenure is offered again."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    first = _owner(plan, shapes, clock, theta0, who=signer(1), replicate=_handing_to(store))
    await _merge_one(first, clock, torch.linspace(-0.05, 0.05, theta0.numel()), shapes, A)
    assert (
        store.version_from(0, signer(1).peer_id) is store.states[0] and store.states[0].version == 1
    )
    store.fence(0, 1, 1, first.digest_of(1))  # this peer owns fragment 0 now, at epoch 1
    assert store.version_from(0, signer(1).peer_id) is None
    assert store.states[0].version == 1  # still held: a takeover of it is not refused
    later = _owner(
        plan,
        shapes,
        clock,
        first.theta.clone(),
        who=signer(1),
        replicate=_handing_to(store),
        version=3,
        epoch=2,
    )
    await _merge_one(later, clock, torch.linspace(0.05, -0.05, theta0.numel()), shapes, B)
    got = store.version_from(0, signer(1).peer_id)
    assert (
        got is not None
        and (got.epoch, got.version) == (2, 4)
        and torch.equal(got.theta, later.theta)
    )


# --- the clip reference and the standing survive owner changes (issue 47) ------------------------

D, E = (bytes([b]) * 32 for b in (0xD4, 0xE5))


def _plain_owner(
    plan, shapes, clock, initial, *, who, replicate=None, version=0, epoch=0, **carried
):  # type: ignore[no-untyped-def]
    """An owner at the node's defaults for the outer step (lr 1, no momentum): a version's update
    is its aggregate, so the bound on a step reads directly as a bound on the aggregate."""
    return FragmentOwner(
        OwnerConfig(
            swarm=SWARM,
            fragment=plan.fragments[0],
            shapes=tuple(shapes[0]),
            merge=MergeConfig(quorum=1, gamma=0.5, tau=2.0),
            outer=OuterConfig(lr=1.0, momentum=0.0),
        ),
        OwnerStart(
            theta=initial,
            version=version,
            epoch=epoch,
            **carried,
        ),
        signer=who,
        clocks=OwnerClocks(clock),
        hooks=OwnerHooks(replicate=replicate),
    )


async def _round(
    owner: FragmentOwner, clock: FakeClock, work: dict[bytes, torch.Tensor], shapes
) -> None:  # type: ignore[no-untyped-def]
    for sender, delta in work.items():
        ack = await owner.contribute(
            sender, contribution(delta, shapes[0], base_version=owner.version, owner=owner)
        )
        assert ack.accepted, ack.reason
    await owner.set_expected(len(work))
    clock.advance(30.0)
    await owner.tick()


def _honest(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01


async def _predecessor_with_history(store: ReplicaStore, plan, shapes, clock, theta0):  # type: ignore[no-untyped-def]
    """Five rounds of two honest learners (A, B) and one member (E) sending 20x their norm."""
    primary = _plain_owner(plan, shapes, clock, theta0, who=signer(1), replicate=_handing_to(store))
    n = theta0.numel()
    for r in range(5):
        await _round(
            primary,
            clock,
            {A: _honest(n, 2 * r), B: _honest(n, 2 * r + 1), E: 20 * _honest(n, 99 + r)},
            shapes,
        )
    assert primary.version == 5 and primary.penalties[E]["clipped"] == 5
    return primary


def _handed_over_the_wire(primary: FragmentOwner, store: ReplicaStore):  # type: ignore[no-untyped-def]
    """The retiring primary's snapshot, encoded and decoded as on the wire, taken by the successor's store."""
    from protocol.wire import codec

    msg = codec.decode(codec.encode(primary.snapshot()).tobytes(), max_size=1 << 26)
    assert isinstance(msg, ReplicaState)
    assert store.offer(signer(1).peer_id, msg, successor=True).accepted
    return store.states[0]


async def test_a_successor_taking_over_clips_an_oversized_contribution_in_its_first_round() -> None:
    """Today's main started every new owner with an empty norm history: a member alone in the
    successor's first round set its own clip reference and moved the fragment by its whole norm
    (here 30x an honest one). The predecessor's reference now comes with the handoff, so that
    first round clips it to ``clip_multiple`` x the honest norms."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    primary = await _predecessor_with_history(store, plan, shapes, clock, theta0)
    honest = max(float(_honest(theta0.numel(), s).norm()) for s in range(10))
    # the successor started from the swarm's version 0 (no handoff yet), then the retiring primary's state came
    successor = _plain_owner(
        plan,
        shapes,
        clock,
        theta0,
        who=signer(2),
        replicate=_handing_to(ReplicaStore(SWARM, [theta0.numel(), 0])),
    )
    assert await successor.take_over(_handed_over_the_wire(primary, store))
    before = successor.theta.clone()
    await _round(
        successor, clock, {D: 30 * _honest(theta0.numel(), 7)}, shapes
    )  # D alone, in its first round
    assert successor.version == 6
    step = float((successor.theta - before).norm())
    assert successor.penalties[D]["clipped"] == 1, (
        "the successor's first round did not clip a 30x contribution"
    )
    assert step <= 4.0 * honest * 1.01  # clip_multiple x the honest norms, not 30x
    assert successor.merger.reference() and len(successor.merger.reference()) >= 2


async def test_a_successor_built_from_a_handoff_has_the_reference_and_refuses_a_sender_of_low_standing() -> (
    None
):
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    primary = await _predecessor_with_history(store, plan, shapes, clock, theta0)
    assert primary.standing.refused(E, version=primary.version) is not None  # clipped every round
    handed = _handed_over_the_wire(primary, store)
    assert handed.norms == primary.merger.reference() and handed.norms
    successor = _plain_owner(
        plan,
        shapes,
        clock,
        handed.theta,
        who=signer(2),
        version=handed.version,
        epoch=handed.epoch + 1,
        reference=handed.norms,
        standing=handed.standing,
    )
    assert successor.merger.reference() == primary.merger.reference()
    assert successor.standing.score(E, version=5) == primary.standing.score(E, version=5) < 0
    assert successor.standing.score(A, version=5) > 0
    ack = await successor.contribute(
        E, contribution(_honest(theta0.numel(), 3), shapes[0], base_version=5, owner=successor)
    )
    assert not ack.accepted and "standing" in ack.reason
    assert successor.penalties[E]["refused_standing"] == 1
    status = successor.standing_status()
    assert status["refused"] == 1 and status["lowest"][0]["peer"] == E.hex()[:16]  # type: ignore[index]


async def test_a_hostile_predecessors_huge_reference_is_ignored_for_the_updates_the_successor_measures() -> (
    None
):
    """A predecessor hands a reference some 30x the real norms, though shorter than the fragment
    (its next contribution would pass the clip): the successor, holding the version before,
    measures the last update itself and seeds from that instead."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    store = ReplicaStore(SWARM, [theta0.numel(), 0])
    primary = _plain_owner(plan, shapes, clock, theta0, who=signer(1), replicate=_handing_to(store))
    await _round(
        primary, clock, {A: _honest(theta0.numel(), 0), B: _honest(theta0.numel(), 1)}, shapes
    )
    successor = _plain_owner(plan, shapes, clock, primary.theta.clone(), who=signer(2), version=1)
    await _round(
        primary, clock, {A: _honest(theta0.numel(), 2), B: _honest(theta0.numel(), 3)}, shapes
    )
    hostile = 0.9 * float(primary.theta.norm())
    handed = dataclasses.replace(_handed_over_the_wire(primary, store), norms=(hostile,) * 3)
    assert await successor.take_over(handed)
    reference = successor.merger.reference()
    assert reference and max(n for _, n in reference) < hostile / 10
    assert "ignored" in successor.reference_note


async def test_a_handed_reference_longer_than_the_fragment_is_dropped_when_nothing_can_be_measured() -> (
    None
):
    """A hostile predecessor hands a reference of norms longer than the fragment itself to a
    successor that holds no earlier version to measure against: dropped all the same."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    huge = 10 * float(theta0.norm())
    owner = _plain_owner(
        plan, shapes, clock, theta0, who=signer(2), version=3, reference=(huge,) * 4
    )
    assert owner.merger.reference() == () and "dropped" in owner.reference_note


async def test_a_whole_fp32_handoff_is_held_where_it_arrived_with_the_copys_bits() -> None:
    """A whole fp32 handoff (global fragment and momentum) read into a request body is held as
    views of that body, not decoded into fresh vectors: the same values as the copy
    ``flat_from_tensors`` makes, the body back in the pool only once a later handoff replaced
    the views, and NaN refused as before."""
    import asyncio
    import gc

    import pytest

    from node.diloco.flat import flat_from_tensors
    from node.wire.bodies import REQUEST_BODY, BufferPool, RequestBody
    from protocol.errors import DecodeError
    from protocol.wire.codec import decode

    numel, pool = 4096, BufferPool()
    store = ReplicaStore(SWARM, [numel])
    gen = torch.Generator().manual_seed(7)

    def handoff(version: int, theta: torch.Tensor) -> ReplicaState:
        # known_finite: the NaN case goes on the wire as a hostile owner would send it
        return encode_state(
            swarm=SWARM,
            fragment=0,
            epoch=1,
            version=version,
            digest=flat_digest(theta),
            theta=theta,
            momentum=torch.randn(numel, generator=gen),
            known_finite=True,
        )

    async def take(msg: ReplicaState) -> tuple[bytearray, tuple[torch.Tensor, torch.Tensor | None]]:
        buf = bytearray(encode(msg).tobytes())
        body = RequestBody(pool, buf, asyncio.get_running_loop())
        token = REQUEST_BODY.set(body)
        try:
            got = decode(memoryview(buf), max_size=len(buf))
            assert isinstance(got, ReplicaState)
            decoded = await asyncio.to_thread(store.decode, got)  # as ``Handoffs.take_in`` does
            assert store.offer(A, got, decoded=decoded).accepted
        finally:
            REQUEST_BODY.reset(token)
            body.end()
        return buf, decoded

    first = handoff(1, torch.randn(numel, generator=gen))
    buf, (theta, momentum) = await take(first)
    assert momentum is not None
    start = theta.data_ptr() - ctypes_address(buf)
    assert 0 <= start < len(buf) and momentum.data_ptr() == theta.data_ptr() + 4 * numel
    shape = [(numel,)]
    assert torch.equal(theta, flat_from_tensors(first.theta, shape))
    assert torch.equal(momentum, flat_from_tensors(first.momentum, shape))
    del theta, momentum
    gc.collect()
    await asyncio.sleep(0)
    assert not any(f is buf for f in pool._free)  # the store still holds the views

    await take(handoff(2, torch.randn(numel, generator=gen)))
    gc.collect()
    for _ in range(3):
        await asyncio.sleep(0)
    assert any(f is buf for f in pool._free)  # replaced: the first body went back

    bad = torch.randn(numel, generator=gen)
    bad[5] = float("nan")
    with pytest.raises(DecodeError, match="NaN or Inf"):
        await take(handoff(3, bad))
    assert store.states[0].version == 2


def ctypes_address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
