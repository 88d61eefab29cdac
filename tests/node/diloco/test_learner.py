"""The island's network side (IslandNet) against in-memory owners, with a fake clock.

No sockets: contributions go through ``MemoryTransport`` to real ``FragmentOwner`` objects,
sealed and verified both ways, and timeouts run on a fake clock. Two tests wait on real
concurrency (sync mode's blocked step on a thread; a slow owner's task), polling every 10 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable

import pytest
import torch

from node.diloco.flat import flat_digest
from node.diloco.island import Island, IslandConfig, Outgoing
from node.diloco.learner import IslandNet, LearnerNetConfig, OwnerLinks, Reach
from node.diloco.owner import FragmentOwner
from protocol.errors import RemoteProtocolError
from tests.node.fakes import (
    SWARM,
    FakeClock,
    MemoryOwnerPeer,
    MemoryTransport,
    flat_of,
    make_owner,
    shapes_of,
    signer,
    tiny_model,
    tiny_plan,
)

OWNER_URL = "http://owner.test"
H = 4


class Rig:
    """One island and its IslandNet; one owner peer owning every fragment."""

    def __init__(self, *, codec: str = "int8", member: bool = True) -> None:
        self.model = tiny_model()
        self.plan = tiny_plan(self.model)
        self.shapes = shapes_of(self.model, self.plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.clock = FakeClock()
        self.island = Island(
            self.model, self.opt, self.plan, lambda _out: None, IslandConfig(inner_steps=H)
        )
        self.me, self.owner_key = signer(7), signer(1)
        self.owners: dict[int, FragmentOwner] = {
            p: make_owner(
                self.plan,
                self.shapes,
                p,
                flat_of(self.model, self.plan, p),
                self.clock,
                who=self.owner_key,
                quorum=1,
                late_policy="drop",
            )
            for p in range(len(self.plan.fragments))
        }
        self.peer = MemoryOwnerPeer(
            self.owner_key, self.owners, members={self.me.peer_id} if member else set()
        )
        self.transport = MemoryTransport()
        self.transport.add(OWNER_URL, self.peer)
        self.net = IslandNet(
            self.island,
            LearnerNetConfig(swarm=SWARM, shapes=self.shapes, codec=codec),
            OwnerLinks(
                self.me,
                Reach(self.transport, owner_of=lambda p: (self.owner_key.peer_id, OWNER_URL)),
            ),
        )

    def step(self) -> None:
        loss = self.model(torch.randn(3, 4)).pow(2).sum()
        loss.backward()
        self.island.tokens(12)
        self.opt.step()
        self.opt.zero_grad()

    def outgoing(
        self, p: int = 0, delta: torch.Tensor | None = None, base_version: int = 0
    ) -> Outgoing:
        """What the island's hook hands over when fragment ``p`` is due (marked in flight)."""
        if delta is None:
            delta = self.island.global_flat[p] - flat_of(self.model, self.plan, p)
        self.island.in_flight[p] = self.island.stats.step
        return Outgoing(
            fragment=p,
            base_version=base_version,
            tokens=48,
            steps=H,
            step_time=0.0,
            sender_step=self.island.stats.step,
            delta=delta.clone(),
        )


def _delta(n: int) -> torch.Tensor:
    return torch.linspace(-0.3, 0.3, n) + 0.0123  # values int8 cannot hold exactly


async def test_accepted_contribution_is_merged_and_delivered() -> None:
    rig = Rig()
    await rig.owners[0].set_expected(1)
    before = rig.owners[0].theta.clone()
    out = rig.outgoing(0, _delta(before.numel()))
    delta = out.delta.clone()  # the network side's copy is released once it is compressed
    await rig.net.sender.send(out)
    assert out.delta.numel() == 0
    assert rig.net.stats.contributions_accepted == 1 and rig.owners[0].version == 1
    assert rig.island.in_flight[0] is not None  # accepted: in flight until the new version comes
    assert (0, 0) in rig.net.residuals  # the quantisation error is kept for the next contribution
    got = await rig.net.fetch(0, after=0, wait_s=0.0)
    assert got is not None and got[0] == 1
    # what the owner merged is the int8 image of the delta: the residual is exactly the rest
    residual = torch.cat([rig.net.residuals[(0, i)].reshape(-1) for i in range(len(rig.shapes[0]))])
    assert torch.allclose(before - got[1], delta - residual, atol=1e-6)
    rig.island.deliver(0, *got)
    rig.step()  # adopted after the next inner step
    assert rig.island.versions[0] == 1 and rig.island.in_flight[0] is None
    assert torch.equal(rig.island.global_flat[0], got[1])


async def test_a_refused_contribution_frees_the_fragment_and_keeps_the_residual() -> None:
    rig = Rig()
    n = rig.owners[0].theta.numel()
    await rig.net.sender.send(
        rig.outgoing(0, _delta(n))
    )  # accepted; owner waits for more (grace window)
    kept = {k: v.clone() for k, v in rig.net.residuals.items()}
    for _ in range(3):
        rig.step()
    await rig.net.sender.send(
        rig.outgoing(0, _delta(n) * 2)
    )  # a duplicate for the same round: refused
    assert rig.net.stats.contributions_refused == 1
    assert rig.island.in_flight[0] is None  # freed: due again H steps later
    assert rig.island.next_due[0] == rig.island.stats.step + H
    assert rig.net.residuals.keys() == kept.keys()
    assert all(
        torch.equal(rig.net.residuals[k], kept[k]) for k in kept
    )  # no error from the refused one


async def test_an_undelivered_contribution_keeps_the_residual() -> None:
    rig = Rig()
    await rig.owners[0].set_expected(1)
    n = rig.owners[0].theta.numel()
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))
    kept = {k: v.clone() for k, v in rig.net.residuals.items()}
    got = await rig.net.fetch(0, after=0, wait_s=0.0)  # version 1, the base of the next one
    assert got is not None
    rig.net.remember(0, *got)
    rig.transport.down.add(OWNER_URL)
    await rig.net.sender.send(rig.outgoing(0, _delta(n) * 3, base_version=1))
    assert rig.net.stats.send_failures == 1 and rig.island.in_flight[0] is None
    assert all(torch.equal(rig.net.residuals[k], kept[k]) for k in kept)


async def test_an_ack_signed_by_another_key_does_not_count() -> None:
    rig = Rig()
    rig.peer.ack_signer = signer(66)  # someone between us and the owner answers for it
    await rig.net.sender.send(rig.outgoing(0, _delta(rig.owners[0].theta.numel())))
    assert rig.net.stats.contributions_accepted == 0 and rig.net.stats.send_failures == 1
    assert rig.island.in_flight[0] is None and rig.net.residuals == {}


async def test_a_non_member_is_refused_and_the_fragment_freed() -> None:
    rig = Rig(member=False)
    await rig.net.sender.send(rig.outgoing(0, _delta(rig.owners[0].theta.numel())))
    assert rig.net.stats.contributions_refused == 1 and rig.island.in_flight[0] is None
    assert rig.owners[0].merger.count == 0


async def test_a_non_finite_pseudo_gradient_is_skipped_and_the_island_resynced() -> None:
    rig = Rig()
    await rig.owners[0].set_expected(1)
    await rig.net.sender.send(
        rig.outgoing(0, _delta(rig.owners[0].theta.numel()))
    )  # the owner is at version 1
    rig.step()
    with torch.no_grad():  # the island diverges: fragment 0's parameters and AdamW moments go NaN
        for param in rig.island.params[0]:
            param.fill_(float("nan"))
            rig.opt.state[param]["exp_avg"].fill_(float("nan"))
    out = rig.outgoing(0, base_version=0)
    assert not torch.isfinite(out.delta).all()
    sent_before = rig.peer.requests
    await rig.net.sender.send(out)  # must not raise: the node keeps running
    assert rig.net.stats.skipped_nonfinite == 1 and rig.net.stats.resyncs == 1
    assert (
        rig.owners[0].merger.count == 0 and rig.owners[0].version == 1
    )  # nothing was sent to merge
    assert rig.peer.requests == sent_before + 2  # only the resync's fetches, one per fragment
    rig.step()  # adopts the owners' versions whole
    assert rig.island.versions == [1, 0] and rig.island.stats.resynced == 2
    for p in (0, 1):
        assert torch.equal(flat_of(rig.model, rig.plan, p), rig.owners[p].theta)
    assert all(rig.opt.state.get(param) is None for param in rig.island.params[0])  # moments reset
    for _ in range(3):  # training goes on with finite weights
        rig.step()
    assert rig.island.stats.resynced == 2  # both fragments, in the same step
    assert all(torch.isfinite(param).all() for param in rig.model.parameters())


async def test_fetch_checks_signer_version_and_fragment() -> None:
    rig = Rig()
    await rig.owners[1].set_expected(1)
    await rig.net.sender.send(rig.outgoing(1, _delta(rig.owners[1].theta.numel())))
    assert (await rig.net.fetch(1, after=0, wait_s=0.0)) is not None
    assert await rig.net.fetch(1, after=1, wait_s=0.0) is None  # nothing newer: 204
    impostor = signer(99).peer_id  # the version is not signed by the peer we take for the owner
    with pytest.raises(RemoteProtocolError, match="not its owner"):
        await rig.net.fetch(1, after=0, wait_s=0.0, owner=(impostor, OWNER_URL))
    rig.owners[0] = rig.owners[1]  # an owner that answers for fragment 0 with fragment 1's state
    with pytest.raises(RemoteProtocolError, match="wrong message for fragment 0"):
        await rig.net.fetch(0, after=0, wait_s=0.0)


async def test_island_fences_versions() -> None:
    rig = Rig()
    flat = rig.island.global_flat[0] + 1.0
    rig.island.deliver(0, 3, flat)
    rig.island.deliver(0, 2, flat - 5.0)  # older than what waits in the inbox: ignored
    rig.step()
    assert rig.island.versions[0] == 3 and torch.equal(rig.island.global_flat[0], flat)
    rig.island.deliver(0, 3, flat + 9.0)  # the version held: not adopted again
    rig.step()
    assert torch.equal(rig.island.global_flat[0], flat)


async def test_a_version_jump_is_refused_with_a_reason() -> None:
    """An owner (even the right one) that signs a version above what can have been merged since
    the swarm was created, or since the last version seen, is refused; honest rates pass."""
    rig = Rig()
    created = rig.clock() - 10.0  # ten seconds at most 100 merges a second: at most version 1001
    net = IslandNet(
        rig.island,
        LearnerNetConfig(swarm=SWARM, shapes=rig.shapes, created=created),
        OwnerLinks(
            rig.me, Reach(rig.transport, owner_of=lambda p: (rig.owner_key.peer_id, OWNER_URL))
        ),
        wall_clock=rig.clock,
    )

    def serve(version: int) -> None:
        rig.owners[0] = make_owner(
            rig.plan,
            rig.shapes,
            0,
            flat_of(rig.model, rig.plan, 0),
            rig.clock,
            who=rig.owner_key,
            version=version,
        )
        rig.peer.owners[0] = rig.owners[0]

    serve(2**63 - 1)
    with pytest.raises(RemoteProtocolError, match="above the 1001 an owner can have reached"):
        await net.fetch(0, after=-1, wait_s=0.0)
    assert net.stats.version_jumps == 1
    serve(900)
    got = await net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and got[0] == 900
    net.remember(0, *got)
    serve(950)  # fifty merges in no time since version 900 arrived: refused
    with pytest.raises(RemoteProtocolError, match="version 900 was seen"):
        await net.fetch(0, after=900, wait_s=0.0)
    rig.clock.advance(1.0)  # a second later it can have happened
    got = await net.fetch(0, after=900, wait_s=0.0)
    assert got is not None and got[0] == 950


async def test_sync_mode_waits_for_the_merged_version_before_the_next_step() -> None:
    """The synchronous comparison mode: after shipping, the island blocks until the fragment's
    merged version arrives (or a refusal frees it), then adopts it before the next step."""
    import threading
    import time

    rig = Rig()
    rig.island.cfg = IslandConfig(inner_steps=H, wait_for_merge=True, wait_timeout_s=5.0)
    shipped: list[Outgoing] = []
    rig.island._submit = shipped.append  # type: ignore[method-assign]

    def owner_side() -> None:  # merges 0.3 s after the contributions arrive
        while not shipped:
            time.sleep(0.01)
        time.sleep(0.3)
        for out in list(shipped):
            rig.island.deliver(out.fragment, 1, rig.island.global_flat[out.fragment] + 0.25)

    threading.Thread(target=owner_side, daemon=True).start()
    durations = []
    while not shipped:
        t0 = time.monotonic()
        rig.step()
        durations.append(time.monotonic() - t0)
    p = shipped[0].fragment
    # the whole model went at once: staggered fragments would deadlock learners out of phase
    assert sorted(out.fragment for out in shipped) == list(range(len(rig.plan.fragments)))
    assert durations[-1] >= 0.25  # the shipping step waited for the merges
    assert rig.island.versions == [1] * len(rig.plan.fragments)  # and adopted them
    assert all(sent is None for sent in rig.island.in_flight)
    rig.island.cfg = IslandConfig(inner_steps=H)  # decoupled: never waits
    t0 = time.monotonic()
    for _ in range(2 * H):
        rig.step()
    assert time.monotonic() - t0 < 2.0 and rig.island.in_flight[p] is not None


async def test_work_accepted_by_an_owner_that_left_is_sent_again_at_once_with_its_residuals() -> (
    None
):
    """An owner accepted a contribution and stopped owning the fragment before merging it: the
    island sends it again at its next step (not after a 2H timeout), and the error-feedback
    residuals the lost send left are dropped (the next send carries that work again)."""
    rig = Rig()
    owner_id = rig.owner_key.peer_id
    current = {"id": owner_id}
    rig.net.sender.reach.owner_of = lambda p: (current["id"], OWNER_URL)
    n = rig.owners[0].theta.numel()
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))  # accepted; the owner waits for more
    assert rig.net.stats.contributions_accepted == 1 and rig.island.in_flight[0] is not None
    assert rig.net.residuals  # the send's quantisation error
    assert rig.net.owners_changed() == 0  # the same owner: nothing to do
    current["id"] = signer(8).peer_id  # the fragment moved to another owner
    assert rig.net.owners_changed() == 1
    assert rig.island.in_flight[0] is None and rig.island.next_due[0] == rig.island.stats.step
    assert not any(k[0] == 0 for k in rig.net.residuals)  # back to before the lost send
    assert rig.net.stats.resent_on_owner_change == 1
    assert rig.net.owners_changed() == 0  # once


def _sync_rig() -> Rig:
    """A synchronous island, and an owner of fragment 0 whose merge waits for two learners."""
    rig = Rig()
    rig.island.cfg = IslandConfig(inner_steps=H, wait_for_merge=True)
    rig.owners[0] = _waiting_owner(rig)
    return rig


def _waiting_owner(rig: Rig) -> FragmentOwner:
    return make_owner(
        rig.plan,
        rig.shapes,
        0,
        flat_of(rig.model, rig.plan, 0),
        rig.clock,
        who=rig.owner_key,
        quorum=2,
        late_policy="drop",
    )


def _age(rig: Rig, p: int, seconds: float) -> None:
    """Move the Ack of fragment ``p``'s contribution ``seconds`` into the past (the envelopes'
    wall clock stays real: owners refuse timestamps far from their own)."""
    accepted = rig.net.sender._accepted_by[p]
    rig.net.sender._accepted_by[p] = dataclasses.replace(accepted, at=accepted.at - seconds)


async def test_sync_work_a_restarted_owner_never_saw_is_sent_again_after_silence() -> None:
    """The owner accepted a contribution, was fenced off and owned the fragment again: the same
    peer, a new owner instance without it. A synchronous merge would wait for it for ever; after
    RESEND_AFTER_S without a version the learner sends it again, with the residuals from before
    the first send, and the new instance takes it."""
    from node.diloco.learner import RESEND_AFTER_S

    rig = _sync_rig()
    n = rig.owners[0].theta.numel()
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))  # accepted; the owner waits for more
    assert rig.net.stats.contributions_accepted == 1
    assert rig.owners[0].version == 0  # not merged
    rig.owners[0] = _waiting_owner(rig)  # fenced off and owning again: a new, empty instance
    _age(rig, 0, RESEND_AFTER_S - 1.0)
    assert rig.net.owners_changed() == 0  # not yet
    _age(rig, 0, 2.0)
    assert rig.net.owners_changed() == 1 and rig.net.stats.resent_after_silence == 1
    assert rig.island.in_flight[0] is None and rig.island.next_due[0] == rig.island.stats.step
    assert not any(k[0] == 0 for k in rig.net.residuals)  # back to before the first send
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))
    assert rig.net.stats.contributions_accepted == 2  # the new instance has it now


async def test_once_merges_were_seen_silent_work_is_sent_again_after_a_few_merge_times() -> None:
    """An owner whose validation declined a round drops its work and tells no one: a synchronous
    swarm stood still RESEND_AFTER_S (30 s) each time. After a merge that took 0.5 s the learner
    waits RESEND_MIN_S, not 30 s; slow merges lengthen the wait, never past RESEND_AFTER_S."""
    from node.diloco.contributing import RESEND_FACTOR, RESEND_MIN_S
    from node.diloco.learner import RESEND_AFTER_S

    rig = _sync_rig()
    sender = rig.net.sender
    n = rig.owners[0].theta.numel()
    assert sender.resend_after_s() == RESEND_AFTER_S  # no merge seen yet
    await sender.send(rig.outgoing(0, _delta(n)))
    _age(rig, 0, 0.5)
    sender.version_came(0, 1)  # merged 0.5 s after the Ack
    assert sender.resend_after_s() == RESEND_MIN_S
    rig.owners[0] = _waiting_owner(rig)  # the next round's work is dropped by the owner
    await sender.send(rig.outgoing(0, _delta(n)))
    _age(rig, 0, RESEND_MIN_S - 1.0)
    assert rig.net.owners_changed() == 0  # not yet
    _age(rig, 0, 2.0)
    assert rig.net.owners_changed() == 1 and rig.net.stats.resent_after_silence == 1
    sender._merge_waits.append(4.0)  # a slow merge: 4 x 4 s
    assert sender.resend_after_s() == RESEND_FACTOR * 4.0
    sender._merge_waits.append(60.0)
    assert sender.resend_after_s() == RESEND_AFTER_S  # capped


async def test_a_copy_the_owner_still_holds_is_refused_as_duplicate_and_changes_nothing() -> None:
    from node.diloco.learner import RESEND_AFTER_S

    rig = _sync_rig()
    n = rig.owners[0].theta.numel()
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))  # accepted; the owner waits for more
    after_first = {k: v.clone() for k, v in rig.net.residuals.items()}
    _age(rig, 0, RESEND_AFTER_S + 1.0)
    assert rig.net.owners_changed() == 1
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))  # the same owner instance: "duplicate"
    assert rig.owners[0].version == 0
    assert rig.net.stats.contributions_accepted == 1 and rig.net.stats.contributions_refused == 0
    assert rig.island.in_flight[0] is not None  # still waiting for the merge that holds the first
    assert rig.net.residuals.keys() == after_first.keys()
    assert all(torch.equal(rig.net.residuals[k], v) for k, v in after_first.items())
    assert rig.net.owners_changed() == 0  # the clock restarted with the refusal


async def test_a_decoupled_island_does_not_resend_after_silence() -> None:
    """Decoupled merges close without any one learner; its in-flight timeout (2H steps) covers it."""
    from node.diloco.learner import RESEND_AFTER_S

    rig = Rig()
    await rig.net.sender.send(rig.outgoing(0, _delta(rig.owners[0].theta.numel())))
    _age(rig, 0, 10 * RESEND_AFTER_S)
    assert rig.net.owners_changed() == 0 and rig.net.stats.resent_after_silence == 0


async def test_work_already_merged_is_not_sent_again_when_the_owner_changes() -> None:
    rig = Rig()
    current = {"id": rig.owner_key.peer_id}
    rig.net.sender.reach.owner_of = lambda p: (current["id"], OWNER_URL)
    await rig.owners[0].set_expected(1)
    await rig.net.sender.send(
        rig.outgoing(0, _delta(rig.owners[0].theta.numel()))
    )  # accepted and merged
    got = await rig.net.fetch(0, after=0, wait_s=0.0)
    assert got is not None
    rig.island.deliver(0, *got)
    rig.step()  # version 1 adopted: the work is in the global model
    current["id"] = signer(8).peer_id
    assert rig.net.owners_changed() == 0 and rig.net.stats.resent_on_owner_change == 0


async def test_a_version_is_named_by_the_digest_its_owner_signed_and_work_on_it_is_taken() -> None:
    """With the none codec a learner hashes a downloaded version once (its signature check) and
    names it by the content hash the owner signed in it (the digest of the flat state, which
    updates name their base by); the owner knows the version by it, so work measured against it
    is merged, not sent back with "resync". No (zero) residual is kept."""
    rig = Rig(codec="none")
    owner = rig.owners[0]
    await owner.set_expected(1)
    await rig.net.sender.send(rig.outgoing(0, _delta(owner.theta.numel())))
    assert owner.version == 1 and not rig.net.residuals
    got = await rig.net.fetch(0, after=0, wait_s=0.0)
    assert got is not None and got[0] == 1 and torch.equal(got[1], owner.theta)
    assert rig.net.known.digests[0][1] == owner.digest_of(1) == flat_digest(owner.theta)
    assert owner.latest.digest in owner.digests[1]
    rig.island.deliver(0, *got)
    rig.step()
    await rig.net.sender.send(rig.outgoing(0, _delta(owner.theta.numel()), base_version=1))
    assert rig.net.stats.contributions_accepted == 2 and rig.net.stats.base_mismatches == 0
    assert owner.version == 2


async def test_uploads_to_different_owners_overlap() -> None:
    """A contribution to a slow owner does not hold back one to another owner."""
    rig = Rig(codec="none")
    gate, slow_key, slow_url = asyncio.Event(), signer(2), "http://slow.test"

    class SlowPeer(MemoryOwnerPeer):
        async def handle(
            self, method: str, path: str, query: dict[str, str], body: bytes
        ) -> tuple[int, bytes]:
            await gate.wait()
            return await super().handle(method, path, query, body)

    rig.transport.add(slow_url, SlowPeer(slow_key, rig.owners, members={rig.me.peer_id}))
    rig.net.sender.reach.owner_of = lambda p: (
        (rig.owner_key.peer_id, OWNER_URL) if p == 0 else (slow_key.peer_id, slow_url)
    )
    running = asyncio.create_task(rig.net.run())
    try:
        rig.net.submit(
            rig.outgoing(1, _delta(rig.owners[1].theta.numel()))
        )  # queued first, to the slow one
        rig.net.submit(rig.outgoing(0, _delta(rig.owners[0].theta.numel())))
        async with asyncio.timeout(10):
            while rig.net.stats.contributions_accepted == 0:
                await asyncio.sleep(0.01)
        taken = [o.merger.count + o.merges_done for o in (rig.owners[0], rig.owners[1])]
        assert taken == [1, 0]
        gate.set()
        async with asyncio.timeout(10):
            await rig.net.flush()
        assert rig.net.stats.contributions_accepted == 2
        assert rig.owners[1].merger.count + rig.owners[1].merges_done == 1
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def test_accepted_work_is_forgotten_once_its_version_comes() -> None:
    """An accepted contribution is remembered (to send its work again if its owner leaves before
    merging it) until a version above its base is delivered, not until the next membership pass;
    an older version keeps it. It holds no residuals: a lost send's are dropped."""
    rig = Rig()
    rig.net.sender.reach.owner_of = lambda p: (rig.owner_key.peer_id, OWNER_URL)
    n = rig.owners[0].theta.numel()
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))  # accepted on base 0
    assert rig.net.sender._accepted_by[0].keys == tuple(k for k in rig.net.residuals if k[0] == 0)
    rig.net.sender.version_came(0, 0)  # not above its base: still unmerged
    assert 0 in rig.net.sender._accepted_by
    rig.net.sender.version_came(0, 1)
    assert 0 not in rig.net.sender._accepted_by
    current = {
        "id": signer(8).peer_id
    }  # its owner leaves now: the work was merged, nothing to send
    rig.net.sender.reach.owner_of = lambda p: (current["id"], OWNER_URL)
    assert rig.net.owners_changed() == 0


def _next_polls(rig: Rig) -> list[tuple[float, str]]:
    """Record every ``next`` long-poll the learner sends: (loop time, base URL and fragment)."""
    asked: list[tuple[float, str]] = []
    real = rig.transport.request

    async def request(method: str, url: str, **kw):  # type: ignore[no-untyped-def]
        if "/next?" in url:
            asked.append((asyncio.get_running_loop().time(), url.split("/next?")[0]))
        return await real(method, url, **kw)

    rig.transport.request = request  # type: ignore[method-assign]
    return asked


async def _run_polls(rig: Rig, seconds: float) -> None:
    polls = [asyncio.create_task(rig.net._poll_loop(p)) for p in range(len(rig.shapes))]
    await asyncio.sleep(seconds)
    for task in polls:
        task.cancel()
    await asyncio.gather(*polls, return_exceptions=True)


async def test_a_quiet_fragment_is_asked_once_per_long_wait_not_once_per_owner_check() -> None:
    """No version comes: each fragment's owner gets one ``next`` request per ``poll_wait_s``
    (25 s in a swarm, was 5 s), however often the learner reads who owns the fragment."""
    from node.diloco.learner import POLL_WAIT_S

    assert POLL_WAIT_S >= 20.0
    rig = Rig()
    rig.net.poll_wait_s, rig.net.owner_check_s = 0.6, 0.05  # the same ratio, scaled down
    asked = _next_polls(rig)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await _run_polls(rig, 1.0)
    # a late loop (a busy box) only stretches the run: at most one request per wait begun,
    # where one per owner check would be ~20
    most = int((loop.time() - began) / rig.net.poll_wait_s) + 1
    per_fragment = [sum(1 for _, u in asked if u.endswith(f"/{p}")) for p in range(2)]
    assert all(1 <= n <= most for n in per_fragment), (per_fragment, most, asked)
    assert rig.net.stats.polls_reaimed == 0


async def test_a_new_owner_is_asked_within_one_owner_check_and_its_version_delivered() -> None:
    """The view names another owner while a long-poll is parked at the old one: the poll is
    cancelled and the new owner asked within ``owner_check_s`` (not at the end of the wait), and
    the version the new owner publishes is delivered at once."""
    rig = Rig()
    # Real loop time on a possibly busy box: the bounds below are halves of the poll's wait, so
    # "within one owner check, not at the end of the wait" holds however late the loop runs.
    rig.net.poll_wait_s, rig.net.owner_check_s = 60.0, 0.1
    patience = rig.net.poll_wait_s / 2
    other_url, other_key = "http://owner2.test", signer(2)
    others = {
        p: make_owner(
            rig.plan,
            rig.shapes,
            p,
            flat_of(rig.model, rig.plan, p),
            rig.clock,
            who=other_key,
            quorum=1,
            late_policy="drop",
        )
        for p in range(len(rig.plan.fragments))
    }
    rig.transport.add(other_url, MemoryOwnerPeer(other_key, others, members={rig.me.peer_id}))
    current = {0: (rig.owner_key.peer_id, OWNER_URL), 1: (rig.owner_key.peer_id, OWNER_URL)}
    rig.net.fetcher.reach.owner_of = lambda p: current[p]
    asked = _next_polls(rig)
    loop = asyncio.get_running_loop()
    polls = [asyncio.create_task(rig.net._poll_loop(p)) for p in range(2)]

    async def until(condition: Callable[[], bool], since: float) -> float:
        while not condition() and loop.time() - since < patience:
            await asyncio.sleep(0.01)
        return loop.time() - since

    try:
        await until(lambda: len(asked) >= 2, loop.time())  # both polls parked at the old owner
        moved = loop.time()
        current[0] = (other_key.peer_id, other_url)
        await until(lambda: any(u == f"{other_url}/v1/fragments/0" for _, u in asked), moved)
        at_new = [t for t, u in asked if u == f"{other_url}/v1/fragments/0"]
        assert at_new and at_new[0] - moved < patience, (at_new, moved)
        assert rig.net.stats.polls_reaimed == 1  # fragment 1's owner did not change
        # a version at the new owner, while the poll is parked there, arrives from that poll
        await others[0].set_expected(1)
        n = others[0].theta.numel()
        published = loop.time()
        await rig.net.sender.send(rig.outgoing(0, _delta(n)))  # to the owner our view names
        assert others[0].version == 1
        took = await until(lambda: rig.net.received[0] >= 1, published)
        assert rig.net.received[0] == 1 and took < patience, took
        # the old owner got one `next` for fragment 0, the new one a poll per version
        assert sum(1 for _, u in asked if u == f"{OWNER_URL}/v1/fragments/0") == 1
    finally:
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)


async def test_a_poll_cancelled_as_its_request_fails_leaves_no_error_unretrieved() -> None:
    """The learner is stopped (its task cancelled) in the very loop turn its request fails,
    as a peer stopping at a swarm's end does while its connections close: the request's error
    is taken all the same (a 128-peer run's end logged "Task exception was never retrieved")."""
    import gc

    from protocol.errors import RemoteProtocolError

    rig = Rig()
    rig.net.poll_wait_s, rig.net.owner_check_s = 20.0, 5.0
    loop = asyncio.get_running_loop()
    logged: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    outer: list[asyncio.Task[object]] = []

    async def fetch(p: int, **kw: object) -> tuple[int, torch.Tensor] | None:
        await asyncio.sleep(0.05)
        outer[0].cancel()  # the stop comes in the same turn as the failure
        raise RemoteProtocolError("server disconnected")

    rig.net.fetcher.reach.owner_of = lambda p: (rig.owner_key.peer_id, OWNER_URL)
    rig.net.fetcher.fetch = fetch  # type: ignore[method-assign]
    try:
        outer.append(asyncio.create_task(rig.net._poll(0, 0)))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(outer[0], 2.0)
        outer.clear()
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)
        assert not logged, logged
    finally:
        loop.set_exception_handler(None)


async def test_a_reaimed_poll_that_ends_another_way_as_it_is_cancelled_loses_nothing() -> None:
    """A request cancelled as the view names a new owner may end otherwise: its connection's
    close raises, or its version arrives. The error is taken (asyncio logs no exception never
    retrieved: a 128-peer run logged seven) and the version is returned, not dropped."""
    import gc

    from protocol.errors import RemoteProtocolError

    rig = Rig()
    rig.net.poll_wait_s, rig.net.owner_check_s = 20.0, 0.05
    loop = asyncio.get_running_loop()
    logged: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    version = (1, torch.zeros(3))

    def ending(how: str):  # type: ignore[no-untyped-def]
        async def fetch(p: int, **kw: object) -> tuple[int, torch.Tensor] | None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if how == "raises":
                    raise RemoteProtocolError("the connection closed as it was cancelled") from None
                return version
            return None

        return fetch

    owner = [(rig.owner_key.peer_id, OWNER_URL)]
    rig.net.fetcher.reach.owner_of = lambda p: owner[0]
    try:
        for how, expected in (("raises", None), ("returns", version)):
            owner[0] = (rig.owner_key.peer_id, OWNER_URL)
            rig.net.fetcher.fetch = ending(how)  # type: ignore[method-assign]
            task = asyncio.create_task(rig.net._poll(0, 0))
            await asyncio.sleep(0.1)
            owner[0] = (signer(2).peer_id, "http://owner2.test")
            got = await asyncio.wait_for(task, 2.0)
            assert got is expected, (how, got)
        del task
        gc.collect()
        await asyncio.sleep(0)
        assert not logged, logged
        assert rig.net.stats.polls_reaimed == 2
    finally:
        loop.set_exception_handler(None)
