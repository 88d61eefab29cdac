"""A candidate that validation declines: its senders are told, and a learner goes on at once.

In sync mode a declined candidate publishes no version, and the learners whose work it held used
to wait for one (sending the same refused work again every few seconds). Now the owner answers
their next long-poll with ``Declined`` (205 on the wire), and the island drops that work and
goes on from the version it holds. Real owners with a real (callable) validation loss, reached
through ``MemoryTransport``, sealed both ways; the owner's clock is fake.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from node.diloco.fetching import RoundDeclined
from node.diloco.island import IslandConfig, Outgoing
from node.diloco.owner import Declined, FragmentOwner
from node.diloco.validation import CallableEvaluator, OwnerValidation
from protocol.diloco.validation import ValidationConfig
from tests.node.diloco.test_learner import H, Rig, _delta
from tests.node.fakes import contribution, flat_of, make_owner, signer


def _validating_owner(rig: Rig, quorum: int = 1) -> FragmentOwner:
    """Fragment 0's owner whose validation loss is the distance of fragment 0 from where it
    started: any work on it raises the loss, so every candidate is declined."""
    start = {n: p.detach().clone() for n, p in rig.model.named_parameters()}
    names = rig.plan.fragments[0].names

    def validate(m: torch.nn.Module) -> float:
        params = dict(m.named_parameters())
        return float(sum(((params[n] - start[n]) ** 2).sum() for n in names))

    held = [flat_of(rig.model, rig.plan, p) for p in range(len(rig.plan.fragments))]
    evaluator = CallableEvaluator(rig.model, rig.plan, lambda: held, validate)
    validation = OwnerValidation(evaluator, ValidationConfig(windows=4), rng=random.Random(0))
    return make_owner(
        rig.plan,
        rig.shapes,
        0,
        held[0],
        rig.clock,
        who=rig.owner_key,
        quorum=quorum,
        late_policy="drop",
        validation=validation,
    )


async def test_the_senders_of_declined_work_are_told_once_at_their_next_long_poll() -> None:
    rig = Rig()
    owner = _validating_owner(rig, quorum=2)
    a, b = signer(7).peer_id, signer(8).peer_id
    n = owner.theta.numel()
    shapes = rig.shapes[0]
    await owner.set_expected(2)  # the round closes once both are in
    waiting = asyncio.create_task(owner.wait_after(0, 30.0, asker=a))  # a long-poll open now
    await asyncio.sleep(0)
    await owner.contribute(a, contribution(_delta(n), shapes, owner=owner))
    await owner.contribute(b, contribution(_delta(n) * 0.5, shapes, owner=owner))
    assert owner.version == 0 and owner.counts.rejected == 1  # never published
    assert await asyncio.wait_for(waiting, 5.0) == Declined(0)  # woken at once
    assert await owner.wait_after(0, 0.0, asker=a) is None  # told once
    assert await owner.wait_after(0, 0.0, asker=b) == Declined(0)
    assert await owner.wait_after(0, 0.0) is None  # no asker: nothing to tell
    await owner.contribute(a, contribution(_delta(n) * 0.1, shapes, owner=owner))
    assert await owner.wait_after(0, 0.0, asker=a) is None  # new work replaced the declined one


async def test_a_learner_drops_declined_work_and_goes_on_from_the_version_it_held() -> None:
    rig = Rig()
    rig.owners[0] = _validating_owner(rig)
    await rig.owners[0].set_expected(1)
    rig.peer.asker = rig.me.peer_id  # the GETs are ours (node.peer.serving: the admitted signer)
    shipped: list[Outgoing] = []
    rig.island._submit = shipped.append  # type: ignore[method-assign]
    while not any(out.fragment == 0 for out in shipped):
        rig.step()
    out = next(out for out in shipped if out.fragment == 0)
    theta_shipped, base = flat_of(rig.model, rig.plan, 0), rig.island.global_flat[0].clone()
    rig.step()  # work after the shipment: kept
    await rig.net.sender.send(out)
    assert rig.net.stats.contributions_accepted == 1 and any(k[0] == 0 for k in rig.net.residuals)
    assert rig.owners[0].version == 0 and rig.owners[0].counts.rejected == 1

    with pytest.raises(RoundDeclined) as declined:
        await rig.net.fetcher.fetch(0, after=0, wait_s=0.0)
    assert declined.value.base == 0
    rig.net.sender.declined(0, declined.value.base)
    assert rig.net.stats.declined == 1
    assert not any(k[0] == 0 for k in rig.net.residuals)  # the send's quantisation error goes too
    assert not rig.island._waiting([0])  # a synchronous step stops waiting for the version

    theta_now = flat_of(rig.model, rig.plan, 0)
    rig.island.adopt_pending()
    assert rig.island.stats.declined == 1 and rig.island.in_flight[0] is None
    assert rig.island.versions[0] == 0 and torch.equal(rig.island.global_flat[0], base)
    # the refused work is gone, the step trained since it shipped is kept
    expected = base + (theta_now - theta_shipped)
    assert torch.allclose(flat_of(rig.model, rig.plan, 0), expected, atol=1e-6)
    assert rig.island.c_steps[0] == 1 and rig.island.next_due[0] == rig.island.stats.step + H
    rig.net.sender.declined(0, 0)  # a second decline of the same work changes nothing
    assert rig.net.stats.declined == 1


async def test_the_poll_loop_passes_a_decline_on() -> None:
    rig = Rig()
    rig.owners[0] = _validating_owner(rig)
    await rig.owners[0].set_expected(1)
    rig.peer.asker = rig.me.peer_id
    n = rig.owners[0].theta.numel()
    await rig.net.sender.send(rig.outgoing(0, _delta(n)))
    polling = asyncio.create_task(rig.net._poll_loop(0))
    try:
        for _ in range(500):
            if rig.net.stats.declined:
                break
            await asyncio.sleep(0.01)
    finally:
        polling.cancel()
    assert rig.net.stats.declined == 1


def test_a_synchronous_step_goes_on_at_once_when_its_work_is_declined() -> None:
    """The step that shipped waits for the merged versions; a decline of one fragment's work
    ends its wait for that fragment (not ``wait_timeout_s``), and the step adopts the rest."""
    rig = Rig()
    rig.island.cfg = IslandConfig(inner_steps=H, wait_for_merge=True, wait_timeout_s=60.0)
    shipped: list[Outgoing] = []
    rig.island._submit = shipped.append  # type: ignore[method-assign]

    def owner_side() -> None:  # fragment 0 is declined, the others merged
        while not shipped:
            time.sleep(0.01)
        for out in list(shipped):
            if out.fragment == 0:
                rig.island.declined(0, out.base_version)
            else:
                rig.island.deliver(out.fragment, 1, rig.island.global_flat[out.fragment] + 0.25)

    threading.Thread(target=owner_side, daemon=True).start()
    t0 = time.monotonic()
    while not shipped:
        rig.step()
    assert time.monotonic() - t0 < 30.0  # far from the 60 s timeout, even on a busy box
    assert rig.island.stats.declined == 1 and all(sent is None for sent in rig.island.in_flight)
    assert rig.island.versions[0] == 0 and rig.island.versions[1:] == [1] * (
        len(rig.plan.fragments) - 1
    )
