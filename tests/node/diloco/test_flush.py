"""The end-of-run flush: fragments ship one after another within the island's ship window, and
the flush stops waiting for a version that a declined round never publishes.

Real ``IslandNet`` and ``FragmentOwner`` objects over ``MemoryTransport`` (no sockets); the flush
runs on a thread as it does at the end of a run. Nothing is timed: the window is checked through
the buffers themselves (each contribution's Δ, released once compressed, and the contributions
an owner has not answered yet), while gated owners hold the answers back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import threading
import time

import pytest
import torch

from node.diloco.contributing import RESEND_AFTER_S
from node.diloco.island import Island, IslandConfig, Outgoing
from node.diloco.island_config import SHIP_WINDOW
from node.diloco.learner import IslandNet, LearnerNetConfig, OwnerLinks, Reach
from node.diloco.ship_window import ShipWindow
from protocol.wire.signing import Signer
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

FRAGMENTS = 4


# --- the window alone -------------------------------------------------------------------------
def test_a_window_opens_for_the_next_fragment_once_delta_is_compressed_and_below_its_depth() -> (
    None
):
    window = ShipWindow(2)
    first = window.open(0)
    assert not window.has_room()  # its Δ is not compressed yet
    first.compressed()
    assert window.has_room() and window.held == 0 and window.open_count == 1
    second = window.open(1)
    second.compressed()
    assert not window.has_room()  # two open: the depth
    first.close()
    first.close()  # idempotent
    assert window.has_room() and window.open_count == 1
    assert window.peak_open == 2 and window.peak_held == 1
    del second
    gc.collect()
    assert window.open_count == 0  # a handoff nothing closed is closed when it is collected


def test_waiting_for_room_ends_at_the_deadline_or_when_a_handoff_closes() -> None:
    window = ShipWindow(1)
    handoff = window.open(0)
    assert not window.wait_for_room(time.monotonic())  # past the deadline: no room, no wait
    closer = threading.Thread(target=handoff.close)
    closer.start()
    assert window.wait_for_room(time.monotonic() + 30.0)
    closer.join()
    with pytest.raises(ValueError, match="never opens"):
        ShipWindow(0)


# --- a flush against gated owners -------------------------------------------------------------
class GatedPeer(MemoryOwnerPeer):
    """An owner peer that reads a contribution and answers it only once ``gate`` is set."""

    gate: asyncio.Event
    arrived: int = 0
    answered: int = 0

    async def handle(
        self, method: str, path: str, query: dict[str, str], body: bytes
    ) -> tuple[int, bytes]:
        if method != "POST":
            return await super().handle(method, path, query, body)
        self.arrived += 1
        await self.gate.wait()
        reply = await super().handle(method, path, query, body)
        self.answered += 1
        return reply


class FlushRig:
    """An island of ``FRAGMENTS`` fragments, each owned by its own gated peer (uploads to
    different owners overlap, so only the window bounds them), and its ``IslandNet``."""

    def __init__(self, *, window: int, quorum: int = 1) -> None:
        self.model = tiny_model()
        self.plan = tiny_plan(self.model, FRAGMENTS)
        shapes = shapes_of(self.model, self.plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.me = signer(7)
        self.gate = asyncio.Event()
        self.transport = MemoryTransport()
        self.peers: list[GatedPeer] = []
        keys: list[Signer] = []
        for p in range(FRAGMENTS):
            key = signer(20 + p)
            owner = make_owner(
                self.plan,
                shapes,
                p,
                flat_of(self.model, self.plan, p),
                FakeClock(),
                who=key,
                quorum=quorum,
                late_policy="drop",
            )
            peer = GatedPeer(key, {p: owner}, members={self.me.peer_id})
            peer.gate = self.gate
            self.transport.add(f"http://owner{p}.test", peer)
            self.peers.append(peer)
            keys.append(key)
        self.submitted: list[Outgoing] = []
        # at each submit: Δs of earlier contributions still held, and those not yet answered
        self.seen_at_submit: list[tuple[int, int]] = []
        cfg = IslandConfig(inner_steps=10**6, ship_window=window)  # nothing due while training
        self.island = Island(self.model, self.opt, self.plan, self._submit, cfg)
        self.island.next_due = [10**9] * FRAGMENTS  # fragment 0's offset is step 1 whatever H
        self.net = IslandNet(
            self.island,
            LearnerNetConfig(swarm=SWARM, shapes=shapes, codec="int8"),
            OwnerLinks(
                self.me,
                Reach(
                    self.transport, owner_of=lambda p: (keys[p].peer_id, f"http://owner{p}.test")
                ),
            ),
        )

    def _submit(self, out: Outgoing) -> None:
        held = sum(o.delta.numel() > 0 for o in self.submitted)
        unanswered = len(self.submitted) - sum(peer.answered for peer in self.peers)
        self.seen_at_submit.append((held, unanswered))
        self.submitted.append(out)
        self.net.submit(out)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.model(torch.randn(3, 4)).pow(2).sum().backward()
            self.island.tokens(12)
            self.opt.step()
            self.opt.zero_grad()


async def _until(predicate: object, what: str) -> None:
    async with asyncio.timeout(20):  # a bound on a broken test, not a timing
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.005)
    assert predicate(), what  # type: ignore[operator]


@contextlib.asynccontextmanager
async def _running(net: IslandNet):  # type: ignore[no-untyped-def]
    task = asyncio.create_task(net.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_flush_ships_its_fragments_one_after_another_within_the_window() -> None:
    """Every fragment is due at the end of the run. Held at gated owners, the flush has exactly
    the window's depth of contributions out, their Δ already released; it ships the others as
    answers come. Before each submit no earlier Δ was still held and fewer than the depth were
    unanswered: at most one fragment's Δ and two fragments' residuals and bodies alive."""
    rig = FlushRig(window=SHIP_WINDOW)
    rig.train(3)
    async with _running(rig.net):
        flushing = asyncio.create_task(asyncio.to_thread(rig.island.flush, 30.0))
        await _until(lambda: sum(p.arrived for p in rig.peers) == SHIP_WINDOW, "two uploads")
        window = rig.island.window
        assert window is not None
        # the flush waits: two open, both compressed, the rest not snapshotted yet
        assert len(rig.submitted) == SHIP_WINDOW and window.open_count == SHIP_WINDOW
        assert window.held == 0 and all(o.delta.numel() == 0 for o in rig.submitted)
        assert not flushing.done()
        rig.gate.set()
        async with asyncio.timeout(20):
            assert await flushing == FRAGMENTS
        await _until(lambda: window.open_count == 0, "every contribution answered")
    assert sorted(o.fragment for o in rig.submitted) == list(range(FRAGMENTS))
    assert all(o.last for o in rig.submitted)
    assert rig.net.stats.contributions_accepted == FRAGMENTS
    assert [held for held, _ in rig.seen_at_submit] == [0] * FRAGMENTS
    assert max(unanswered for _, unanswered in rig.seen_at_submit) == SHIP_WINDOW - 1
    assert window.peak_open == SHIP_WINDOW and window.peak_held == 1


async def test_without_a_window_a_flush_has_every_fragment_out_at_once() -> None:
    """The same flush unbounded (a ``submit`` that reports no handoffs): all four out together,
    as the 124M run's end-of-run peak had them."""
    rig = FlushRig(window=0)
    rig.train(3)
    async with _running(rig.net):
        flushing = asyncio.create_task(asyncio.to_thread(rig.island.flush, 30.0))
        await _until(lambda: sum(p.arrived for p in rig.peers) == FRAGMENTS, "four uploads")
        assert len(rig.submitted) == FRAGMENTS and rig.island.window is None
        rig.gate.set()
        async with asyncio.timeout(20):
            assert await flushing == FRAGMENTS


# --- a round that will not come ---------------------------------------------------------------
def _age(net: IslandNet, p: int, seconds: float) -> None:
    """Move the Ack of fragment ``p``'s contribution ``seconds`` into the past."""
    accepted = net.sender._accepted_by[p]
    net.sender._accepted_by[p] = dataclasses.replace(accepted, at=accepted.at - seconds)


async def test_a_flush_stops_waiting_for_a_version_a_declined_round_never_publishes() -> None:
    """A decoupled island's fragment is in flight, accepted into a round its owner will never
    publish (declined by validation; here an owner waiting for a quorum that never comes). The
    flush waited its whole 30 s for that version. Flushing, the learner sends silent work again
    after ``resend_after_s`` (as a synchronous island always does): the fragment ships at once,
    marked last, measured from the base it holds, so it covers every step since."""
    rig = FlushRig(window=SHIP_WINDOW, quorum=2)
    rig.gate.set()
    rig.island.next_due[0] = 3
    rig.train(3)  # fragment 0 ships at step 3
    async with _running(rig.net):
        await _until(lambda: 0 in rig.net.sender._accepted_by, "fragment 0 accepted")
        _age(rig.net, 0, RESEND_AFTER_S + 1.0)
        assert rig.net.owners_changed() == 0  # training, decoupled: silence is not counted
        rig.train(2)
        flushing = asyncio.create_task(asyncio.to_thread(rig.island.flush, 3600.0))
        await _until(lambda: rig.island.flushing, "the flush started")
        assert rig.net.owners_changed() == 1  # a membership pass during the flush
        async with asyncio.timeout(20):  # not the flush's 3600 s
            shipped = await flushing
        await rig.net.flush()
    assert rig.net.stats.resent_after_silence == 1 and not rig.island.flushing
    zero = [o for o in rig.submitted if o.fragment == 0]
    assert len(zero) == 2 and zero[-1].last and zero[-1].base_version == 0
    assert zero[-1].steps == 5  # all five steps: the declined round's and those since
    assert shipped == FRAGMENTS  # fragment 0 again, and the three never sent


def test_the_flush_keeps_no_copy_of_what_it_ships_and_a_version_then_is_adopted_whole() -> None:
    """Training is over: a last contribution's θ_p stays as it shipped, so the island keeps no
    copy of it (all of the model's fp32 bytes when every fragment ships at the end). Δ has the
    bits Θ − θ_p had from a copy, and a version arriving afterwards is adopted exactly."""
    model = tiny_model()
    plan = tiny_plan(model, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sent: list[Outgoing] = []
    island = Island(model, opt, plan, sent.append, IslandConfig(inner_steps=10**6, rebase=True))
    island.next_due = [10**9, 10**9]
    for _ in range(3):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        island.tokens(12)
        opt.step()
        opt.zero_grad()
    assert island.flush(timeout_s=0.0) == 2
    for out in sent:
        theta = flat_of(model, plan, out.fragment)
        assert torch.equal(out.delta, torch.sub(island.global_flat[out.fragment], theta))
        assert island._shipped[out.fragment] == (None, 3, 36)  # steps and tokens, no tensor
    merged = island.global_flat[0] - 0.01
    island.deliver(0, 1, merged)
    island.adopt_pending()
    assert torch.equal(flat_of(model, plan, 0), merged)
    assert island.versions[0] == 1 and island.c_steps[0] == 0 and island._shipped[0] is None
