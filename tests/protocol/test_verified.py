"""The bounded memory of verified signatures: only an exact (key, signature, bytes) that verified
before is skipped; a changed byte, key or signature is verified in full; the cap holds."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.dht.records import RecordStore, sign_record, verify_record
from protocol.errors import BadSignature, LocalProtocolError, Stale
from protocol.wire.signing import Signer
from protocol.wire.verified import VerifiedSignatures, verify_ed25519

ALICE = Signer(b"\x01" * 32)
BOB = Signer(b"\x02" * 32)


def flip(data: bytes, i: int) -> bytes:
    i %= len(data)
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


def test_a_second_check_of_the_same_bytes_is_a_hit() -> None:
    seen = VerifiedSignatures(capacity=8)
    sig = ALICE.sign(b"hello")
    seen.verify(ALICE.public_key, sig, b"hello", "t")
    seen.verify(ALICE.public_key, sig, b"hello", "t")
    assert (seen.verified, seen.hits, len(seen)) == (1, 1, 1)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=200), at=st.integers(min_value=0))
def test_a_changed_byte_key_or_signature_never_hits(data: bytes, at: int) -> None:
    seen = VerifiedSignatures(capacity=16)
    sig = ALICE.sign(data)
    seen.verify(ALICE.public_key, sig, data, "t")
    for key, signature, body in [
        (ALICE.public_key, sig, flip(data, at)),  # a changed byte of the data
        (ALICE.public_key, flip(sig, at), data),  # a changed signature
        (BOB.public_key, sig, data),  # another key
        (flip(ALICE.public_key, at), sig, data),  # a changed key
    ]:
        with pytest.raises(BadSignature, match="t: signature does not verify"):
            seen.verify(key, signature, body, "t")
    assert (seen.verified, seen.hits, len(seen)) == (1, 0, 1)


def test_a_failure_is_never_remembered() -> None:
    seen = VerifiedSignatures(capacity=4)
    bad = flip(ALICE.sign(b"x"), 0)
    for _ in range(3):
        with pytest.raises(BadSignature):
            seen.verify(ALICE.public_key, bad, b"x", "t")
    assert (seen.verified, seen.hits, len(seen)) == (0, 0, 0)


def test_the_cap_holds_and_the_least_recently_used_goes_first() -> None:
    seen = VerifiedSignatures(capacity=3)
    msgs = [bytes([i]) * 5 for i in range(5)]
    sigs = [ALICE.sign(m) for m in msgs]
    for m, s in zip(msgs[:3], sigs[:3], strict=True):
        seen.verify(ALICE.public_key, s, m, "t")
    seen.verify(ALICE.public_key, sigs[0], msgs[0], "t")  # 0 used again: 1 is the oldest now
    seen.verify(ALICE.public_key, sigs[3], msgs[3], "t")
    assert len(seen) == 3 and seen.hits == 1
    seen.verify(ALICE.public_key, sigs[0], msgs[0], "t")
    assert seen.hits == 2  # kept
    seen.verify(ALICE.public_key, sigs[1], msgs[1], "t")
    assert seen.hits == 2 and seen.verified == 5  # 1 was dropped: verified again
    for m, s in zip(msgs, sigs, strict=True):
        seen.verify(ALICE.public_key, s, m, "t")
    assert len(seen) == 3


def test_capacity_must_be_positive() -> None:
    with pytest.raises(LocalProtocolError, match="at least 1"):
        VerifiedSignatures(capacity=0)


def test_a_malformed_key_or_signature_is_a_bad_signature() -> None:
    with pytest.raises(BadSignature):
        verify_ed25519(b"\x00" * 5, b"\x00" * 64, b"x", "t")
    with pytest.raises(BadSignature):
        VerifiedSignatures().verify(ALICE.public_key, b"\x00" * 3, b"x", "t")


def test_a_record_checked_before_still_gets_its_other_checks() -> None:
    seen = VerifiedSignatures()
    rec = sign_record(ALICE, b"k" * 32, b"v", expires_at=100.0)
    verify_record(rec, now=50.0, max_ttl=60.0, verified=seen)
    verify_record(rec, now=60.0, max_ttl=60.0, verified=seen)
    assert (seen.verified, seen.hits) == (1, 1)
    with pytest.raises(Stale):  # time is checked on every call, hit or not
        verify_record(rec, now=100.0, max_ttl=60.0, verified=seen)
    tampered = dataclasses.replace(rec, value=b"w")
    with pytest.raises(BadSignature):
        verify_record(tampered, now=50.0, max_ttl=60.0, verified=seen)


def test_a_store_does_not_verify_a_record_it_checked_before_again() -> None:
    seen = VerifiedSignatures()
    store = RecordStore(max_ttl_s=60.0, verified=seen)
    rec = sign_record(ALICE, b"k" * 32, b"v", expires_at=100.0)
    assert store.put(rec, 50.0).stored
    assert not store.put(rec, 51.0).stored  # the same copy again: refused as not newer
    assert (seen.verified, seen.hits) == (1, 1)
