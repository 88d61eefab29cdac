"""Signed expiring DHT records, the record store's rules and caps, and the rate limiter."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.dht.messages import (
    DHT_MESSAGES,
    MAX_REPLY_PEERS,
    REPLY_TO,
    FindNode,
    FindValue,
    NodesReply,
    Ping,
    Pong,
    Refresh,
    Store,
    StoreReply,
    ValueReply,
    check_sender,
)
from protocol.dht.records import (
    CONTENT_TAG_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    PutResult,
    RecordRefresh,
    RecordStore,
    SignedRecord,
    answer,
    content_tag,
    known_tag,
    known_tags,
    renewed,
    sign_record,
    unknown_to,
    verify_record,
)
from protocol.errors import (
    BadSignature,
    DecodeError,
    LocalProtocolError,
    NotAuthorized,
    Oversize,
    Stale,
)
from protocol.ids import key_id
from protocol.wire import codec
from protocol.wire.messages import MESSAGE_TYPES, STRUCT_TYPES, Message, PeerInfo
from protocol.wire.signing import Signer

ALICE = Signer(bytes(range(32)))
BOB = Signer(bytes(range(1, 33)))
MEMBERS = key_id("swarm/demo/members")
NOW = 1_000.0


def rec(signer: Signer = ALICE, value: bytes = b"http://a:1", ttl: float = 60.0) -> SignedRecord:
    return sign_record(signer, MEMBERS, value, NOW + ttl)


# ── signing and verification ────────────────────────────────────────────────────────────────


def test_signed_record_verifies_and_subkey_is_signer() -> None:
    r = rec()
    assert r.subkey == ALICE.peer_id and r.public_key == ALICE.public_key
    verify_record(r, now=NOW, max_ttl=3600)


def test_tampered_fields_break_the_signature() -> None:
    r = rec()
    tampered = [
        dataclasses.replace(r, value=b"http://evil:1"),
        dataclasses.replace(r, expires_at=NOW + 61),
        dataclasses.replace(r, key=key_id("x")),
    ]
    for bad in tampered:
        with pytest.raises(BadSignature):
            verify_record(bad, now=NOW, max_ttl=3600)


def test_subkey_signed_by_someone_else_is_not_authorized() -> None:
    forged = dataclasses.replace(rec(BOB), subkey=ALICE.peer_id)
    with pytest.raises(NotAuthorized, match="signed by someone else"):
        verify_record(forged, now=NOW, max_ttl=3600)
    # Bob's key with Bob's signature over Alice's subkey still cannot pass
    theft = dataclasses.replace(rec(ALICE), public_key=BOB.public_key)
    with pytest.raises(NotAuthorized):
        verify_record(theft, now=NOW, max_ttl=3600)


def test_expired_record_is_stale() -> None:
    r = rec(ttl=10.0)
    with pytest.raises(Stale, match="expired"):
        verify_record(r, now=NOW + 10.0, max_ttl=3600)


def test_oversized_value_and_ttl() -> None:
    with pytest.raises(Oversize, match="value"):
        verify_record(rec(value=b"x" * 101), now=NOW, max_ttl=3600, max_value_bytes=100)
    with pytest.raises(Oversize, match="ttl"):
        verify_record(rec(ttl=7200.0), now=NOW, max_ttl=3600)


def test_record_shape_is_checked() -> None:
    good = rec()
    with pytest.raises(DecodeError, match="key"):
        dataclasses.replace(good, key=b"short")
    with pytest.raises(DecodeError, match="signature"):
        dataclasses.replace(good, signature=b"x" * 63)
    with pytest.raises(DecodeError):
        dataclasses.replace(good, value="text")  # type: ignore[arg-type]
    with pytest.raises(DecodeError):
        dataclasses.replace(good, expires_at=float("nan"))
    assert dataclasses.replace(good, expires_at=2000).expires_at == 2000.0  # int -> float
    assert DEFAULT_MAX_VALUE_BYTES >= 512


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=200), st.floats(1.0, 1e6))
def test_any_value_and_ttl_round_trip_verification(value: bytes, ttl: float) -> None:
    verify_record(rec(value=value, ttl=ttl), now=NOW, max_ttl=1e6)


# ── the store ───────────────────────────────────────────────────────────────────────────────


def test_newest_expiry_wins_per_subkey() -> None:
    store = RecordStore(max_ttl_s=3600)
    assert store.put(rec(value=b"v1", ttl=100), NOW).stored
    older = store.put(rec(value=b"v0", ttl=50), NOW)
    assert older == PutResult(False, older.reason) and "held copy" in older.reason
    assert not store.put(rec(value=b"same", ttl=100), NOW).stored  # equal expiry: keep held
    newer = store.put(rec(value=b"v2", ttl=200), NOW)
    assert newer.stored and "replaced" in newer.reason
    assert [r.value for r in store.get(MEMBERS, NOW)] == [b"v2"]


def test_subkeys_are_independent_and_expired_are_dropped() -> None:
    store = RecordStore()
    store.put(rec(ALICE, ttl=10), NOW)
    store.put(rec(BOB, ttl=100), NOW)
    assert len(store) == 2 and store.keys() == [MEMBERS]
    assert [r.subkey for r in store.get(MEMBERS, NOW + 20)] == [BOB.peer_id]
    assert store.prune(NOW + 200) == 1
    assert len(store) == 0 and store.get(MEMBERS, NOW) == [] and store.prune(NOW) == 0


def test_expired_held_copy_is_replaced_by_any_valid_record() -> None:
    store = RecordStore()
    store.put(rec(ttl=10), NOW)
    later = sign_record(ALICE, MEMBERS, b"back", NOW + 15)
    assert store.put(later, NOW + 12).stored


def test_store_rejects_invalid_records_with_the_reason() -> None:
    store = RecordStore(max_value_bytes=8, max_ttl_s=100)
    with pytest.raises(Oversize):
        store.put(rec(value=b"123456789"), NOW)
    with pytest.raises(Oversize):
        store.put(rec(ttl=101), NOW)
    with pytest.raises(BadSignature):
        store.put(dataclasses.replace(rec(value=b"a"), value=b"b"), NOW)
    assert len(store) == 0


def test_a_full_key_trades_a_sources_records_only_for_longer_lived_ones() -> None:
    signers = [Signer(bytes([i]) * 32) for i in range(4)]
    store = RecordStore(max_subkeys_per_key=2)
    store.put(rec(signers[0], ttl=10), NOW)
    store.put(rec(signers[1], ttl=100), NOW)
    with pytest.raises(Oversize, match="key full: 2/2") as full:
        store.put(rec(signers[2], ttl=5), NOW)  # expires before all its source holds there
    assert full.value.penalty == 0.0
    assert store.put(rec(signers[0], ttl=50), NOW).stored  # refreshing a held subkey always fits
    put = store.put(rec(signers[2], ttl=60), NOW)  # one source: its earliest (expiring at 50) goes
    assert put.stored and put.evicted == 1 and "1 evicted" in put.reason
    assert {r.subkey for r in store.get(MEMBERS, NOW)} == {signers[1].peer_id, signers[2].peer_id}
    assert store.counts == {"refused: key full": 1, "evicted: key full": 1}
    # once records expire there is room again, without evicting anything
    assert store.put(rec(signers[3], ttl=200), NOW + 80).evicted == 0


def test_store_arguments_are_checked() -> None:
    with pytest.raises(LocalProtocolError):
        RecordStore(max_subkeys_per_key=0)
    with pytest.raises(LocalProtocolError):
        RecordStore(max_bytes=DEFAULT_MAX_VALUE_BYTES)  # cannot hold one largest record


# ── wire messages ───────────────────────────────────────────────────────────────────────────

ME = PeerInfo(peer_id=ALICE.peer_id, address="https://10.0.0.1:8443")
NAT = PeerInfo(peer_id=BOB.peer_id)  # a learner behind NAT: no address


@pytest.mark.parametrize(
    "msg",
    [
        Ping(sender=ME),
        Pong(sender=NAT),
        FindNode(sender=ME, target=MEMBERS),
        FindValue(sender=NAT, key=MEMBERS),
        FindValue(sender=NAT, key=MEMBERS, known=(known_tag(rec()),)),
        Store(sender=ME, records=(rec(), rec(BOB, value=b""))),
        NodesReply(peers=()),
        NodesReply(peers=(ME, PeerInfo(peer_id=BOB.peer_id, address="http://b:2"))),
        ValueReply(records=(rec(),), peers=(ME,)),
        ValueReply(records=(), peers=()),
        ValueReply(records=(), peers=(ME,), omitted=3),
        StoreReply(accepted=1, reasons=("record signature does not verify",)),
        Refresh(sender=ME, key=MEMBERS, refreshes=(RecordRefresh.of(rec()),)),
    ],
    ids=lambda m: type(m).__name__,
)
def test_dht_messages_round_trip_through_the_codec(msg: Message) -> None:
    back = codec.decode(codec.encode(msg).tobytes(), max_size=1 << 20)
    assert back == msg and type(back) is type(msg)
    for r in getattr(back, "records", ()):
        verify_record(r, now=NOW, max_ttl=3600)  # signatures survive the trip


def test_dht_codes_and_reply_table() -> None:
    assert all(
        32 <= cls.TYPE_CODE <= 63 and MESSAGE_TYPES[cls.TYPE_CODE] is cls for cls in DHT_MESSAGES
    )
    assert STRUCT_TYPES[32] is SignedRecord
    assert set(REPLY_TO) | set(REPLY_TO.values()) == set(DHT_MESSAGES)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: FindNode(sender=ME, target=b"x" * 31), "FindNode.target"),
        (lambda: FindValue(sender=ME, key=b""), "FindValue.key"),
        (lambda: FindValue(sender=ME, key=MEMBERS, known=(b"x" * 23,)), "24 bytes"),
        (lambda: FindValue(sender=ME, key=MEMBERS, known=(b"x" * 24,) * 4097), "cap"),
        (lambda: ValueReply(records=(), peers=(), omitted=-1), "omitted"),
        (lambda: ValueReply(records=(), peers=(), omitted=4097), "omitted"),
        (lambda: Store(sender=ME, records=()), "no records"),
        (lambda: Refresh(sender=ME, key=MEMBERS, refreshes=()), "no refreshes"),
        (lambda: Refresh(sender=ME, key=b"k", refreshes=(RecordRefresh.of(rec()),)), "key"),
        (lambda: Refresh(sender=ME, key=MEMBERS, refreshes=(RecordRefresh.of(rec()),) * 65), "cap"),
        (lambda: Store(sender=ME, records=(rec(),) * 65), "cap"),
        (lambda: NodesReply(peers=(ME,) * (MAX_REPLY_PEERS + 1)), "cap"),
        (lambda: StoreReply(accepted=-1, reasons=()), ">= 0"),
        (lambda: StoreReply(accepted=60, reasons=("x",) * 5), "65"),
        (lambda: Ping(sender=rec()), "PeerInfo"),  # type: ignore[arg-type]
    ],
)
def test_dht_messages_refuse_bad_values(build: object, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        build()  # type: ignore[operator]


def test_tampered_record_bytes_on_the_wire_fail_verification() -> None:
    wire = bytearray(codec.encode(Store(sender=ME, records=(rec(value=b"http://a:1"),))).tobytes())
    at = wire.index(b"http://a:1")
    wire[at : at + 10] = b"http://e:1"
    back = codec.decode(bytes(wire), max_size=1 << 20)
    assert isinstance(back, Store)
    with pytest.raises(BadSignature):
        verify_record(back.records[0], now=NOW, max_ttl=3600)


def test_check_sender_binds_sender_to_envelope_key() -> None:
    check_sender(ME, ALICE.public_key)
    with pytest.raises(NotAuthorized):
        check_sender(ME, BOB.public_key)


# ── delta reads ─────────────────────────────────────────────────────────────────────────────

WRITERS = [Signer(bytes([i]) * 32) for i in range(1, 9)]


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 50)), max_size=12),
    known=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 50)), max_size=12),
)
def test_a_responder_sends_exactly_the_records_newer_than_the_readers(
    held: list[tuple[int, int]], known: list[tuple[int, int]]
) -> None:
    """Whatever the responder holds and the reader names: a record is sent iff the reader holds
    nothing as new for its writer, and ``omitted`` counts the rest."""
    records = [rec(WRITERS[w], ttl=float(t)) for w, t in held]
    reader = [rec(WRITERS[w], ttl=float(t)) for w, t in known]
    sent, omitted = unknown_to(records, known_tags(reader))
    newest = {}
    for r in reader:
        newest[r.subkey] = max(newest.get(r.subkey, 0.0), r.expires_at)
    assert sent == [r for r in records if r.expires_at > newest.get(r.subkey, 0.0)]
    assert omitted == len(records) - len(sent)
    assert unknown_to(records, ()) == (records, 0)  # a first read gets everything


def test_known_tags_name_each_writer_once_with_its_newest_expiry() -> None:
    tags = known_tags([rec(ALICE, ttl=10), rec(BOB, ttl=5), rec(ALICE, ttl=30)])
    assert sorted(tags) == sorted([known_tag(rec(ALICE, ttl=30)), known_tag(rec(BOB, ttl=5))])
    assert all(len(t) == 24 for t in tags)


def test_tags_a_reader_cannot_mean_leave_nothing_out_and_bad_ones_are_refused() -> None:
    records = [rec(ALICE, ttl=10)]
    prefix = ALICE.peer_id[:16]
    for weird in (float("nan"), float("inf"), float("-inf")):
        assert unknown_to(records, (prefix + struct.pack("<d", weird),)) == (records, 0)
    with pytest.raises(DecodeError, match="24 bytes"):
        unknown_to(records, (b"short",))


# ── reads by content: refreshes instead of republished values ───────────────────────────────


@settings(max_examples=80, deadline=None)
@given(
    responder=st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 2), st.integers(1, 50)), max_size=12
    ),
    reader=st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 2), st.integers(1, 50), st.booleans()),
        max_size=12,
    ),
)
def test_a_read_by_content_ends_with_every_value_a_whole_read_would_give(
    responder: list[tuple[int, int, int]], reader: list[tuple[int, int, int, bool]]
) -> None:
    """Whatever the responder holds and the reader holds by content: a record whose value the
    reader does not hold comes whole; one it holds comes as a refresh iff named in ``renew``
    (rebuilt on the reader's value, it verifies) and is left out iff named in ``same``; so the
    reader ends up holding, per writer, the value of the responder's newest record unless it
    holds that value already."""
    records = [rec(WRITERS[w], value=b"v%d" % v, ttl=float(t)) for w, v, t in responder]
    held_recs = {}
    for w, v, t, due in reader:  # one held record per writer, as a reader keeps
        held_recs[WRITERS[w].peer_id] = (rec(WRITERS[w], value=b"v%d" % v, ttl=float(t)), due)
    same = tuple(content_tag(r) for r, due in held_recs.values() if not due)
    renew = tuple(content_tag(r) for r, due in held_recs.values() if due)
    got = answer(records, same=same, renew=renew)
    for r in got.records:
        held = held_recs.get(r.subkey)
        assert held is None or held[0].value != r.value
    rebuilt, _ = renewed(got.refreshes, {s: r for s, (r, _) in held_recs.items()})
    for r in rebuilt:
        verify_record(r, now=NOW, max_ttl=3600)
        assert held_recs[r.subkey][1] and r.value == held_recs[r.subkey][0].value
    assert got.omitted == sum(
        1
        for r in records
        if r.subkey in held_recs
        and not held_recs[r.subkey][1]
        and held_recs[r.subkey][0].value == r.value
    )
    assert len(got.records) + len(got.refreshes) + got.omitted == len(records)


def test_a_refresh_only_applies_to_the_value_it_was_signed_over() -> None:
    """A refresh rebuilt on another value (a digest collision, or a lie) fails verification; one
    for a record not held, or no newer than the one held, is counted and dropped."""
    old, new = rec(ALICE, value=b"same", ttl=10), rec(ALICE, value=b"same", ttl=40)
    refresh = RecordRefresh.of(new)
    (back,), wasted = renewed([refresh], {ALICE.peer_id: old})
    assert wasted == 0 and back == new
    forged = refresh.refreshed(rec(ALICE, value=b"other", ttl=10))
    with pytest.raises(BadSignature):
        verify_record(forged, now=NOW, max_ttl=3600)
    assert renewed([refresh], {}) == ([], 1)
    assert renewed([RecordRefresh.of(old)], {ALICE.peer_id: new}) == ([], 1)
    with pytest.raises(DecodeError, match="applied to"):
        refresh.refreshed(rec(BOB))


def test_content_tags_and_refreshes_are_checked_on_the_wire() -> None:
    tag = content_tag(rec())
    assert len(tag) == CONTENT_TAG_BYTES == 24
    msg = FindValue(sender=NAT, key=MEMBERS, same=(tag,), renew=(tag,))
    assert codec.decode(codec.encode(msg).tobytes(), max_size=1 << 20) == msg
    reply = ValueReply(records=(), peers=(), refreshes=(RecordRefresh.of(rec()),))
    assert codec.decode(codec.encode(reply).tobytes(), max_size=1 << 20) == reply
    with pytest.raises(DecodeError, match="24 bytes"):
        FindValue(sender=NAT, key=MEMBERS, same=(b"x" * 23,))
    with pytest.raises(DecodeError, match="cap"):
        FindValue(sender=NAT, key=MEMBERS, known=(b"x" * 24,) * 4000, renew=(tag,) * 97)
    with pytest.raises(DecodeError, match="cap"):
        ValueReply(records=(rec(),) * 4000, peers=(), refreshes=(RecordRefresh.of(rec()),) * 97)
    with pytest.raises(DecodeError, match="signature"):
        RecordRefresh(subkey=ALICE.peer_id, expires_at=NOW, signature=b"x")
    with pytest.raises(DecodeError, match="content"):
        answer([rec()], same=(b"short",))


def test_a_store_refreshes_only_a_record_it_holds_and_only_for_its_value() -> None:
    store = RecordStore()
    old = rec(ALICE, value=b"same", ttl=10)
    with pytest.raises(Stale, match="store it"):
        store.refresh(MEMBERS, RecordRefresh.of(old), NOW)
    store.put(old, NOW)
    new = rec(ALICE, value=b"same", ttl=40)
    assert store.refresh(MEMBERS, RecordRefresh.of(new), NOW).stored
    assert store.get(MEMBERS, NOW) == [new]
    assert not store.refresh(MEMBERS, RecordRefresh.of(old), NOW).stored  # not newer
    other = rec(ALICE, value=b"other", ttl=50)  # signed over another value
    with pytest.raises(BadSignature):
        store.refresh(MEMBERS, RecordRefresh.of(other), NOW)
    assert store.get(MEMBERS, NOW) == [new]
