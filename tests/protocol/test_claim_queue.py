"""Claimed addresses wait for our ping: bounded, fair between IPs, paced, deduplicated."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.dht.routing import ClaimQueue, RoutingTable
from protocol.errors import LocalProtocolError
from protocol.ids import key_id
from protocol.wire.messages import PeerInfo


def claim(i: int, address: str | None = None) -> PeerInfo:
    return PeerInfo(
        peer_id=key_id(f"claimer {i}"), address=address or f"http://10.0.0.{i % 250}:{1000 + i}"
    )


def drain(queue: ClaimQueue, now: float) -> list[PeerInfo]:
    out = []
    while (c := queue.next(now)) is not None:
        out.append(c)
    return out


def test_a_claim_is_pinged_once_and_a_dead_address_is_not_pinged_again_soon() -> None:
    q = ClaimQueue(rate=10, burst=5, max_in_flight=2, retry_after_s=60)
    dead = "http://127.0.0.1:1"
    assert q.offer(claim(1, dead), "203.0.113.9", 0.0).queued
    again = q.offer(claim(2, dead), "203.0.113.9", 0.0)  # another key naming the same address
    assert again.kind == "ignored" and "already waiting" in again.reason
    assert q.offer(claim(1, dead), "203.0.113.9", 0.0).reason == "already waiting; address updated"
    assert q.offer(PeerInfo(peer_id=key_id("nat")), "10.0.0.1", 0.0).kind == "ignored"
    assert drain(q, 0.0) == [claim(1, dead)]
    assert q.offer(claim(1, dead), "203.0.113.9", 0.0).reason == "a ping of this peer is in flight"
    q.done(claim(1, dead), False, 1.0)
    late = q.offer(claim(3, dead), "203.0.113.9", 30.0)
    assert late.kind == "ignored" and "did not answer 29s ago" in late.reason
    assert q.offer(claim(3, dead), "203.0.113.9", 61.0).queued  # retry_after_s has passed
    with pytest.raises(LocalProtocolError):
        q.done(claim(4), True, 61.0)  # never handed out


def test_pings_are_paced_by_tokens_and_slots() -> None:
    q = ClaimQueue(rate=2, burst=3, max_in_flight=2)
    for i in range(6):
        assert q.offer(claim(i), "10.0.0.1", 0.0).queued
    first = drain(q, 0.0)
    assert len(first) == 2 and q.in_flight == 2 and q.wait_s(0.0) is None  # no slot free
    for c in first:
        q.done(c, True, 0.0)
    assert q.wait_s(0.0) == 0.0 and len(drain(q, 0.0)) == 1  # the third token of the burst
    assert q.wait_s(0.0) == pytest.approx(0.5)  # then 2 a second
    assert drain(q, 0.25) == [] and len(drain(q, 0.5)) == 1
    assert q.pending == 2 and q.in_flight == 2


def test_a_full_queue_is_shared_fairly_between_ips() -> None:
    q = ClaimQueue(max_pending=8, burst=100, max_in_flight=100)
    for i in range(20):  # one IP floods first
        q.offer(claim(i), "203.0.113.9", 0.0)
    assert q.pending == 8
    results = [q.offer(claim(100 + i), f"10.0.1.{i}", 0.0) for i in range(3)]
    assert all(r.queued and "replaced" in r.reason for r in results)  # each honest IP gets in
    dropped = q.offer(claim(50), "203.0.113.9", 0.0)
    assert dropped.kind == "dropped" and dropped.reason == "8/8 wait"
    queued = {c.peer_id for c in drain(q, 0.0)}
    assert len(queued) == 8 and {claim(100 + i).peer_id for i in range(3)} <= queued


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.booleans(), st.floats(0, 2)),
                max_size=200))  # fmt: skip
def test_the_queue_stays_bounded_and_never_pings_faster_than_its_budget(
    ops: list[tuple[int, int, bool, float]],
) -> None:
    q = ClaimQueue(max_pending=5, rate=1, burst=3, max_in_flight=2, retry_after_s=10)
    now, handed, out = 0.0, 0, []
    for who, ip, answer, dt in ops:
        now += dt
        q.offer(claim(who, f"http://10.0.0.{who % 7}:1"), f"10.0.9.{ip}", now)
        got = drain(q, now)
        handed += len(got)
        out.extend(got)
        assert q.pending <= 5 and q.in_flight <= 2
        if out and answer:
            q.done(out.pop(0), who % 2 == 0, now)
    assert handed <= 3 + now * 1 + 1e-9


def test_holds_matches_id_and_address_in_buckets_and_cache() -> None:
    table = RoutingTable(bytes(32), k=1, replacement_cache=1)
    a, b = PeerInfo(peer_id=b"\x80" + bytes(31), address="http://a:1"), PeerInfo(
        peer_id=b"\x81" + bytes(31), address="http://b:1")  # fmt: skip
    table.on_seen(a, 0.0)
    table.on_seen(b, 0.0)  # bucket full: b waits in the cache
    assert table.holds(a) and table.holds(b)
    assert not table.holds(PeerInfo(peer_id=a.peer_id, address="http://elsewhere:1"))
    assert not table.holds(PeerInfo(peer_id=bytes(32), address="http://me:1"))
