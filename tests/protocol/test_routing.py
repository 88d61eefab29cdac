"""Kademlia routing table: ping-candidate flow, replacement cache, closest(), bucket bounds."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.dht.routing import PingCandidate, RoutingTable
from protocol.errors import LocalProtocolError
from protocol.ids import xor_distance
from protocol.wire.messages import PeerInfo

OWN = bytes(32)


def contact(peer_id: bytes, port: int = 1) -> PeerInfo:
    return PeerInfo(peer_id=peer_id, address=f"https://10.0.0.1:{port}")


def ids_in_bucket(table: RoutingTable, i: int, n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out: list[bytes] = []
    while len(out) < n:
        pid = table.random_id_in_bucket(i, rng)
        if pid not in out:
            out.append(pid)
    return out


def full_table(k: int = 3, cache: int = 2) -> tuple[RoutingTable, list[bytes]]:
    table = RoutingTable(OWN, k=k, replacement_cache=cache)
    ids = ids_in_bucket(table, 0, k + 4)
    for t, pid in enumerate(ids[:k]):
        assert table.on_seen(contact(pid), now=float(t)) is None
    return table, ids


# ── ping-candidate flow ─────────────────────────────────────────────────────────────────────


def test_full_bucket_asks_to_ping_oldest_once() -> None:
    table, ids = full_table()
    action = table.on_seen(contact(ids[3]), now=10.0)
    assert action == PingCandidate(oldest=contact(ids[0]), candidate=contact(ids[3]))
    assert ids[3] not in table and table.cached(ids[3])
    # a second newcomer while the ping is out waits in the cache; no second ping
    assert table.on_seen(contact(ids[4]), now=11.0) is None
    assert table.cached(ids[4]) and len(table) == 3


def test_live_oldest_is_kept_and_newcomer_stays_cached() -> None:
    table, ids = full_table()
    table.on_seen(contact(ids[3]), now=10.0)
    assert table.on_ping_result(ids[0], alive=True, now=12.0) is None
    assert [c.peer_id for c in table.contacts()] == [ids[1], ids[2], ids[0]]  # oldest moved to tail
    assert table.cached(ids[3]) and ids[3] not in table
    # the next newcomer now asks to ping the new oldest
    action = table.on_seen(contact(ids[4]), now=13.0)
    assert isinstance(action, PingCandidate) and action.oldest.peer_id == ids[1]


def test_dead_oldest_is_evicted_and_freshest_cached_promoted() -> None:
    table, ids = full_table()
    table.on_seen(contact(ids[3]), now=10.0)
    table.on_seen(contact(ids[4]), now=11.0)
    promoted = table.on_ping_result(ids[0], alive=False, now=12.0)
    assert promoted == contact(ids[4])
    assert ids[0] not in table and ids[4] in table and table.cached(ids[3])
    assert len(table) == 3


def test_replacement_cache_is_bounded_and_drops_oldest() -> None:
    table, ids = full_table(k=3, cache=2)
    for t, pid in enumerate(ids[3:6]):
        table.on_seen(contact(pid), now=10.0 + t)
    assert not table.cached(ids[3]) and table.cached(ids[4]) and table.cached(ids[5])


def test_zero_replacement_cache_evicts_without_promotion() -> None:
    table, ids = full_table(k=2, cache=0)
    action = table.on_seen(contact(ids[2]), now=5.0)
    assert isinstance(action, PingCandidate) and not table.cached(ids[2])
    assert table.on_ping_result(ids[0], alive=False, now=6.0) is None
    assert len(table) == 1


def test_unrequested_ping_result_is_a_local_error() -> None:
    table, ids = full_table()
    with pytest.raises(LocalProtocolError, match="no ping"):
        table.on_ping_result(ids[0], alive=True, now=1.0)


def test_ping_result_after_peer_already_removed() -> None:
    table, ids = full_table(k=3)
    table.on_seen(contact(ids[3]), now=10.0)
    for _ in range(3):
        table.on_failed(ids[0], now=11.0)
    assert ids[0] not in table and ids[3] in table  # promoted by on_failed
    assert table.on_ping_result(ids[0], alive=False, now=12.0) is None


# ── failures, updates, own id ───────────────────────────────────────────────────────────────


def test_failures_evict_after_max_and_seen_resets_count() -> None:
    table, ids = full_table(k=3)
    table.on_seen(contact(ids[3]), now=10.0)  # cached
    table.on_failed(ids[1], now=11.0)
    table.on_failed(ids[1], now=12.0)
    table.on_seen(contact(ids[1]), now=13.0)  # answered again: count resets
    table.on_failed(ids[1], now=14.0)
    table.on_failed(ids[1], now=15.0)
    assert ids[1] in table
    assert table.on_failed(ids[1], now=16.0) == contact(ids[3])
    assert ids[1] not in table


def test_failed_unknown_or_cached_peer() -> None:
    table, ids = full_table(k=3)
    table.on_seen(contact(ids[3]), now=10.0)
    assert table.on_failed(ids[3], now=11.0) is None  # a failed cached peer leaves the cache
    assert not table.cached(ids[3])
    assert table.on_failed(ids[6], now=11.0) is None
    assert table.on_failed(OWN, now=11.0) is None


def test_reseen_peer_updates_address_and_moves_to_tail() -> None:
    table, ids = full_table(k=3)
    table.on_seen(contact(ids[0], port=99), now=20.0)
    assert table.get(ids[0]) == contact(ids[0], port=99)
    assert table.contacts()[-1].peer_id == ids[0]


def test_undialable_peer_is_not_added() -> None:
    table = RoutingTable(OWN)
    assert table.on_seen(PeerInfo(peer_id=b"\x01" * 32), now=0.0) is None
    assert len(table) == 0


def test_own_id_is_ignored() -> None:
    table = RoutingTable(OWN)
    assert table.on_seen(contact(OWN), now=0.0) is None
    assert len(table) == 0 and OWN not in table and table.get(OWN) is None
    with pytest.raises(LocalProtocolError):
        table.bucket_index(OWN)


def test_bad_arguments() -> None:
    with pytest.raises(LocalProtocolError):
        RoutingTable(b"short")
    with pytest.raises(LocalProtocolError):
        RoutingTable(OWN, k=0)
    with pytest.raises(LocalProtocolError):
        RoutingTable(OWN).closest(b"x")
    with pytest.raises(LocalProtocolError):
        RoutingTable(OWN).random_id_in_bucket(256, random.Random(0))
    assert "x" not in RoutingTable(OWN)


# ── refresh ─────────────────────────────────────────────────────────────────────────────────


def test_stale_buckets_yield_ids_in_each_bucket_up_to_deepest() -> None:
    table = RoutingTable(OWN, k=3)
    table.on_seen(contact(ids_in_bucket(table, 4, 1)[0]), now=0.0)
    rng = random.Random(1)
    targets = table.stale_buckets(now=100.0, refresh_interval=60.0, rng=rng)
    assert [table.bucket_index(t) for t in targets] == [0, 1, 2, 3, 4]
    assert table.stale_buckets(now=101.0, refresh_interval=60.0, rng=rng) == []
    table.touch(targets[2], now=150.0)
    table.touch(OWN, now=150.0)
    again = table.stale_buckets(now=170.0, refresh_interval=60.0, rng=rng)
    assert [table.bucket_index(t) for t in again] == [0, 1, 3, 4]


def test_empty_table_has_nothing_to_refresh() -> None:
    assert RoutingTable(OWN).stale_buckets(0.0, 60.0, random.Random(0)) == []


@given(st.integers(0, 255), st.integers(0, 2**32))
def test_random_id_lands_in_its_bucket(i: int, seed: int) -> None:
    table = RoutingTable(bytes(range(32)))
    assert table.bucket_index(table.random_id_in_bucket(i, random.Random(seed))) == i


# ── properties ──────────────────────────────────────────────────────────────────────────────

peer_ids = st.binary(min_size=32, max_size=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(peer_ids, max_size=120, unique=True), peer_ids, st.integers(1, 30))
def test_closest_matches_brute_force(ids: list[bytes], target: bytes, n: int) -> None:
    table = RoutingTable(OWN, k=8)
    for t, pid in enumerate(ids):
        action = table.on_seen(contact(pid), now=float(t))
        if action is not None:
            table.on_ping_result(action.oldest.peer_id, alive=True, now=float(t))
    held = [c.peer_id for c in table.contacts()]
    expected = sorted(held, key=lambda p: xor_distance(p, target))[:n]
    assert [c.peer_id for c in table.closest(target, n)] == expected


# a 4-bit id space squeezed into the top byte makes buckets fill and collide quickly
small_ids = st.integers(1, 255).map(lambda b: bytes([b]) + bytes(31))
ops = st.lists(
    st.tuples(st.sampled_from(["seen", "failed", "ping"]), small_ids, st.booleans()), max_size=150
)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_buckets_never_exceed_k(operations: list[tuple[str, bytes, bool]]) -> None:
    table = RoutingTable(OWN, k=3, replacement_cache=2, max_failures=2)
    pending: list[bytes] = []
    for t, (op, pid, alive) in enumerate(operations):
        if op == "seen":
            action = table.on_seen(contact(pid), now=float(t))
            if action is not None:
                pending.append(action.oldest.peer_id)
        elif op == "failed":
            table.on_failed(pid, now=float(t))
        elif pending:
            table.on_ping_result(pending.pop(0), alive=alive, now=float(t))
        assert all(size <= 3 for size in table.bucket_sizes().values())
        assert len(table.contacts()) == len(set(c.peer_id for c in table.contacts()))
        assert not any(table.cached(c.peer_id) for c in table.contacts())


# ── IP diversity ──────────────────────────────────────────────────────────────────────────────


def at(peer_id: bytes, host: str, port: int = 443) -> PeerInfo:
    return PeerInfo(peer_id=peer_id, address=f"https://{host}:{port}")


def test_a_bucket_holds_at_most_two_contacts_from_one_ipv4_24_or_ipv6_48() -> None:
    """An eclipse attacker grinds ids into the buckets near the members key from one network: the
    table took every one while the bucket had room (issue 48: no IP diversity). Now one /24 (or
    /48) gets two places in a bucket; other networks still get in."""
    table = RoutingTable(OWN, k=20)
    ids = ids_in_bucket(table, 0, 30)
    for n, pid in enumerate(ids[:10]):  # ten ids from one /24
        table.on_seen(at(pid, f"203.0.114.{n + 1}"), now=float(n))
    for n, pid in enumerate(ids[10:20]):  # ten from one IPv6 /48, each in its own /64
        table.on_seen(at(pid, f"[2a00:1450:4001:{n:x}::1]"), now=10.0 + n)
    assert table.bucket_sizes() == {0: 4} and table.diversity_refused == 16
    for n, pid in enumerate(ids[20:30]):  # ten distinct networks: all in
        table.on_seen(at(pid, f"8.{n + 1}.0.1"), now=20.0 + n)
    assert table.bucket_sizes() == {0: 14}
    assert not any(table.cached(pid) for pid in ids[:20])  # refused, not cached for later


def test_local_and_private_addresses_have_no_diversity_limit() -> None:
    """A local swarm runs every peer from 127.0.0.1 (a LAN from one private /24)."""
    table = RoutingTable(OWN, k=20)
    for n, pid in enumerate(ids_in_bucket(table, 0, 10)):
        table.on_seen(at(pid, "127.0.0.1", 7000 + n), now=float(n))
    for n, pid in enumerate(ids_in_bucket(table, 0, 20, seed=1)[10:]):
        table.on_seen(at(pid, f"192.168.1.{n + 1}"), now=float(n))
    assert table.bucket_sizes() == {0: 20} and table.diversity_refused == 0


def test_promotion_and_moves_keep_the_bucket_diverse() -> None:
    table = RoutingTable(OWN, k=3, replacement_cache=4)
    ids = ids_in_bucket(table, 0, 6)
    table.on_seen(at(ids[0], "9.9.9.1"), now=0.0)
    table.on_seen(at(ids[1], "9.9.9.2"), now=1.0)
    table.on_seen(at(ids[2], "8.8.4.4"), now=2.0)
    assert table.on_seen(at(ids[3], "1.1.1.1"), now=3.0) is not None  # full: cached, ping asked
    # a contact moving into a full network keeps its old address
    table.on_seen(at(ids[2], "9.9.9.3"), now=4.0)
    assert table.get(ids[2]) == at(ids[2], "8.8.4.4")
    # the dead oldest goes; the cached contact is promoted (its network has room)
    assert table.on_ping_result(ids[0], alive=False, now=5.0) == at(ids[3], "1.1.1.1")
    table.on_seen(at(ids[2], "9.9.9.3"), now=6.0)  # now 9.9.9.0/24 has room for it
    assert table.get(ids[2]) == at(ids[2], "9.9.9.3")
    with pytest.raises(LocalProtocolError):
        RoutingTable(OWN, max_per_group=0)
    assert RoutingTable(OWN, max_per_group=None).max_per_group is None
