"""Signed envelopes: verify before decode, tampering, replay and skew, streaming receive."""

from __future__ import annotations

import math
import struct

import blake3
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import (
    BadSignature,
    DecodeError,
    LocalProtocolError,
    NotAuthorized,
    Oversize,
    RemoteProtocolError,
    Replay,
)
from protocol.ids import peer_id_from_public_key
from protocol.wire.codec import Encoded, encode
from protocol.wire.messages import Ack, FragmentState, Message
from protocol.wire.sealing import FRAMED, RAW
from protocol.wire.signing import (
    DOMAIN,
    MAX_ENVELOPE,
    ReplayWindow,
    Sealed,
    SealedReader,
    Signer,
    digest_parts,
    envelope_length,
    message_digest,
    message_digests,
    open_envelope,
    open_sealed,
    seal,
    split_sealed,
    verify_sealed,
)
from tests.protocol.test_messages import contribution, messages, tensor

ALICE = Signer.from_seed(bytes(range(32)))
MALLORY = Signer.from_seed(b"m" * 32)
NOW = 1_000_000.0
MAX = 1 << 20


def nonce(i: int = 0) -> bytes:
    return i.to_bytes(16, "big")


def sealed(
    msg: Message | None = None, *, now: float = NOW, n: int = 0, signer: Signer = ALICE
) -> Sealed:
    return seal(encode(msg or contribution(tensors=(tensor(64),))), signer, now=now, nonce=nonce(n))


def env_bounds(wire: bytes) -> tuple[int, int]:
    return 4, 4 + struct.unpack(">I", wire[:4])[0]


def resign(wire: bytes, change: dict[int, object], signer: Signer | None = None) -> bytes:
    """Rewrite envelope fields (by index); re-sign with ``signer`` or keep the old signature."""
    start, end = env_bounds(wire)
    signed, signature = msgpack.unpackb(wire[start:end])
    fields = msgpack.unpackb(signed)
    for i, v in change.items():
        fields[i] = v
    signed = msgpack.packb(fields, use_bin_type=True)
    if signer is not None:
        signature = signer.sign(DOMAIN + signed)
    env = msgpack.packb([signed, signature], use_bin_type=True)
    return struct.pack(">I", len(env)) + env + wire[end:]


# ── round trip ───────────────────────────────────────────────────────────────────────────────
@settings(max_examples=40, deadline=None)
@given(messages(), st.integers(1, 400))
def test_sealed_messages_open_to_the_same_message(msg: Message, chunk_size: int) -> None:
    s = seal(encode(msg), ALICE, now=NOW, nonce=nonce())
    wire = s.tobytes()
    assert len(wire) == s.size
    chunks = list(s.iter_chunks(chunk_size))
    assert all(0 < c.nbytes <= chunk_size for c in chunks) and b"".join(chunks) == wire
    opened = open_sealed(wire, now=NOW + 1, replay=ReplayWindow(), max_size=MAX)
    assert opened.message == msg
    assert (opened.public_key, opened.peer_id) == (ALICE.public_key, ALICE.peer_id)
    assert (opened.timestamp, opened.nonce) == (NOW, nonce())


def test_signer_identity_and_misuse() -> None:
    assert len(ALICE.public_key) == 32
    assert ALICE.peer_id == peer_id_from_public_key(ALICE.public_key)
    assert Signer(bytes(range(32))).public_key == ALICE.public_key
    assert len(ALICE.sign(b"x")) == 64 and "Signer(" in repr(ALICE)
    with pytest.raises(LocalProtocolError):
        Signer(b"short")
    enc = encode(Ack(accepted=True, reason="", version=0))
    with pytest.raises(LocalProtocolError, match="nonce"):
        seal(enc, ALICE, now=NOW, nonce=b"x")
    with pytest.raises(LocalProtocolError, match="finite"):
        seal(enc, ALICE, now=float("nan"), nonce=nonce())
    with pytest.raises(LocalProtocolError, match="recipient"):
        seal(enc, ALICE, now=NOW, nonce=nonce(), recipient=b"short")


# ── recipient ────────────────────────────────────────────────────────────────────────────────
NODE_A, NODE_B = Signer.from_seed(b"a" * 32).peer_id, Signer.from_seed(b"b" * 32).peer_id


def test_a_message_sealed_for_node_a_is_refused_by_node_b_with_the_reason() -> None:
    wire = seal(encode(contribution()), ALICE, now=NOW, nonce=nonce(), recipient=NODE_A).tobytes()
    at_b = ReplayWindow()
    with pytest.raises(
        NotAuthorized, match=f"sealed for peer {NODE_A.hex()[:16]}, not for this node"
    ) as exc:
        open_sealed(wire, now=NOW, replay=at_b, max_size=MAX, expected_recipient=NODE_B)
    assert exc.value.status == 403 and NODE_B.hex()[:16] in exc.value.reason
    assert len(at_b) == 0  # refused before it took a place in B's window
    with pytest.raises(NotAuthorized, match="sealed for peer"):
        split_sealed(wire, max_size=MAX, expected_recipient=NODE_B)  # before the body is hashed
    at_a = ReplayWindow()
    opened = open_sealed(wire, now=NOW, replay=at_a, max_size=MAX, expected_recipient=NODE_A)
    assert opened.recipient == NODE_A and opened.message == contribution()
    with pytest.raises(Replay, match="already seen"):  # an exact replay to A is still refused
        open_sealed(wire, now=NOW + 1, replay=at_a, max_size=MAX, expected_recipient=NODE_A)


def test_the_recipient_is_signed() -> None:
    wire = seal(encode(contribution()), ALICE, now=NOW, nonce=nonce(), recipient=NODE_A).tobytes()
    with pytest.raises(BadSignature):  # readdressed without the sender's key
        open_sealed(resign(wire, {6: NODE_B}), now=NOW, replay=ReplayWindow(), max_size=MAX)
    with pytest.raises(BadSignature):  # or made a broadcast
        verify_sealed(resign(wire, {6: b""}), max_size=MAX)


def test_broadcasts_name_nobody_and_are_refused_where_a_recipient_is_required() -> None:
    wire = sealed().tobytes()  # a state, say: re-served by anyone, so bound to no one
    assert verify_sealed(wire, max_size=MAX).recipient == b""
    assert open_sealed(wire, now=NOW, replay=ReplayWindow(), max_size=MAX).recipient == b""
    with pytest.raises(NotAuthorized, match="names no recipient"):
        open_sealed(wire, now=NOW, replay=ReplayWindow(), max_size=MAX, expected_recipient=NODE_B)
    envelope, _ = split_sealed(wire, max_size=MAX)
    envelope.check_recipient(NODE_B, broadcast_ok=True)  # e.g. a DHT Ping to a bare address
    envelope.check_recipient(None)
    reader = SealedReader(MAX)
    reader.feed(wire)
    with pytest.raises(NotAuthorized):
        reader.open(now=NOW, replay=ReplayWindow(), expected_recipient=NODE_A)


def test_digest_covers_head_and_blobs_apart_and_is_the_one_the_envelope_signs() -> None:
    s = sealed()
    whole = s.message.tobytes()
    head, blobs = (
        whole[: s.message.parts[0].nbytes],
        b"".join(bytes(b) for b in s.message.blobs or ()),
    )
    framed = blake3.blake3(
        FRAMED + blake3.blake3(head).digest() + blake3.blake3(blobs).digest()
    ).digest()
    assert message_digest(whole) == framed == s.digest
    assert (
        message_digests(whole).blobs
        == digest_parts(s.message.blobs or ())
        == blake3.blake3(blobs).digest()
    )
    envelope, _ = split_sealed(s.tobytes(), max_size=MAX)
    assert envelope.digest == s.digest


def test_a_state_is_sealed_with_its_content_hash_as_its_blobs_digest() -> None:
    t = tensor(64)
    state = FragmentState(
        swarm="s",
        fragment=0,
        version=3,
        tensors=(t,),
        content_hash=digest_parts([t.data, t.scales]),
    )
    given_digest = seal(
        encode(state), ALICE, now=NOW, nonce=nonce(), blobs_digest=state.content_hash
    )
    assert given_digest.digest == seal(encode(state), ALICE, now=NOW, nonce=nonce(1)).digest
    opened = verify_sealed(given_digest.tobytes(), max_size=MAX)
    assert opened.blobs_digest == state.content_hash  # a receiver checks the field for free
    wrong = seal(encode(state), ALICE, now=NOW, nonce=nonce(2), blobs_digest=bytes(32))
    with pytest.raises(BadSignature, match="content hash mismatch"):
        verify_sealed(wrong.tobytes(), max_size=MAX)
    with pytest.raises(LocalProtocolError, match="blobs_digest"):
        seal(encode(state), ALICE, now=NOW, nonce=nonce(3), blobs_digest=b"short")


def test_a_body_that_is_no_frame_is_digested_whole_and_then_refused_by_the_decoder() -> None:
    body = b"not a message at all"
    digests = message_digests(body)
    assert digests.blobs is None and digests.message == blake3.blake3(RAW + body).digest()
    hand_made = seal(
        Encoded(parts=[memoryview(body)], size=len(body)), ALICE, now=NOW, nonce=nonce()
    )
    with pytest.raises(DecodeError):
        open_sealed(hand_made.tobytes(), now=NOW, replay=ReplayWindow(), max_size=MAX)


def test_padding_between_blobs_is_checked_though_not_hashed() -> None:
    msg = contribution(tensors=(tensor(3), tensor(5)))  # 12-byte fp32 data: padded to 8
    s = sealed(msg)
    wire = bytearray(s.tobytes())
    blobs = {id(b) for b in s.message.blobs or ()}
    offset, pad_at = len(wire) - s.message.size, None
    for i, part in enumerate(s.message.parts):
        if i > 1 and id(part) not in blobs and id(s.message.parts[i - 1]) in blobs:
            pad_at = offset  # padding after a blob
            break
        offset += part.nbytes
    assert pad_at is not None and wire[pad_at] == 0
    wire[pad_at] = 1
    assert (
        message_digests(bytes(wire[len(wire) - s.message.size :])).blobs is None
    )  # not a valid frame
    with pytest.raises(BadSignature):  # no longer a valid frame: digested whole, so no match
        open_sealed(bytes(wire), now=NOW, replay=ReplayWindow(), max_size=MAX)


# ── tampering ────────────────────────────────────────────────────────────────────────────────
def test_tampered_body_is_a_content_hash_mismatch_and_does_not_poison_replay() -> None:
    wire = bytearray(sealed().tobytes())
    wire[-1] ^= 1
    replay = ReplayWindow()
    with pytest.raises(BadSignature, match="content hash mismatch"):
        open_sealed(bytes(wire), now=NOW, replay=replay, max_size=MAX)
    assert len(replay) == 0
    open_sealed(sealed().tobytes(), now=NOW, replay=replay, max_size=MAX)  # still accepted


def test_every_flipped_envelope_byte_is_refused() -> None:
    wire = sealed().tobytes()
    start, end = env_bounds(wire)
    for i in range(end):
        bad = bytearray(wire)
        bad[i] ^= 0x40
        with pytest.raises(RemoteProtocolError):
            open_sealed(bytes(bad), now=NOW, replay=ReplayWindow(), max_size=MAX)
    signature_byte = bytearray(wire)
    signature_byte[end - 1] ^= 1
    with pytest.raises(BadSignature, match="envelope signature"):
        verify_sealed(bytes(signature_byte), max_size=MAX)


def test_envelope_claiming_another_key_is_refused() -> None:
    wire = sealed().tobytes()
    with pytest.raises(BadSignature):
        open_sealed(
            resign(wire, {1: MALLORY.public_key}), now=NOW, replay=ReplayWindow(), max_size=MAX
        )
    # A valid signature by Mallory over a body Alice sealed still opens as Mallory's.
    opened = verify_sealed(resign(wire, {1: MALLORY.public_key}, MALLORY), max_size=MAX)
    assert opened.peer_id == MALLORY.peer_id


@pytest.mark.parametrize(
    ("change", "error", "reason"),
    [
        ({0: 1}, DecodeError, "version"),  # v1 had no recipient
        ({6: b"r"}, DecodeError, "recipient"),
        ({6: 7}, DecodeError, "recipient"),
        ({1: b"k"}, DecodeError, "public key"),
        ({2: 5}, DecodeError, "timestamp"),
        ({2: float("inf")}, DecodeError, "timestamp"),
        ({3: b"short"}, DecodeError, "nonce"),
        ({4: b"d"}, DecodeError, "digest"),
        ({5: -1}, DecodeError, "size"),
        ({5: 1 << 40}, Oversize, "exceeds the cap"),
        ({5: 10}, DecodeError, "envelope says 10"),
    ],
)
def test_bad_envelope_fields(
    change: dict[int, object], error: type[Exception], reason: str
) -> None:
    wire = resign(sealed().tobytes(), change, ALICE)
    with pytest.raises(error, match=reason):
        open_sealed(wire, now=NOW, replay=ReplayWindow(), max_size=MAX)


@pytest.mark.parametrize(
    ("envelope", "error"),
    [
        (b"\xc1", DecodeError),
        (msgpack.packb([b"a"]), DecodeError),
        (msgpack.packb(["a", b"b"]), DecodeError),
        (msgpack.packb([msgpack.packb([1, 2]), b"s"]), DecodeError),
        (msgpack.packb([msgpack.packb({"a": 1}), b"s"]), DecodeError),
        (bytes(MAX_ENVELOPE + 1), Oversize),
    ],
)
def test_malformed_envelopes(envelope: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        open_envelope(envelope, max_size=MAX)


def test_framing_errors() -> None:
    wire = sealed().tobytes()
    replay = ReplayWindow()
    for n in range(len(wire)):
        with pytest.raises(RemoteProtocolError):
            open_sealed(wire[:n], now=NOW, replay=replay, max_size=MAX)
    with pytest.raises(DecodeError, match="envelope says"):
        open_sealed(wire + b"\0", now=NOW, replay=replay, max_size=MAX)
    with pytest.raises(Oversize):
        open_sealed(wire, now=NOW, replay=replay, max_size=100)
    assert len(wire) > 4 + MAX_ENVELOPE + 1
    with pytest.raises(Oversize, match="sealed message"):
        open_sealed(wire, now=NOW, replay=replay, max_size=1)
    with pytest.raises(Oversize):
        envelope_length(struct.pack(">I", MAX_ENVELOPE + 1))
    assert len(replay) == 0


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 255), st.binary(max_size=4))
def test_mutated_sealed_messages_never_open(pos: int, xor: int, extra: bytes) -> None:
    wire = bytearray(sealed().tobytes())
    wire[pos % len(wire)] ^= xor
    with pytest.raises(RemoteProtocolError):
        open_sealed(bytes(wire) + extra, now=NOW, replay=ReplayWindow(), max_size=MAX)


# ── replay window ────────────────────────────────────────────────────────────────────────────
def test_replay_is_refused() -> None:
    wire = sealed().tobytes()
    replay = ReplayWindow()
    open_sealed(wire, now=NOW, replay=replay, max_size=MAX)
    with pytest.raises(Replay, match="already seen"):
        open_sealed(wire, now=NOW + 1, replay=replay, max_size=MAX)
    verify_sealed(wire, max_size=MAX)  # cached re-serving ignores the window
    open_sealed(sealed(n=1).tobytes(), now=NOW, replay=replay, max_size=MAX)
    open_sealed(sealed(signer=MALLORY).tobytes(), now=NOW, replay=replay, max_size=MAX)
    assert len(replay) == 3


@pytest.mark.parametrize("offset", [-61.0, 61.0])
def test_skew_in_both_directions_is_refused(offset: float) -> None:
    wire = sealed(now=NOW + offset).tobytes()
    with pytest.raises(Replay, match="clock skew"):
        open_sealed(wire, now=NOW, replay=ReplayWindow(max_skew_s=60), max_size=MAX)
    open_sealed(wire, now=NOW + offset - 59 * (offset / 61), replay=ReplayWindow(), max_size=MAX)
    assert verify_sealed(wire, max_size=MAX).timestamp == NOW + offset


def test_window_prunes_by_now_and_never_accepts_a_forgotten_message() -> None:
    w = ReplayWindow(max_skew_s=10)
    for i in range(5):
        w.accept(b"k" * 32, nonce(i), NOW + i, now=NOW + i)
    assert len(w) == 5
    w.prune(NOW + 12.5)  # entries at NOW, NOW+1, NOW+2 are older than now - 10
    assert len(w) == 2 and w.floor == NOW + 2
    with pytest.raises(Replay, match="floor"):
        w.accept(b"k" * 32, nonce(2), NOW + 2, now=NOW + 3)  # clock stepped back
    w.accept(b"k" * 32, nonce(9), NOW + 12, now=NOW + 13.5)
    assert len(w) == 2  # NOW+3 pruned on the way


def test_window_memory_is_bounded_by_capacity() -> None:
    w = ReplayWindow(max_skew_s=60, capacity=3)
    for i in range(10):
        w.accept(b"k" * 32, nonce(i), NOW + i, now=NOW + 10)
        assert len(w) <= 3
    assert w.floor_of(b"k" * 32) == NOW + 6  # this key's own floor: nobody else's moved
    assert w.floor == -math.inf and w.floor_of(b"j" * 32) == -math.inf
    with pytest.raises(Replay, match="floor"):
        w.accept(b"k" * 32, nonce(0), NOW, now=NOW + 10)  # evicted early, still refused
    with pytest.raises(Replay, match="already seen"):
        w.accept(b"k" * 32, nonce(9), NOW + 9, now=NOW + 10)
    with pytest.raises(LocalProtocolError):
        ReplayWindow(capacity=0)
    with pytest.raises(LocalProtocolError):
        ReplayWindow(max_skew_s=0)


# ── streaming receive ────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 20])
def test_sealed_reader_in_chunks(chunk: int) -> None:
    s = sealed()
    wire = s.tobytes()
    reader = SealedReader(MAX)
    for i in range(0, len(wire), chunk):
        assert not reader.done
        reader.feed(wire[i : i + chunk])
    assert reader.done and reader.envelope is not None
    assert reader.envelope.size == s.message.size
    opened = reader.open(now=NOW, replay=ReplayWindow())
    assert opened.message == contribution(tensors=(tensor(64),))
    assert reader.verify().message == opened.message
    assert reader.buffer is not None and len(reader.buffer) == s.message.size


def test_sealed_reader_verifies_envelope_before_allocating_the_body() -> None:
    wire = sealed().tobytes()
    _, end = env_bounds(wire)
    forged = bytearray(wire)
    forged[end - 1] ^= 1  # signature
    reader = SealedReader(MAX)
    with pytest.raises(BadSignature):
        reader.feed(bytes(forged[: end + 10]))
    assert reader.buffer is None and reader.envelope is None

    small = SealedReader(100)
    with pytest.raises(Oversize):
        small.feed(wire[:end])
    assert small.buffer is None

    incomplete = SealedReader(MAX)
    incomplete.feed(wire[: end + 3])
    assert incomplete.envelope is not None and not incomplete.done
    with pytest.raises(LocalProtocolError, match="incomplete"):
        incomplete.open(now=NOW, replay=ReplayWindow())
    with pytest.raises(DecodeError, match="longer than"):
        incomplete.feed(wire[end + 3 :] + b"x")


def test_sealed_reader_tampered_body_and_empty_envelope() -> None:
    wire = bytearray(sealed().tobytes())
    wire[-2] ^= 1
    reader = SealedReader(MAX)
    reader.feed(bytes(wire))
    replay = ReplayWindow()
    with pytest.raises(BadSignature, match="content hash"):
        reader.open(now=NOW, replay=replay)
    assert len(replay) == 0
    with pytest.raises(DecodeError):
        SealedReader(MAX).feed(struct.pack(">I", 0) + b"rest")


def test_split_sealed_names_the_signer_before_the_body_is_looked_at() -> None:
    from protocol.wire.signing import split_sealed

    wire = bytearray(sealed().tobytes())
    wire[-1] ^= 0xFF  # a tampered body: the envelope still verifies, the body is not hashed yet
    envelope, body = split_sealed(bytes(wire), max_size=MAX)
    assert envelope.peer_id == ALICE.peer_id == peer_id_from_public_key(envelope.public_key)
    assert body.nbytes == envelope.size
    replay = ReplayWindow()
    with pytest.raises(BadSignature, match="content hash"):
        envelope.open_body(body, now=NOW, replay=replay)
    assert len(replay) == 0  # a body that fails its hash takes no place in the window
