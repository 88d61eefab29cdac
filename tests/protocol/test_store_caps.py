"""The record store under a flood: byte cap, fair-share eviction, per-IP limits (fake clock)."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.dht.messages import Store
from protocol.dht.records import (
    RECORD_OVERHEAD_BYTES,
    RateLimited,
    RecordStore,
    SignedRecord,
    StoreLimits,
    sign_record,
    source_key,
)
from protocol.errors import Oversize, RemoteProtocolError
from protocol.ids import key_id
from protocol.wire import codec
from protocol.wire.messages import PeerInfo
from protocol.wire.signing import Signer

MEMBERS = key_id("atoll/demo/members")
NOW = 1_000.0
HONEST_IP, FLOOD_IP = "10.0.0.7", "203.0.113.9"
SIZE = 1024 + RECORD_OVERHEAD_BYTES  # what one flood record (1 KiB value) costs


def fresh_signers(seed: int) -> Iterator[Signer]:
    i = 0
    while True:
        i += 1
        yield Signer(key_id(f"signer {seed}/{i}"))


def member(signer: Signer, at: float, ttl: float = 20.0) -> SignedRecord:
    return sign_record(signer, MEMBERS, b"http://10.0.0.7:8080", at + ttl)


def stored(store: RecordStore, key: bytes, now: float) -> set[bytes]:
    return {r.subkey for r in store.get(key, now)}


# ── the flood ───────────────────────────────────────────────────────────────────────────────


@pytest.mark.timeout(120)
def test_flood_of_100k_fresh_keys_from_one_ip_is_throttled_and_capped() -> None:
    """100k Store requests at 2,000/s for 50 s, each signed by a fresh key with a 1 KiB value
    that lives 24 h, half under the members key and half under fresh keys. An honest member from
    another IP stored its record before and republishes it every 6 s with a 20 s ttl (as
    node.peer does); a long-lived honest record is stored before the flood too."""
    limits, cap = StoreLimits(), 1 << 20
    store = RecordStore(max_bytes=cap, max_subkeys_per_key=200)
    honest, keeper = Signer(key_id("honest")), Signer(key_id("keeper"))
    assert store.put(member(honest, NOW), NOW, HONEST_IP).stored
    long_lived = sign_record(keeper, key_id("keeper's key"), b"x" * 100, NOW + 3600)
    assert store.put(long_lived, NOW, "10.0.0.8").stored
    admitted = throttled = refused_full = 0
    most_bytes, next_republish = 0, NOW + 6
    for i in range(100_000):
        now = NOW + i / 2000
        if now >= next_republish:  # the honest member keeps its record alive
            assert store.put(member(honest, now), now, HONEST_IP).stored
            next_republish += 6
        # every request a fresh key: the per-IP budget is charged before the per-key one, so a
        # new id stands for the key until the request passes (a key costs ~50 us; ~6k of 100k pass)
        seed = key_id(f"flood signer {i}")
        try:
            limits.admit(source=FLOOD_IP, signer=seed, records=1, now=now)
        except RateLimited:
            throttled += 1
            continue
        admitted += 1  # only now does the record matter: make its key and sign it
        signer = Signer(seed)
        key = MEMBERS if i % 2 else key_id(f"junk {i}")
        try:
            store.put(sign_record(signer, key, bytes(1024), now + 24 * 3600), now, FLOOD_IP)
        except Oversize:
            refused_full += 1
        most_bytes = max(most_bytes, store.nbytes)
    end = NOW + 100_000 / 2000
    assert admitted <= 1000 + 100 * 50 + 1  # the per-IP burst, then 100 records/s
    assert throttled >= 94_000
    assert most_bytes <= cap and store.nbytes <= cap
    assert store.held_by(FLOOD_IP) >= cap - 4 * SIZE  # the flood had all the room it could take
    assert honest.peer_id in stored(store, MEMBERS, end)  # still a member
    assert store.get(key_id("keeper's key"), end) == [long_lived]
    assert len(store.get(MEMBERS, end)) <= 200
    print(json.dumps({"requests": 100_000, "admitted": admitted, "throttled": throttled,
                      "refused_full": refused_full, "store_bytes_max": most_bytes, "cap": cap,
                      "evicted": dict(store.counts), "honest_survived": True}))  # fmt: skip


def test_an_honest_record_survives_a_flood_that_fits_through_the_rate_limit() -> None:
    """Without the rate limit at all (many IPs' worth of budget), one IP still cannot evict."""
    store = RecordStore(max_bytes=64 * SIZE, max_subkeys_per_key=16)
    honest = Signer(key_id("honest"))
    assert store.put(member(honest, NOW, ttl=600), NOW, HONEST_IP).stored
    signers = fresh_signers(2)
    for i in range(500):
        now = NOW + i * 0.1
        rec = sign_record(next(signers), MEMBERS if i % 3 else key_id(f"j{i}"), bytes(1024),
                          now + 24 * 3600)  # fmt: skip
        store.put(rec, now, FLOOD_IP)
        assert store.nbytes <= 64 * SIZE
    assert honest.peer_id in stored(store, MEMBERS, NOW + 60)
    assert len(store.get(MEMBERS, NOW + 60)) == 16  # the flood kept trading its own records


# ── the policy, step by step ────────────────────────────────────────────────────────────────


def test_a_full_store_evicts_from_the_heaviest_source_first() -> None:
    store = RecordStore(max_bytes=4 * SIZE)
    a = fresh_signers(3)
    for ttl in (300, 100, 200):  # source A holds three records
        store.put(sign_record(next(a), key_id(f"a{ttl}"), bytes(1024), NOW + ttl), NOW, "1.1.1.1")
    b = Signer(key_id("b"))
    store.put(sign_record(b, key_id("b"), bytes(1024), NOW + 10), NOW, "2.2.2.2")
    assert store.nbytes == 4 * SIZE
    # C holds nothing; A holds 3 records > C's 1 after storing: A's earliest (ttl 100) goes,
    # although it expires after C's record
    put = store.put(
        sign_record(Signer(key_id("c")), key_id("c"), bytes(1024), NOW + 50), NOW, "3.3.3.3"
    )
    assert put.stored and put.evicted == 1
    assert store.get(key_id("a100"), NOW) == [] and store.held_by("1.1.1.1") == 2 * SIZE
    # now A, B and C hold 2, 1 and 1: A storing again is its own heaviest and may only trade its
    # own records for longer-lived ones
    with pytest.raises(Oversize, match="store full") as full:
        store.put(sign_record(next(a), key_id("a150"), bytes(1024), NOW + 150), NOW, "1.1.1.1")
    assert full.value.penalty == 0.0 and store.counts["refused: store full"] == 1
    put = store.put(sign_record(next(a), key_id("a400"), bytes(1024), NOW + 400), NOW, "1.1.1.1")
    assert put.evicted == 1 and store.get(key_id("a200"), NOW) == []
    assert store.get(key_id("b"), NOW) and store.get(key_id("c"), NOW)  # B and C untouched
    assert store.nbytes == 4 * SIZE and len(store) == 4


def test_a_full_key_evicts_the_source_with_most_subkeys() -> None:
    store = RecordStore(max_subkeys_per_key=4)
    flood, signers = fresh_signers(4), [Signer(key_id(f"m{i}")) for i in range(3)]
    store.put(member(signers[0], NOW), NOW, "10.0.0.1")
    for _ in range(3):
        store.put(sign_record(next(flood), MEMBERS, b"x", NOW + 3600), NOW, FLOOD_IP)
    put = store.put(member(signers[1], NOW), NOW, "10.0.0.2")  # 3 flood records > 1 after
    assert put.stored and put.evicted == 1
    put = store.put(member(signers[2], NOW), NOW, "10.0.0.3")  # 2 > 1
    assert put.stored and put.evicted == 1
    with pytest.raises(Oversize, match="key full: 4/4"):  # 1 flood record, not > 1 after
        store.put(member(Signer(key_id("late")), NOW), NOW, "10.0.0.4")
    with pytest.raises(Oversize, match="key full"):  # the flood's own records expire later
        store.put(sign_record(next(flood), MEMBERS, b"x", NOW + 60), NOW, FLOOD_IP)
    assert {s.peer_id for s in signers} <= stored(store, MEMBERS, NOW)


def test_a_refresh_that_does_not_fit_keeps_the_held_copy() -> None:
    store = RecordStore(max_bytes=2 * SIZE - 1, max_value_bytes=1024)
    me, other = Signer(key_id("me")), Signer(key_id("other"))
    first = sign_record(me, MEMBERS, b"short", NOW + 60)
    store.put(first, NOW, "10.0.0.1")
    store.put(sign_record(other, MEMBERS, bytes(1024), NOW + 100), NOW, "10.0.0.1")
    bigger = sign_record(
        me, MEMBERS, bytes(1024), NOW + 90
    )  # its source's other record lives longer
    with pytest.raises(Oversize):
        store.put(bigger, NOW, "10.0.0.1")
    assert first in store.get(MEMBERS, NOW) and store.nbytes == 2 * SIZE - 1024 + 5
    assert store.put(sign_record(me, MEMBERS, b"short!", NOW + 70), NOW, "10.0.0.2").stored
    assert store.held_by("10.0.0.2") == RECORD_OVERHEAD_BYTES + 6  # a refresh moves the charge


def test_overhead_per_record_is_an_upper_bound_on_memory() -> None:
    """Records decoded from the wire, each under a fresh key, with empty values: the worst case."""
    signers, me = fresh_signers(5), PeerInfo(peer_id=bytes(32))
    wires = [codec.encode(Store(sender=me, records=(sign_record(next(signers), key_id(f"k{i}"), b"",
                                                                NOW + 60),))).tobytes()
             for i in range(1000)]  # fmt: skip
    store = RecordStore()
    tracemalloc.start()
    try:
        for i, wire in enumerate(wires):
            msg = codec.decode(wire, max_size=1 << 20)
            assert isinstance(msg, Store)
            store.put(msg.records[0], NOW, f"10.0.{i % 50}.1")
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(
        json.dumps({"traced_bytes_per_record": used / len(store), "charged": RECORD_OVERHEAD_BYTES})
    )
    assert used / len(store) <= RECORD_OVERHEAD_BYTES
    assert store.nbytes == len(store) * RECORD_OVERHEAD_BYTES


# ── property: caps and the honest record hold whatever arrives ──────────────────────────────

SIGNERS = [Signer(key_id(f"prop {i}")) for i in range(12)]
KEYS = [key_id(f"prop key {i}") for i in range(3)]
IPS = ["10.0.0.1", "10.0.0.2", "2001:db8::1", "2001:db8::2"]  # the last two are one /64
_op = st.tuples(st.integers(0, 11), st.integers(0, 2), st.integers(1, 300), st.floats(1, 600),
                st.integers(0, 3), st.floats(0, 5))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.lists(_op, max_size=60))
def test_caps_accounting_and_the_honest_record_hold_under_any_puts(
    ops: list[tuple[int, int, int, float, int, float]],
) -> None:
    cap = 6 * (RECORD_OVERHEAD_BYTES + 300)
    store = RecordStore(max_bytes=cap, max_subkeys_per_key=4, max_value_bytes=300)
    honest = sign_record(Signer(key_id("honest")), KEYS[0], b"", NOW + 10_000)
    store.put(honest, NOW, "192.0.2.1")
    now = NOW
    for who, key, size, ttl, ip, dt in ops:
        now += dt
        try:
            store.put(sign_record(SIGNERS[who], KEYS[key], bytes(size), now + ttl), now, IPS[ip])
        except RemoteProtocolError as exc:
            assert isinstance(exc, Oversize) and exc.penalty == 0.0
        keys = store.keys()  # a list: get() may prune while we read
        held = {k: store.get(k, now) for k in keys}
        assert store.nbytes <= cap
        assert all(len(recs) <= 4 for recs in held.values())
        assert store.nbytes == sum(
            len(r.value) + RECORD_OVERHEAD_BYTES for rs in held.values() for r in rs
        )
        assert len(store) == sum(len(rs) for rs in held.values())
        assert honest in held[KEYS[0]]  # the smallest holder is never anyone's victim
    held_at_end = len(store)
    assert store.prune(now + 10_000) == held_at_end and store.nbytes == 0


# ── limits ──────────────────────────────────────────────────────────────────────────────────


def test_store_limits_meter_records_per_ip_and_requests_per_key() -> None:
    limits = StoreLimits(source_rate=10, source_burst=100, key_rate=1, key_burst=3)
    signers = fresh_signers(6)
    for _ in range(100):  # fresh keys: only the IP's budget binds
        limits.admit(source=FLOOD_IP, signer=next(signers).peer_id, records=1, now=NOW)
    with pytest.raises(RateLimited, match=f"from {FLOOD_IP} over 10/s") as exc:
        limits.admit(source=FLOOD_IP, signer=next(signers).peer_id, records=1, now=NOW)
    assert exc.value.status == 429 and isinstance(exc.value, RemoteProtocolError)
    limits.admit(source=FLOOD_IP, signer=next(signers).peer_id, records=10, now=NOW + 1)
    limits.admit(source=HONEST_IP, signer=next(signers).peer_id, records=64, now=NOW)  # its own
    limits.admit(source="::ffff:10.9.9.9", signer=next(signers).peer_id, records=500, now=NOW)
    with pytest.raises(RateLimited):  # the same IPv4 host, written plainly
        limits.admit(source="10.9.9.9", signer=next(signers).peer_id, records=1, now=NOW)
    one = Signer(key_id("one key"))
    for i in range(3):
        limits.admit(source=f"10.1.0.{i}", signer=one.peer_id, records=1, now=NOW)
    with pytest.raises(RateLimited, match="Store rate over 1/s, burst 3"):
        limits.admit(source="10.1.0.9", signer=one.peer_id, records=1, now=NOW)


def test_source_key_groups_an_ipv6_64_and_bounds_the_rest() -> None:
    assert source_key("10.0.0.7") == "10.0.0.7"
    assert (
        source_key("2001:db8:1:2:aaaa::1")
        == source_key("2001:db8:1:2:bbbb::9")
        == "2001:db8:1:2::/64"
    )
    assert source_key("::ffff:192.0.2.1") == "192.0.2.1"
    assert source_key("") == "" and len(source_key("x" * 1000)) == 64
