"""An owner fenced under load (issue 52, 32 peers at load ~48): "our member record was last stored
19.9 s ago, past its 20 s TTL less 2 s" while every other member held a fresh copy of it.

A store waited for its slowest target before the lease moved, and the next store began only
once it had returned: one slow target made each store take ~10 s and the record's age, as the
owner measured it, twice that. Now the lease runs from the first node that takes the record,
from before it was signed, and a store begins every ``renew_s`` whether or not the last returned.

The tests of the schedule failed before the fix: a store that hung held every renewal back and
the lease never moved (``Presence.record_loop`` awaited each store in turn, and noted the time
only once the store returned)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from aiohttp import web

from node.dht.kademlia import DHTNode
from node.dht.membership import MemberRecord
from node.dht.route import DHTRouter
from node.peer.renewal import MAX_IN_FLIGHT, RecordRenewal
from node.wire.transport import Transport
from protocol.ids import key_id
from tests.node.fakes import FakeClock

pytestmark = pytest.mark.timeout(30)

RECORD = MemberRecord(
    url="http://127.0.0.1:1",
    roles=("learner", "owner"),
    reachable=True,
    manifest="m",
    learning=True,
)


class Targets:
    """The nodes a store goes to: the first takes the record at once, the slowest answers only
    when ``release`` is called (a starved peer); the clock moves ``took_s`` before the first."""

    def __init__(self, clock: FakeClock, *, took_s: float = 0.0, takes: bool = True) -> None:
        self.clock, self.took_s, self.takes = clock, took_s, takes
        self.slow = asyncio.Event()
        self.begun: list[float] = []

    async def publish(self, record: MemberRecord, on_held: Callable[[], None]) -> int:
        self.begun.append(self.clock())
        self.clock.advance(self.took_s)
        if self.takes:
            on_held()
        await self.slow.wait()
        return int(self.takes)

    def release(self) -> None:
        self.slow.set()


async def _started(renewal: RecordRenewal, targets: Targets) -> asyncio.Task[bool]:
    record = renewal.due(RECORD)
    assert record is not None
    task = asyncio.ensure_future(renewal.store(record, targets.publish))
    await asyncio.sleep(0)  # the store runs up to its slow target
    return task


async def test_the_lease_runs_from_the_first_node_that_takes_the_record_from_before_it_was_signed() -> (
    None
):
    clock = FakeClock()
    renewal = RecordRenewal(20.0, clock)
    targets = Targets(clock, took_s=1.5)  # the first node answers 1.5 s after the store began
    began = clock()
    task = await _started(renewal, targets)
    assert renewal.stored_at == began  # not when it answered, nor when the slowest will
    targets.release()
    assert await task


async def test_a_store_that_no_node_takes_does_not_move_the_lease() -> None:
    """A partitioned or hung owner: its lease ages from its last stored record, and it stops
    publishing (ttl less the margin) before anybody's copy of that record expires."""
    clock = FakeClock()
    renewal = RecordRenewal(20.0, clock)
    targets = Targets(clock)
    task = await _started(renewal, targets)
    targets.release()
    assert await task
    stored = renewal.stored_at
    clock.advance(renewal.renew_s)
    nobody = Targets(clock, takes=False)
    task = await _started(renewal, nobody)
    nobody.release()
    assert not await task
    assert renewal.stored_at == stored


async def test_a_slow_store_holds_no_renewal_back() -> None:
    clock = FakeClock()
    renewal = RecordRenewal(20.0, clock)
    assert renewal.renew_s == pytest.approx(6.0)  # ttl / 3, at most REPUBLISH_S
    targets = Targets(clock)
    first = await _started(renewal, targets)  # its slowest target does not answer
    assert renewal.due(RECORD) is None  # nothing changed, and it began under renew_s ago
    clock.advance(renewal.renew_s)
    second = await _started(renewal, targets)  # due on time, the first still running
    assert renewal.stored_at == clock()  # the lease moved with the second's first answer
    clock.advance(renewal.renew_s)
    assert renewal.in_flight == MAX_IN_FLIGHT and renewal.due(RECORD) is None  # bounded
    targets.release()
    assert await first and await second
    assert renewal.in_flight == 0 and renewal.due(RECORD) is not None


async def test_a_store_is_cut_at_its_deadline_and_keeps_what_was_taken() -> None:
    renewal = RecordRenewal(0.3)  # renew_s 0.1 s: the deadline (0.2 s) passes in real time
    targets = Targets(FakeClock())
    assert await renewal.store(RECORD, targets.publish)  # the first node took it
    assert renewal.cut_short == 1 and renewal.in_flight == 0


async def test_our_record_is_renewed_while_a_store_hangs_on_a_slow_target(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``Presence.record_loop`` as it runs: every store hangs on one target that never answers;
    the first node of each takes the record at once."""
    import node.peer.presence as presence
    from tests.node.test_peer import _node

    monkeypatch.setattr(presence, "RECORD_CHECK_S", 0.05)

    node, membership = _node()
    membership.ttl_s = 0.6  # renew_s 0.2 s, each store cut at 0.4 s
    begun: list[float] = []
    never = asyncio.Event()

    async def publish(record: MemberRecord, on_held: Callable[[], None]) -> int:
        begun.append(asyncio.get_running_loop().time())
        on_held()
        await never.wait()
        return 1

    membership.publish = publish  # type: ignore[attr-defined]
    loop = asyncio.ensure_future(node.presence.record_loop())
    try:
        async with asyncio.timeout(20):
            while len(begun) < 4:
                await asyncio.sleep(0.05)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    renewal = node.presence.renewal
    assert renewal is not None and node.presence.record_published_at is not None
    assert renewal.cut_short >= 2  # stores that hung were cut, and did not hold the next back


class _HungRouter(DHTRouter):
    """DHT nodes whose requests are answered only once ``answer`` is set: a starved peer."""

    def __init__(self, transport: Transport) -> None:
        super().__init__(transport, prefix="/v1/hung")
        self.answer = asyncio.Event()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        await self.answer.wait()
        return await super()._serve(request)


async def test_a_store_tells_of_each_node_that_takes_the_record_before_the_slowest_answers() -> (
    None
):
    """Over real HTTP: eight nodes answer at once, one is hung. The lease must not wait for it."""
    from tests.node.dht.test_dht import FAST, Net, joined
    from tests.node.dht.test_dht import signer as dht_signer

    transport = Transport()
    net = Net(transport, DHTRouter(transport))
    hung = _HungRouter(transport)
    await transport.start()
    try:
        nodes = await joined(net, 8)
        slow = DHTNode(dht_signer(99), transport, hung.url("99"), FAST)
        hung.mount(slow, "99")
        await slow.start()
        net.nodes.append(slow)
        hung.answer.set()  # it answers while it joins and the first store's lookup
        assert await slow.bootstrap([nodes[0].me.address]) == 1
        publisher, key = nodes[1], key_id("swarm/roster")
        first = await publisher.store(key, b"record", 60)
        assert slow.records.get(key, time.time())  # the hung node is one of the store's targets
        hung.answer.clear()  # then its loop starves
        held: list[int] = []
        store = asyncio.ensure_future(
            publisher.store(key, b"record", 60, on_held=lambda: held.append(1))
        )
        async with asyncio.timeout(FAST.request_timeout_s * 2):
            while len(held) < first - 1:  # every target but the hung one
                await asyncio.sleep(0.01)
        assert not store.done()  # still waiting on the hung node
        hung.answer.set()
        assert await store == len(held) == first  # the hung node took it too, late
    finally:
        for node in net.nodes:
            await node.close()
        await transport.close()
