"""FragmentOwner with a fake clock: accept, merge at the deadline, seal, wake long-polls; fencing,
catching up with a predecessor, and merges that fail."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord, Membership
from node.diloco.flat import content_hash, flat_digest, flat_from_tensors
from node.diloco.owner import FINAL_HOLD_S
from node.peer import PeerNode
from protocol.diloco.fragments import plan_fragments
from protocol.diloco.norms import all_finite
from protocol.errors import DecodeError, Stale
from protocol.wire.messages import FragmentState
from protocol.wire.signing import split_sealed, verify_sealed
from tests.node.fakes import (
    FakeClock,
    contribution,
    flat_of,
    make_owner,
    shapes_of,
    signer,
    tiny_model,
    tiny_plan,
)

A, B, C = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3))


def _setup(**merge: object):  # type: ignore[no-untyped-def]
    model = tiny_model()
    plan = tiny_plan(model)
    shapes = shapes_of(model, plan)
    clock = FakeClock()
    theta0 = flat_of(model, plan, 0)
    return plan, shapes, clock, theta0, make_owner(plan, shapes, 0, theta0, clock, **merge)


async def _owner_and_twin(n: int):  # type: ignore[no-untyped-def]
    """Two identical owners of fragment 0, each with quorum ``n`` and ``n`` learners expected:
    (shapes, theta0, owner, twin), to feed one two ways and compare their states."""
    _, shapes, _, theta0, owner = _setup(quorum=n)
    _, _, _, _, twin = _setup(quorum=n)
    for o in (owner, twin):
        await o.set_expected(n)
    return shapes, theta0, owner, twin


def _opened_state(
    sealed_bytes: bytes, shapes: list[tuple[int, ...]]
) -> tuple[int, torch.Tensor, bytes]:
    opened = verify_sealed(memoryview(sealed_bytes), max_size=1 << 24)
    state = opened.message
    assert isinstance(state, FragmentState) and state.content_hash == content_hash(state.tensors)
    return state.version, flat_from_tensors(state.tensors, shapes), opened.peer_id


async def test_accepted_then_merged_at_the_deadline_sealed_and_long_poll_woken() -> None:
    plan, shapes, clock, theta0, owner = _setup(quorum=2)
    delta = torch.linspace(-0.05, 0.05, theta0.numel())
    waiter = asyncio.create_task(owner.wait_after(0, wait_s=60.0))
    ack = await owner.contribute(A, contribution(delta, shapes[0], owner=owner))
    assert ack.accepted and ack.version == 0 and "(1 contributions; quorum 2)" in ack.reason
    clock.advance(0.5)
    ack = await owner.contribute(B, contribution(delta, shapes[0], owner=owner))
    # window = gamma * (tau * step_time - quorum time) = 0.5 * (2 * 1.0 - 0.5) = 0.75 s
    assert ack.accepted and "quorum 2/2 reached; grace window 0.75 s" in ack.reason
    assert owner.merger.deadline() == pytest.approx(clock.now + 0.75)
    clock.advance(0.7)
    await owner.tick()
    assert owner.version == 0 and not waiter.done()
    clock.advance(0.1)
    await owner.tick()  # the deadline passed: merge, seal, publish
    assert owner.version == 1 and owner.merges == ["grace window elapsed with 2 contributions"]
    async with asyncio.timeout(10):
        sealed = await waiter
    assert sealed is not None
    version, flat, signed_by = _opened_state(sealed.tobytes(), shapes[0])
    assert version == 1 and signed_by == signer(1).peer_id
    # two identical pseudo-gradients average to themselves; outer lr 1, no momentum: Θ - Δ
    assert torch.allclose(flat, theta0 - delta, atol=1e-6)
    assert owner.idle()


async def test_all_expected_contributions_close_the_round_at_once() -> None:
    _, shapes, _, theta0, owner = _setup(quorum=1)
    await owner.set_expected(2)
    delta = torch.full_like(theta0, 0.025)
    await owner.contribute(A, contribution(delta, shapes[0], owner=owner))
    assert owner.version == 0
    await owner.contribute(B, contribution(delta, shapes[0], owner=owner))
    assert owner.version == 1 and "all 2/2 expected contributions in" in owner.merges[0]


async def test_version_fencing_and_refusals() -> None:
    _, shapes, _, theta0, owner = _setup(quorum=1, late_policy="drop")
    delta = torch.full_like(theta0, 0.01)
    with pytest.raises(Stale, match="base version 3 is ahead of the owner's 0"):
        await owner.contribute(A, contribution(delta, shapes[0], base_version=3, owner=owner))
    await owner.set_expected(2)
    assert (await owner.contribute(A, contribution(delta, shapes[0], owner=owner))).accepted
    dup = await owner.contribute(A, contribution(delta, shapes[0], owner=owner))
    assert not dup.accepted and "duplicate contribution" in dup.reason
    await owner.contribute(B, contribution(delta, shapes[0], owner=owner))
    assert owner.version == 1
    late = await owner.contribute(C, contribution(delta, shapes[0], base_version=0, owner=owner))
    assert not late.accepted and "closed; resync" in late.reason and owner.version == 1
    # a long-poll for a version already held waits; one below it gets the latest at once
    assert await owner.wait_after(1, wait_s=0.0) is None
    assert await owner.wait_after(0, wait_s=0.0) is owner.latest


async def test_work_arriving_after_a_final_version_was_handed_out_is_refused_until_the_hold_lapses() -> (
    None
):
    """A learner that ended its run took version v as final and left: a late learner's work (a
    peer restarted after the end, flushing what its checkpoint held) must not make v + 1, or the
    swarm ends on two models. An idle swarm joined much later merges again."""
    _, shapes, clock, theta0, owner = _setup(quorum=1)
    held_final: list[int] = []
    owner.on_final = lambda o: held_final.append(o.version)  # the node tells the replica once
    delta = torch.full_like(theta0, 0.01)
    await owner.set_expected(1)
    await owner.contribute(A, contribution(delta, shapes[0], owner=owner))
    assert owner.version == 1 and owner.idle()
    final = owner.declare_final()
    assert final is owner.latest and owner.final_declared == (1, clock.now) and held_final == [1]
    clock.advance(3.0)
    late = await owner.contribute(C, contribution(delta, shapes[0], base_version=1, owner=owner))
    assert not late.accepted and "version 1 was handed out as final 3.0 s ago" in late.reason
    assert owner.version == 1 and owner.latest is final and owner.idle()
    assert owner.declare_final() is final and held_final == [1]  # renewed within the hold: no news
    # refused before it is decoded: a malformed payload gets the same answer, not a DecodeError
    bad = contribution(
        torch.full((theta0.numel() + 5,), 0.01),
        [(theta0.numel() + 5,)],
        base_version=1,
        owner=owner,
    )
    assert not (await owner.contribute(C, bad)).accepted
    # every final answer renews the hold; once it lapses the owner merges again
    clock.advance(FINAL_HOLD_S - 1.0)
    owner.declare_final()
    clock.advance(FINAL_HOLD_S - 1.0)
    assert not (
        await owner.contribute(C, contribution(delta, shapes[0], base_version=1, owner=owner))
    ).accepted
    assert held_final == [1]  # each renewal came within the hold: no news
    clock.advance(1.0)
    assert (
        await owner.contribute(C, contribution(delta, shapes[0], base_version=1, owner=owner))
    ).accepted
    assert owner.version == 2
    owner.declare_final()
    owner.hold_final(2)  # already held: no news either
    assert held_final == [1, 2]


@pytest.mark.parametrize(
    ("codec", "bad"), [("none", float("nan")), ("none", float("inf")), ("bf16", float("-inf"))]
)
async def test_a_contribution_holding_nan_or_inf_is_refused_and_merges_nothing(
    codec: str, bad: float
) -> None:
    """The owner reads a contribution's values once, for its norm: a NaN or Inf anywhere makes the
    norm non-finite and the contribution is refused (a 4xx on the wire) before the merger sees it."""
    _, shapes, _, theta0, owner = _setup(quorum=1)
    await owner.set_expected(1)  # one learner: its contribution closes the round at once
    delta = torch.full_like(theta0, 0.01)
    msg = contribution(delta, shapes[0], owner=owner, codec=codec)
    raw = bytearray(msg.tensors[-1].data)
    width = 4 if codec == "none" else 2
    value = torch.tensor([bad], dtype=torch.float32 if codec == "none" else torch.bfloat16)
    raw[-width:] = value.view(torch.uint8).numpy().tobytes()  # the last value of the last tensor
    tensors = (*msg.tensors[:-1], dataclasses.replace(msg.tensors[-1], data=memoryview(bytes(raw))))
    with pytest.raises(DecodeError, match="NaN or Inf"):
        await owner.contribute(A, dataclasses.replace(msg, tensors=tensors))
    assert owner.version == 0 and torch.equal(owner.theta, theta0)
    ack = await owner.contribute(
        B, contribution(delta, shapes[0], owner=owner, codec=codec)
    )  # the next one merges
    assert ack.accepted and owner.version == 1 and all_finite(owner.theta)


async def test_catch_up_keeps_the_contributions_already_accepted() -> None:
    _, shapes, clock, theta0, owner = _setup(quorum=1, staleness_bound=3, late_policy="carry")
    await owner.set_expected(2)
    delta = torch.full_like(theta0, 0.125)
    assert (await owner.contribute(A, contribution(delta, shapes[0], owner=owner))).accepted
    predecessor = theta0 + 1.0  # the previous owner's newer version 2
    assert await owner.catch_up(2, predecessor)
    assert owner.version == 2 and owner.merger.count == 1  # A's contribution is still there
    clock.advance(1.0)
    await owner.contribute(B, contribution(delta, shapes[0], base_version=2, owner=owner))
    assert owner.version == 3, owner.merges
    version, flat, _ = _opened_state(owner.latest.tobytes(), shapes[0])
    assert version == 3 and torch.allclose(flat, predecessor - delta, atol=1e-6)
    assert not await owner.catch_up(2, predecessor)  # not above the held version: refused
    assert not await owner.catch_up(9, predecessor)  # after our own first merge: refused


async def test_catch_up_refuses_a_malformed_version() -> None:
    _, _, _, theta0, owner = _setup()
    assert not await owner.catch_up(5, torch.full_like(theta0, float("nan")))
    assert not await owner.catch_up(5, torch.zeros(3))
    assert owner.version == 0


async def test_a_failed_merge_drops_its_contributions_instead_of_retrying_forever() -> None:
    model = tiny_model()
    plan = plan_fragments(
        [(n, tuple(p.shape)) for n, p in model.named_parameters()], 2, embeddings=["0.weight"]
    )
    p = next(f.index for f in plan.fragments if f.is_embedding)  # merged by a weighted mean
    shapes, clock = shapes_of(model, plan), FakeClock()
    theta0 = torch.full_like(flat_of(model, plan, p), 3.0e38)  # finite, near the float32 maximum
    owner = make_owner(plan, shapes, p, theta0, clock, quorum=1)
    await owner.set_expected(1)
    ack = await owner.contribute(
        A, contribution(torch.full_like(theta0, -3.0e38), shapes[p], fragment=p, owner=owner)
    )
    assert ack.accepted  # the outer step overflows to Inf: the merge fails ...
    assert owner.version == 0 and owner.merges == []
    assert (
        owner.merger.count == 0 and owner.merger.deadline() is None
    )  # ... its set is dropped, no retry
    assert torch.equal(flat_from_tensors(_state(owner).tensors, shapes[p]), theta0)
    clock.advance(5.0)
    await owner.tick()
    assert owner.version == 0
    delta = torch.full_like(theta0, 1.0e38)  # an honest contribution still merges
    await owner.contribute(B, contribution(delta, shapes[p], fragment=p, owner=owner))
    assert owner.version == 1
    assert torch.allclose(flat_from_tensors(_state(owner).tensors, shapes[p]), theta0 - delta)


def _state(owner) -> FragmentState:  # type: ignore[no-untyped-def]
    state = verify_sealed(memoryview(owner.latest.tobytes()), max_size=1 << 24).message
    assert isinstance(state, FragmentState)
    return state


async def test_retire_releases_long_polls_at_once() -> None:
    _, _, _, _, owner = _setup()
    waiter = asyncio.create_task(owner.wait_after(0, wait_s=60.0))
    await asyncio.sleep(0)
    await owner.retire()
    async with asyncio.timeout(5):
        assert await waiter is None


async def test_one_member_sending_a_thousand_times_the_honest_norm_cannot_steer_the_step() -> None:
    _, shapes, _, theta0, owner = _setup(quorum=1)
    await owner.set_expected(4)
    honest = torch.linspace(-0.01, 0.01, theta0.numel())
    D = bytes([0xD4]) * 32
    for peer in (A, B, C):
        await owner.contribute(peer, contribution(honest, shapes[0], owner=owner))
    await owner.contribute(D, contribution(1000.0 * honest, shapes[0], owner=owner))
    assert owner.version == 1
    step = float(torch.linalg.vector_norm(owner.theta - theta0))
    # unclipped, the radial average would step 250x the honest norm; clipped (c = 4), at most
    # (3 x 1 + 4) / 4 = 1.75x
    assert step <= 1.75 * float(torch.linalg.vector_norm(honest)) * 1.001
    assert owner.penalties[D]["clipped"] == 1 and owner.penalties[D]["merged"] == 1
    assert all(owner.penalties[p]["clipped"] == 0 for p in (A, B, C))


async def test_an_aggregate_longer_than_the_fragment_itself_is_bounded() -> None:
    _, shapes, _, theta0, owner = _setup(quorum=1)
    await owner.set_expected(1)
    huge = theta0 * -50.0  # alone in the first round, nothing to clip it against
    await owner.contribute(A, contribution(huge, shapes[0], owner=owner))
    assert owner.version == 1 and owner.step_bounds == 1
    step = float(torch.linalg.vector_norm(owner.theta - theta0))
    assert step == pytest.approx(
        float(torch.linalg.vector_norm(theta0)), rel=1e-4
    )  # max_delta_ratio 1


async def test_a_contribution_is_applied_only_to_the_state_it_was_measured_against() -> None:
    """Version numbers alone can name two contents (two owners of one fragment during a view
    change, or a learner that holds a forked copy): the base digest decides."""
    plan, shapes, clock, theta0, owner = _setup(quorum=1)
    delta = torch.linspace(-0.05, 0.05, theta0.numel())
    other_state = flat_digest(theta0 + 1.0)  # "version 0" with another content
    ack = await owner.contribute(A, contribution(delta, shapes[0], base_digest=other_state))
    assert not ack.accepted and ack.reason.startswith("resync: base version 0")
    assert owner.penalties[A]["refused_base"] == 1 and owner.merger.count == 0
    ack = await owner.contribute(B, contribution(delta, shapes[0], base_digest=flat_digest(theta0)))
    assert ack.accepted  # the learner's own fp32 copy of version 0 is the owner's state
    await owner.set_expected(1)
    clock.advance(30.0)
    await owner.tick()
    assert owner.version == 1
    # version 1 as learners decode it is what the owner expects as a base now, named by the digest
    # of its flat state or by that of its sealed message (which a learner verified on receipt)
    _, flat1, _ = _opened_state(owner.latest.tobytes(), shapes[0])
    envelope, _ = split_sealed(owner.latest.tobytes(), max_size=1 << 24)
    assert owner.digests[1] == {flat_digest(flat1), envelope.digest}
    ack = await owner.contribute(
        A, contribution(delta, shapes[0], base_version=1, base_digest=flat_digest(flat1))
    )
    assert ack.accepted


async def test_a_new_owner_asks_for_a_resync_of_bases_it_never_held() -> None:
    plan, shapes, clock, theta0, _ = _setup()
    owner = make_owner(plan, shapes, 0, theta0, clock, version=5)  # took over at version 5
    delta = torch.linspace(-0.05, 0.05, theta0.numel())
    ack = await owner.contribute(
        A, contribution(delta, shapes[0], base_version=4, base_digest=flat_digest(theta0))
    )
    assert not ack.accepted and "not known here" in ack.reason and ack.reason.startswith("resync")


async def test_a_learner_told_to_resync_is_owed_one_serve_of_the_version() -> None:
    """Its fetch must not be refused as a repeat or past the budget (``protocol.diloco.spread``):
    in a round waiting for its contribution no later version would come (the averaging bench's
    kill test, docs/benchmarks.md). One serve per refusal, granted by the owner's own refusal, at
    most two of one version to one learner."""
    plan, shapes, clock, theta0, _ = _setup()
    owner = make_owner(plan, shapes, 0, theta0, clock, version=5)  # took over at version 5
    delta = torch.linspace(-0.05, 0.05, theta0.numel())
    assert not owner.owes_resync(A) and not owner.owes_resync(None)
    for _ in range(2):  # refused twice: still one serve owed
        ack = await owner.contribute(
            A, contribution(delta, shapes[0], base_version=4, base_digest=flat_digest(theta0))
        )
        assert ack.reason.startswith("resync")
    assert not owner.owes_resync(B)  # only the learner refused
    assert owner.owes_resync(A) and not owner.owes_resync(A)  # spent by asking

    async def refused() -> None:
        ack = await owner.contribute(
            A, contribution(delta, shapes[0], base_version=4, base_digest=flat_digest(theta0))
        )
        assert ack.reason.startswith("resync")

    await refused()  # its fetch was lost: one more serve of the version
    assert owner.owes_resync(A) and not owner.owes_resync(A)
    for _ in range(3):  # past that, refusals of cheap work on a wrong base buy no more uploads
        await refused()
        assert not owner.owes_resync(A)
    await owner.set_expected(1)
    ok = await owner.contribute(B, contribution(delta, shapes[0], base_version=5, owner=owner))
    assert ok.accepted and owner.version == 6  # a new version: owed again
    await refused()
    assert owner.owes_resync(A)


async def test_work_already_merged_is_not_counted_twice() -> None:
    """A learner that gave up waiting for its version re-sends its pseudo-gradient, which is
    cumulative since its base: after the first was merged, the second is refused (resync)."""
    plan, shapes, clock, theta0, owner = _setup(quorum=1)
    delta = torch.full_like(theta0, 0.01)
    await owner.set_expected(1)
    assert (await owner.contribute(A, contribution(delta, shapes[0], owner=owner))).accepted
    assert owner.version == 1
    again = await owner.contribute(
        A, contribution(delta * 2, shapes[0], base_version=0, owner=owner)
    )
    assert not again.accepted and again.reason.startswith(
        "resync: a contribution of yours based on version 0"
    )
    assert owner.version == 1 and owner.penalties[A]["refused_base"] == 1
    other = await owner.contribute(B, contribution(delta, shapes[0], base_version=0, owner=owner))
    assert "merged already" not in other.reason  # another learner's late work is judged as before
    assert (
        await owner.contribute(A, contribution(delta, shapes[0], base_version=1, owner=owner))
    ).accepted


async def test_a_quorum_above_the_live_learners_closes_once_a_record_lapses_not_when_one_is_quiet() -> (
    None
):
    """K = 3 with three learners, one of which dies: the round waits while its member record is
    live (quiet is not gone), then closes with the other two, after the grace window, once the
    record lapses and the node's expected learners (from membership, as its membership loop
    passes them) drop to 2. It used to wait for a third contribution forever."""
    _, shapes, clock, theta0, owner = _setup(quorum=3)
    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    membership = Membership(None, "s", "m")  # type: ignore[arg-type]  # members only: no DHT needed
    learner = MemberRecord(
        url="http://127.0.0.1:1", roles=("learner",), reachable=False, manifest="m", learning=True
    )
    live = time.time() + 3600.0
    membership.members = {
        signer(n).peer_id: Member(signer(n).peer_id, learner, live) for n in (2, 3, 4)
    }
    node.membership = membership
    await owner.set_expected(node.expected.expected_learners())
    delta = torch.full_like(theta0, 0.01)
    for who in (signer(2), signer(3)):
        ack = await owner.contribute(who.peer_id, contribution(delta, shapes[0], owner=owner))
        assert ack.accepted and "quorum 3)" in ack.reason
    clock.advance(600.0)
    await owner.tick()
    await owner.set_expected(
        node.expected.expected_learners()
    )  # the third went quiet, its record still live
    assert owner.version == 0 and owner.merger.count == 2
    dead = signer(4).peer_id
    membership.members[dead] = Member(dead, learner, time.time() - 1.0)  # its record lapsed
    assert node.expected.expected_learners() == 2
    await owner.set_expected(node.expected.expected_learners())
    assert owner.version == 1 and owner.merges == [
        "quorum 2/2 (K = 3 lowered to the 2 learners expected) reached; grace window 0.00 s; "
        "closing with 2/2 contributions"
    ]
    version, flat, _ = _opened_state(owner.latest.tobytes(), shapes[0])
    assert version == 1 and torch.allclose(flat, theta0 - delta, atol=1e-6)


async def test_a_lowered_quorum_waits_out_the_grace_window_before_closing() -> None:
    """With fewer learners expected than K the round never closes on 'all expected in': a
    learner the owner's view missed still gets the window (here 0.5 * 2 * 1.0 s)."""
    _, shapes, clock, theta0, owner = _setup(quorum=3)
    await owner.set_expected(1)
    delta = torch.full_like(theta0, 0.01)
    ack = await owner.contribute(A, contribution(delta, shapes[0], owner=owner))
    assert (
        ack.accepted
        and "K = 3 lowered to the 1 learners expected" in ack.reason
        and owner.version == 0
    )
    clock.advance(0.5)
    assert (
        await owner.contribute(B, contribution(delta, shapes[0], owner=owner))
    ).accepted  # missed by the view
    await owner.tick()
    assert owner.version == 0
    clock.advance(0.5)
    await owner.tick()
    assert owner.version == 1 and owner.merges == ["grace window elapsed with 2/1 contributions"]


async def test_receive_answers_before_the_merge_it_completes_and_reused_buffers_merge_right() -> (
    None
):
    """``receive`` acknowledges the contribution that completes a round at once and merges in the
    background; the next round decodes into the buffers the first one freed, and both merges
    give exactly what ``contribute`` gives."""
    _, shapes, _, theta0, owner = _setup(quorum=1)
    await owner.set_expected(2)
    first, second = torch.full_like(theta0, 0.25), torch.linspace(-0.5, 0.5, theta0.numel())
    assert (await owner.receive(A, contribution(first, shapes[0], owner=owner))).accepted
    ack = await owner.receive(B, contribution(first, shapes[0], owner=owner))
    assert ack.accepted and "all 2/2 expected contributions in" in ack.reason
    assert owner.version == 0  # answered before the merge ran
    await owner.settled()
    assert owner.version == 1 and torch.equal(owner.theta, theta0 - first)
    for who in (A, B):
        await owner.receive(who, contribution(second, shapes[0], base_version=1, owner=owner))
    await owner.settled()
    assert owner.version == 2 and torch.allclose(owner.theta, theta0 - first - second, atol=1e-6)
    _, flat2, _ = _opened_state(owner.latest.tobytes(), shapes[0])
    assert torch.equal(flat2, owner.theta)  # the published bytes are the merged state


async def test_an_ack_names_the_round_its_contribution_joined() -> None:
    """An accepted contribution's Ack names the round it joined, by the version it merges on
    (its sender sends that fragment again only once the round's version has come): the one
    that closed a round says that round, not the version its merge made; one that came while a
    merge ran joined the next round (carried, or stale once that merge published)."""
    _, shapes, _, theta0, owner = _setup(quorum=1, late_policy="carry")
    await owner.set_expected(2)
    delta = torch.full_like(theta0, 0.25)
    assert (await owner.contribute(A, contribution(delta, shapes[0], owner=owner))).version == 0
    ack = await owner.contribute(B, contribution(delta, shapes[0], owner=owner))
    assert ack.accepted and owner.version == 1 and ack.version == 0
    for who in (A, B):  # the round on version 1: answered before its merge runs
        ack = await owner.receive(who, contribution(delta, shapes[0], base_version=1, owner=owner))
        assert ack.accepted and ack.version == 1
    late = await owner.receive(C, contribution(delta, shapes[0], base_version=1, owner=owner))
    assert late.accepted and late.version == 2, late.reason
    await owner.settled()
    refused = await owner.receive(C, contribution(delta, shapes[0], base_version=2, owner=owner))
    assert not refused.accepted and "duplicate" in refused.reason and refused.version == 2


async def test_a_successor_knows_a_version_by_the_digest_learners_verified_from_its_predecessor() -> (
    None
):
    """Learners name a downloaded version by the digest its owner's signature covers (the sealed
    message's). The message holds no signer, time or nonce, so another owner sealing the same
    state (a successor after a handoff) knows the version by that same digest, and work
    measured against it is merged there, not sent back with "resync"."""
    plan, shapes, clock, theta0, first = _setup(quorum=1)
    successor = make_owner(plan, shapes, 0, theta0.clone(), FakeClock(5000.0), who=signer(2))
    envelope, _ = split_sealed(first.latest.tobytes(), max_size=1 << 24)
    assert envelope.peer_id != split_sealed(successor.latest.tobytes(), max_size=1 << 24)[0].peer_id
    assert envelope.digest in successor.digests[0]
    delta = torch.full_like(theta0, 0.125)
    ack = await successor.contribute(A, contribution(delta, shapes[0], base_digest=envelope.digest))
    assert ack.accepted, ack.reason


async def test_a_merge_takes_each_contributions_norm_from_its_arrival_and_publishes_the_same_bits(
    monkeypatch,
) -> None:
    """An owner measures each contribution's norm once, as it arrives, and its merge reuses it
    (norm64 over every fragment-sized buffer costs an owner as much as hashing it), as it does
    |Θ| from when it checked the last merge's result; the published state is bit for bit the
    merge ``atoll replay`` recomputes without those norms.
    Buffers reused by the next round's contributions get their own norms."""
    import protocol.diloco.outer as outer
    from protocol.diloco.norms import norm64
    from protocol.diloco.outer import merge_update

    _, shapes, _, theta0, owner = _setup(quorum=1)
    await owner.set_expected(3)
    measured: list[int] = []
    monkeypatch.setattr(outer, "norm64", lambda t: measured.append(t.numel()) or norm64(t))
    numel = theta0.numel()
    for rnd in range(2):  # the second round decodes into the first round's buffers
        deltas = [
            torch.randn(numel, generator=torch.Generator().manual_seed(10 * rnd + i)) * 0.01
            for i in range(3)
        ]
        before, measured[:] = owner.theta.clone(), []
        for who, d in zip((A, B, C), deltas, strict=True):
            await owner.contribute(who, contribution(d, shapes[0], base_version=rnd, owner=owner))
        assert owner.version == rnd + 1
        # no contribution's norm is measured in the merge; nor |Θ| (in the first round it is
        # the one the screen measured on arrival, then the previous merge's, measured as its
        # result was checked for NaN/Inf), nor the aggregate's: no longer than its longest
        # delta, it cannot break the bound of |Θ|
        assert measured == [], (rnd, measured)
        replayed = merge_update(
            before, None, deltas, [1.0] * 3, [1.0] * 3, owner.outer_cfg, embedding=False
        )
        assert torch.equal(owner.theta, replayed.theta)


async def test_our_own_learners_contribution_is_taken_without_a_copy_and_never_reused() -> None:
    """A contribution from this peer's own learner comes with the flat vector its ``none``
    tensors are views of: the owner merges that vector as it is (no decode copy), the same
    state as the decoded one, and never hands it out as a spare buffer for a later contribution
    (the learner may still hold it to send again). A vector of the wrong size is refused."""
    from protocol.errors import DecodeError

    shapes, theta0, owner, twin = await _owner_and_twin(1)
    numel = theta0.numel()
    own = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 0.01
    kept = own.clone()
    msg = contribution(own, shapes[0], base_version=0, owner=owner)
    assert (await owner.contribute(A, msg, own)).accepted
    assert (
        await twin.contribute(A, contribution(own, shapes[0], base_version=0, owner=twin))
    ).accepted
    assert owner.version == twin.version == 1 and torch.equal(owner.theta, twin.theta)
    assert all(spare is not own for spare in owner.intake.spare)
    for rnd, who in enumerate(
        (B, C), start=1
    ):  # later contributions decode into spares, never into ``own``
        d = torch.randn(numel, generator=torch.Generator().manual_seed(10 + rnd)) * 0.01
        assert (
            await owner.contribute(who, contribution(d, shapes[0], base_version=rnd, owner=owner))
        ).accepted
    assert torch.equal(own, kept)
    with pytest.raises(DecodeError, match="flat fp32 vector"):
        await owner.contribute(
            A, contribution(own, shapes[0], base_version=3, owner=owner), own[:-1]
        )


async def test_fp32_contributions_are_merged_where_they_arrived_and_their_bodies_pooled_after() -> (
    None
):
    """An fp32 contribution read into a request body is merged as a view of that body (no
    decode copy): the same state as one decoded by copy, and the body's buffer goes back to the
    pool only once the request has ended and the merge no longer holds the view."""
    import gc

    from node.wire.bodies import REQUEST_BODY, BufferPool, RequestBody
    from protocol.wire.codec import decode, encode

    shapes, theta0, owner, twin = await _owner_and_twin(2)
    pool, numel = BufferPool(), theta0.numel()
    deltas = [
        torch.randn(numel, generator=torch.Generator().manual_seed(20 + i)) * 0.01 for i in range(2)
    ]
    bodies = []
    for who, d in zip((A, B), deltas, strict=True):
        buf = bytearray(encode(contribution(d, shapes[0], base_version=0, owner=owner)).tobytes())
        body = RequestBody(pool, buf, asyncio.get_running_loop())
        token = REQUEST_BODY.set(body)
        try:
            msg = decode(memoryview(buf), max_size=len(buf))
            assert (await owner.receive(who, msg)).accepted
        finally:
            REQUEST_BODY.reset(token)
        del msg
        body.end()
        bodies.append(buf)
        if (
            who == A
        ):  # one contribution of a quorum of two: its view waits in the merger, holding the body
            gc.collect()
            await asyncio.sleep(0)
            assert not any(f is buf for f in pool._free)
    for who, d in zip((A, B), deltas, strict=True):
        assert (
            await twin.contribute(who, contribution(d, shapes[0], base_version=0, owner=twin))
        ).accepted
    await owner.settled()
    assert owner.version == twin.version == 1 and torch.equal(owner.theta, twin.theta)
    assert owner.intake.spare == []  # a view of a body is never kept as a spare buffer
    gc.collect()
    for _ in range(3):
        await asyncio.sleep(0)
    assert all(any(f is b for f in pool._free) for b in bodies)


@pytest.mark.parametrize("codec", ["int8", "int4"])
async def test_compressed_contributions_wait_compressed_and_merge_to_the_decoded_ones_bits(
    codec: str,
) -> None:
    """A compressed contribution waits for its round as it arrived (its tensors, holding the
    request body they lie in), not decoded: the merge decodes it a slice at a time, to the state
    a twin owner merges from the same contributions decoded whole; the bodies go back to the
    pool once merged."""
    import gc

    from node.wire.bodies import REQUEST_BODY, BufferPool, RequestBody
    from protocol.diloco.sliced import EncodedVector
    from protocol.wire.codec import decode, encode

    shapes, theta0, owner, twin = await _owner_and_twin(3)
    pool, numel = BufferPool(), theta0.numel()
    msgs = [
        contribution(
            torch.randn(numel, generator=torch.Generator().manual_seed(40 + i)) * 0.01,
            shapes[0],
            codec=codec,
            owner=owner,
        )
        for i in range(3)
    ]
    bodies = []
    for who, msg in zip((A, B, C), msgs, strict=True):
        buf = bytearray(encode(msg).tobytes())
        body = RequestBody(pool, buf, asyncio.get_running_loop())
        token = REQUEST_BODY.set(body)
        try:
            assert (await owner.receive(who, decode(memoryview(buf), max_size=len(buf)))).accepted
        finally:
            REQUEST_BODY.reset(token)
        body.end()
        bodies.append(buf)
        if who != C:  # waiting in the merger: compressed, holding its body
            assert all(isinstance(e.payload, EncodedVector) for e in owner.merger._entries)
            gc.collect()
            await asyncio.sleep(0)
            assert not any(f is buf for f in pool._free)
    for who, msg in zip((A, B, C), msgs, strict=True):  # decoded whole, as owners did before
        flat = flat_from_tensors(msg.tensors, shapes[0])
        assert (await twin.contribute(who, msg, flat)).accepted
    await owner.settled()
    assert owner.version == twin.version == 1 and torch.equal(owner.theta, twin.theta)
    gc.collect()
    for _ in range(3):
        await asyncio.sleep(0)
    assert all(any(f is b for f in pool._free) for b in bodies)


async def test_a_senders_last_contribution_waits_for_the_others_once() -> None:
    """An island's end-of-run flush is marked ``last``: its round waits (``last_wait_s``) for
    every expected learner's instead of closing on the quorum. The mark is honoured once per
    sender, so a member that marks all its work "last" cannot hold every round back."""
    import dataclasses

    from protocol.diloco.merge import Phase

    _, shapes, clock, theta0, owner = _setup(quorum=1)
    delta = torch.full_like(theta0, 0.01)
    await owner.set_expected(2)
    ack = await owner.contribute(
        A, dataclasses.replace(contribution(delta, shapes[0], owner=owner), last=True)
    )
    assert ack.accepted and owner.version == 0 and owner.merger.phase is Phase.GRACE  # waits for B
    await owner.contribute(B, contribution(delta, shapes[0], owner=owner))
    assert owner.version == 1  # both in: merged at once, in one round
    ack = await owner.contribute(
        A,
        dataclasses.replace(contribution(delta, shapes[0], base_version=1, owner=owner), last=True),
    )
    clock.advance(1.0)  # its grace window (0.5 * 2 steps * 1 s), not last_wait_s (3 s)
    await owner.tick()
    assert ack.accepted and owner.version == 2  # a second "last" from A is not honoured


async def test_a_refused_last_contribution_does_not_spend_the_senders_mark() -> None:
    """A flush the merger refuses (here a duplicate: its sender's regular contribution is in the
    same round) leaves the sender's one ``last`` mark unspent: resent on the next version, it
    still makes its round wait for the other learners."""
    import dataclasses

    from protocol.diloco.merge import Phase

    _, shapes, clock, theta0, owner = _setup(quorum=1)
    delta = torch.full_like(theta0, 0.01)
    await owner.set_expected(2)
    assert (await owner.contribute(A, contribution(delta, shapes[0], owner=owner))).accepted
    ack = await owner.contribute(
        A, dataclasses.replace(contribution(delta, shapes[0], owner=owner), last=True)
    )
    assert not ack.accepted and "duplicate" in ack.reason
    clock.advance(1.0)
    await owner.tick()
    assert owner.version == 1
    ack = await owner.contribute(
        A,
        dataclasses.replace(contribution(delta, shapes[0], base_version=1, owner=owner), last=True),
    )
    assert ack.accepted and owner.merger.phase is Phase.GRACE
    clock.advance(1.0)  # past its grace window (1 s), within last_wait_s (3 s): still waiting for B
    await owner.tick()
    assert owner.version == 1
    await owner.contribute(B, contribution(delta, shapes[0], base_version=1, owner=owner))
    assert owner.version == 2


# --- issue 47: no member can steer a merge ------------------------------------------------------


def _node_owner(
    clock: FakeClock,
    initial: torch.Tensor,
    shapes: list[list[tuple[int, ...]]],
    plan,  # type: ignore[no-untyped-def]
    version: int = 0,
):
    """A ``FragmentOwner`` configured as the node configures one from ``RunConfig``'s defaults
    (``Ownership._merge_cfg``/``_outer_cfg``): plain averaging, ``normed``, K = 1 at half
    the learners, steps bounded to 2H, max_tokens_per_step set as a swarm sets it."""
    from node.diloco.owner import FragmentOwner, OwnerClocks, OwnerConfig, OwnerStart
    from protocol.diloco.merge import MergeConfig
    from protocol.diloco.outer import OuterConfig
    from tests.node.fakes import SWARM

    c = RunConfig(max_tokens_per_step=1024)
    cfg = MergeConfig(
        quorum=c.quorum,
        quorum_fraction=c.merge_quorum_fraction,
        gamma=c.grace_gamma,
        tau=c.grace_tau,
        grace_cap_s=c.grace_cap_s,
        staleness_bound=c.staleness_bound,
        late_policy="carry",
        max_tokens_per_step=c.max_tokens_per_step,
        max_work_steps=c.merge_max_work_steps,
        max_claimed_steps=c.merge_max_claimed_steps,
        reference_min_steps=c.inner_steps // 2,
    )
    outer = OuterConfig(
        lr=c.outer_lr, momentum=c.outer_momentum, aggregate=c.aggregate, rda_max_gain=c.rda_max_gain
    )
    return FragmentOwner(
        OwnerConfig(
            swarm=SWARM,
            fragment=plan.fragments[0],
            shapes=tuple(shapes[0]),
            merge=cfg,
            outer=outer,
        ),
        OwnerStart(
            theta=initial,
            version=version,
        ),
        signer=signer(1),
        clocks=OwnerClocks(clock),
    )


def _direction(seed: int, like: torch.Tensor, norm: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(like.numel(), generator=g)
    return v * (norm / float(v.norm()))


async def _warm_node_owner(
    theta0: torch.Tensor,
    shapes: list[list[tuple[int, ...]]],
    plan,  # type: ignore[no-untyped-def]
    clock: FakeClock,
    honest_norm: float,
):
    """A node-configured owner after four honest rounds of one learner each (a warm history)."""
    H = RunConfig().inner_steps
    owner = _node_owner(clock, theta0, shapes, plan)
    for i in range(4):
        clock.advance(20.0)
        await owner.set_expected(1)
        delta = _direction(i, theta0, honest_norm)
        ack = await owner.contribute(
            bytes([0x10 + i]) * 32,
            contribution(
                delta, shapes[0], owner=owner, base_version=owner.version, steps=H, tokens=H * 1024
            ),
        )
        assert ack.accepted and owner.version == i + 1
    return owner


@pytest.mark.parametrize("case", ["alone", "beside two honest", "fresh owner"])
async def test_issue_47_no_member_steers_a_merge_through_the_owner(case: str) -> None:
    """The three attacks of issue 47 through a real owner at the node's settings, each bounded.
    "alone": one member alone in a round of a warm owner, claiming 20,001 steps of a 20 s-old
    version, its payload equal to Theta (|Theta| 8.97 -> 0.00 on main: divided by the claimed
    steps its norm looked honest; here 50x an honest step). "beside two honest": the same beside
    two honest learners, claiming the most tokens (8.95 -> 3.03: 80 % of the weight picked the
    step's length). "fresh owner": honest step counts, beside one honest learner, against an
    owner that just took over with no norm history (8.95 -> 6.87, 33x an honest step: the median
    of two rates, their mean, set the clip's reference). Now the whole norm is clipped to 4x the
    lower median of one norm per sender, and the step's length is the unweighted median: at most
    4x an honest step alone, 1x beside two honest learners, (1 + 4) / 2 = 2.5x beside one."""
    plan, shapes, clock, theta0, _ = _setup()
    honest_norm = 0.02 * float(theta0.norm())
    liar = bytes([0xEE]) * 32
    H = RunConfig().inner_steps
    owner = await _warm_node_owner(theta0, shapes, plan, clock, honest_norm)
    clock.advance(20.0)  # a version 20 s old: 1 ms a step allows 20,001 steps
    before = owner.theta.clone()
    if case == "fresh owner":  # it took over from the warm one: same version, no history
        owner = _node_owner(clock, before, shapes, plan, version=owner.version)
        assert owner.merger.norm_reference() is None
    honest = {"alone": (), "beside two honest": (A, B), "fresh owner": (A,)}[case]
    steps = H if case == "fresh owner" else 20_001
    await owner.set_expected(1 + len(honest))
    base = owner.version
    for j, peer in enumerate(honest):
        await owner.contribute(
            peer,
            contribution(
                _direction(50 + j, theta0, honest_norm),
                shapes[0],
                owner=owner,
                base_version=base,
                steps=H,
                tokens=H * 1024,
            ),
        )
    ack = await owner.contribute(
        liar,
        contribution(
            before.clone(),
            shapes[0],
            owner=owner,
            base_version=base,
            steps=steps,
            tokens=steps * 1024,
        ),
    )
    assert ack.accepted and owner.version == base + 1, ack.reason
    moved = float((owner.theta - before).norm()) / honest_norm
    assert moved <= {"alone": 4.0, "beside two honest": 1.0, "fresh owner": 2.5}[case] * 1.0001, (
        moved
    )
    assert owner.penalties[liar]["clipped"] == 1


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_contribution_far_out_of_bounds_is_refused_at_intake_and_counted(
    codec: str,
) -> None:
    """fp32 values near 3e38 (or int8 with a scale near 2.6e36) were acknowledged as accepted and
    only clipped at the merge: now refused as "out of bounds" (over 1000x the recent merged
    norms' median, or |Theta| with no history), counted against the sender, merging nothing."""
    _, shapes, clock, theta0, owner = _setup(quorum=1)
    await owner.set_expected(1)
    far = torch.full_like(theta0, 3.0e38)
    ack = await owner.contribute(A, contribution(far, shapes[0], owner=owner, codec=codec))
    assert not ack.accepted and ack.reason.startswith("out of bounds") and "|Theta|" in ack.reason
    assert owner.version == 0 and owner.penalties[A]["refused_out_of_bounds"] == 1
    honest = torch.full_like(theta0, 0.01)
    assert (await owner.contribute(B, contribution(honest, shapes[0], owner=owner))).accepted
    assert owner.version == 1  # with a history, the bound is 1000x its median
    ack = await owner.contribute(
        A, contribution(honest * 2000.0, shapes[0], owner=owner, base_version=1, codec=codec)
    )
    assert not ack.accepted and "recent merged norms' median" in ack.reason
    assert owner.version == 1 and owner.penalties[A]["refused_out_of_bounds"] == 2
    assert (
        await owner.contribute(
            A, contribution(honest * 3.0, shapes[0], owner=owner, base_version=1)
        )
    ).accepted


async def test_work_that_agrees_with_no_one_in_its_rounds_falls_below_every_honest_sender(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """Issue 47, attackers whose work does no measurable harm: four honest learners whose work
    shares each round's direction, one sending a random direction at an honest norm and one
    re-sending its first round's work for ever (``random`` and ``stale``). On main each earned
    the merge credit an honest learner earns, and both ended level with them. Now the owner finds
    their work agreeing with none of the round's other senders' (``dissent``), charges it, and both
    end below every honest learner; ``atoll replay`` recomputes every verdict from the log and
    the kept contributions with no mismatch."""
    from node.diloco.eventlog import replay

    model = tiny_model()
    plan = tiny_plan(model)
    shapes = shapes_of(model, plan)
    clock = FakeClock()
    theta0 = flat_of(model, plan, 0)
    log = tmp_path / "owner.jsonl"
    owner = make_owner(plan, shapes, 0, theta0, clock, event_log=log)
    honest = [bytes([0x20 + i]) * 32 for i in range(4)]
    noisy, stale = bytes([0xD1]) * 32, bytes([0xD2]) * 32
    norm = 0.01 * float(theta0.norm())
    # the tiny fragment has 32 values: random directions would agree by chance (~0.18), so every
    # direction is a column of one orthonormal basis: each round's shared one, each honest
    # learner's own, the random sender's; honest pairs then agree at exactly 0.5, the rest at 0
    basis = torch.linalg.qr(
        torch.randn(theta0.numel(), theta0.numel(), generator=torch.Generator().manual_seed(5))
    )[0].T
    first: torch.Tensor | None = None
    rounds = 5  # the random sender is refused for its standing after these
    for r in range(rounds):
        clock.advance(5.0)
        await owner.set_expected(6)
        work = {
            peer: (basis[r] + basis[5 + 4 * r + i]) * (norm / 2**0.5)
            for i, peer in enumerate(honest)
        }
        first = work[honest[0]].clone() if first is None else first
        work[noisy] = basis[25 + r] * norm
        work[stale] = first.clone()
        base = owner.version
        for peer, delta in work.items():
            ack = await owner.contribute(
                peer, contribution(delta, shapes[0], owner=owner, base_version=base)
            )
            assert ack.accepted, ack.reason
        assert owner.version == base + 1
    scores = {p: owner.standing.score(p, version=owner.version) for p in [*honest, noisy, stale]}
    assert owner.penalties[noisy]["dissent"] == rounds
    assert owner.penalties[stale]["dissent"] == rounds - 1  # its first round was honest work
    assert all(owner.penalties[p]["dissent"] == 0 for p in honest)
    assert max(scores[noisy], scores[stale]) < 0 < min(scores[p] for p in honest), scores
    assert owner.standing.refused(noisy, version=owner.version) is not None
    result = replay(log)
    assert result.agreements == rounds and not result.mismatches, result.mismatches


async def test_the_held_states_norm_is_measured_once_per_version_and_is_norm64s() -> None:
    """|Θ| screens every contribution that arrives with no norm reference yet: it is measured
    once per state held (``OwnerState.theta_norm`` keeps it beside the state), to the same bits
    as ``norm64``, and measured again once the owner holds another state."""
    from protocol.diloco.norms import norm64

    _, shapes, _, theta0, owner = _setup(quorum=1)
    held = owner.held
    first = held.theta_norm()
    assert first == norm64(theta0) == norm64(held.theta)
    assert held.known_norm is not None and held.known_norm[0]() is held.theta
    held.theta = held.theta * 2.0  # another state held (a merge publishes a new tensor)
    assert held.theta_norm() == norm64(held.theta) != first
    assert held.known_norm[0]() is held.theta
