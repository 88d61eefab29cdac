"""The codec: framing, zero-copy blobs, chunking, strictness on hostile input, BodyReader."""

from __future__ import annotations

import contextlib
import re
import struct
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import DecodeError, LocalProtocolError, Oversize, RemoteProtocolError
from protocol.wire.codec import (
    ALIGN,
    MAGIC,
    BodyReader,
    Encoded,
    byte_view,
    chunk_views,
    decode,
    encode,
)
from protocol.wire.messages import CAPS, Ack, Contribution, Hello, Message, PeerInfo
from protocol.wire.tensors import EncodedTensor
from tests.protocol.test_messages import contribution, messages, tensor

MAX = 1 << 20


def samples() -> list[bytes]:
    """Small valid encodings of every shape of message."""
    t8 = EncodedTensor(
        codec="int8",
        shape=(3, 3),
        dtype="float32",
        block_size=4,
        data=b"\x01" * 9,
        scales=b"\x02" * 12,
    )
    hello = Hello(
        swarm="s", peer=PeerInfo(peer_id=b"p" * 32, address="http://h:1"), roles=("owner",), step=7
    )
    return [
        encode(contribution(tensors=(t8, tensor(1)))).tobytes(),
        encode(hello).tobytes(),
        encode(Ack(accepted=True, reason="ok", version=3)).tobytes(),
    ]


def frame(header: object, blobs: list[bytes] = [], *, raw_header: bytes | None = None) -> bytes:  # noqa: B006
    """A hand-made message: our framing around an arbitrary header."""
    h = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
    out = bytearray(struct.pack(">4sBI", MAGIC, 1, len(h)) + h)
    for b in blobs:
        out += bytes(-len(out) % ALIGN) + b
    return bytes(out)


ACK_FIELDS = {"accepted": True, "reason": "r", "version": 1}
T_FIELDS = {
    "codec": "none",
    "shape": [1],
    "dtype": "float32",
    "block_size": 0,
    "data": 0,
    "scales": 1,
}


def contribution_header(tensors: list[object], blob_lengths: list[int]) -> list[object]:
    fields = {
        "swarm": "s",
        "fragment": 0,
        "base_version": 0,
        "base_digest": bytes(32),
        "tokens": 1,
        "steps": 1,
        "step_time": 0.5,
        "sender_step": 1,
        "tensors": tensors,
        "last": False,
    }
    return [1, fields, blob_lengths]


def assert_remote_error(buf: bytes, max_size: int = MAX) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        decode(buf, max_size=max_size)
    return info.value


# ── framing and zero copy ────────────────────────────────────────────────────────────────────
def test_hand_made_frame_matches_encoder() -> None:
    ack = Ack(accepted=True, reason="r", version=1)
    assert frame([4, ACK_FIELDS, []]) == encode(ack).tobytes()
    good = frame(contribution_header([[1, T_FIELDS]], [4, 0]), [b"\0\0\x80?", b""])
    assert decode(good, max_size=MAX) == contribution(
        tensors=(
            EncodedTensor(
                codec="none",
                shape=(1,),
                dtype="float32",
                block_size=0,
                data=b"\0\0\x80?",
                scales=b"",
            ),
        )
    )


def test_a_contributions_last_mark_must_be_a_bool() -> None:
    """The end-of-run mark makes an owner's round wait: anything but a bool is malformed."""
    header = contribution_header([[1, T_FIELDS]], [4, 0])
    assert isinstance(header[1], dict)
    header[1]["last"] = 1
    with pytest.raises(DecodeError, match="^Contribution.last: expected bool, got int$") as bad:
        decode(frame(header, [b"\0\0\x80?", b""]), max_size=MAX)
    assert bad.value.__context__ is None  # decoded again to name the place, not re-raised
    header[1]["last"] = True
    assert decode(frame(header, [b"\0\0\x80?", b""]), max_size=MAX).last is True


def test_large_blobs_are_not_copied_either_way() -> None:
    array = np.arange(1 << 18, dtype=np.float32)
    t = EncodedTensor(
        codec="none",
        shape=(1 << 18,),
        dtype="float32",
        block_size=0,
        data=memoryview(array).cast("B"),
        scales=b"",
    )
    enc = encode(contribution(tensors=(t,)))
    assert any(np.shares_memory(np.asarray(p), array) for p in enc.parts)
    assert enc.size == sum(p.nbytes for p in enc.parts) == len(enc.tobytes())

    wire = bytearray(enc.tobytes())
    back = decode(wire, max_size=MAX * 2)
    assert isinstance(back, Contribution)
    data = back.tensors[0].data
    assert isinstance(data, memoryview) and data.obj is wire
    assert np.shares_memory(
        np.frombuffer(data, dtype=np.uint8), np.frombuffer(wire, dtype=np.uint8)
    )
    assert np.array_equal(np.frombuffer(data, dtype=np.float32), array)


@settings(max_examples=30, deadline=None)
@given(messages())
def test_blobs_start_aligned(msg: Message) -> None:
    enc = encode(msg)
    offset = 0
    for part in enc.parts[1:]:
        offset += enc.parts[0].nbytes if offset == 0 else 0
        assert offset % ALIGN == 0 or part.nbytes < ALIGN  # padding parts are < ALIGN
        offset += part.nbytes
    wire = bytearray(enc.tobytes())
    base = np.frombuffer(wire, dtype=np.uint8).ctypes.data
    back = decode(wire, max_size=MAX)
    for t in getattr(back, "tensors", ()):
        for blob in (t.data, t.scales):
            if blob.nbytes:
                assert (np.frombuffer(blob, dtype=np.uint8).ctypes.data - base) % ALIGN == 0


@settings(max_examples=40, deadline=None)
@given(messages(), st.integers(1, 300))
def test_iter_chunks_is_bounded_and_reassembles(msg: Message, chunk_size: int) -> None:
    enc = encode(msg)
    chunks = list(enc.iter_chunks(chunk_size))
    assert all(0 < c.nbytes <= chunk_size for c in chunks)
    assert b"".join(chunks) == enc.tobytes()


def test_chunks_of_a_large_part_are_views() -> None:
    big = memoryview(bytearray(10_000_000))
    chunks = list(chunk_views([memoryview(b"head"), big, memoryview(b"tail")], 1 << 20))
    assert [c.nbytes for c in chunks] == [4] + [1 << 20] * 9 + [10_000_000 - 9 * (1 << 20), 4]
    assert all(c.obj is big.obj for c in chunks[1:-1])
    with pytest.raises(LocalProtocolError):
        list(chunk_views([big], 0))


def test_encode_refuses_local_misuse() -> None:
    class Unregistered(Ack):
        __slots__ = ()

    with pytest.raises(LocalProtocolError, match="not a registered message"):
        encode(Unregistered(accepted=True, reason="", version=0))
    listy = EncodedTensor(
        codec="none", shape=[1], dtype="float32", block_size=0, data=bytes(4), scales=b""
    )  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="expected a tuple"):
        encode(contribution(tensors=(listy,)))
    strided = memoryview(bytes(8))[::2]
    odd = EncodedTensor(
        codec="int8", shape=(4,), dtype="float32", block_size=4, data=strided, scales=bytes(4)
    )
    with pytest.raises(LocalProtocolError, match="not C-contiguous"):
        encode(contribution(tensors=(odd,)))
    bad_scale = EncodedTensor(
        codec="none", shape=(1,), dtype="float32", block_size=0, data=bytes(4), scales=b""
    )
    object.__setattr__(bad_scale, "scales", 5)
    with pytest.raises(
        LocalProtocolError, match=r"^cannot encode: Contribution.tensors\[0\].scales: .*bytes-like"
    ):
        encode(contribution(tensors=(bad_scale,)))


# ── hostile input ────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("wire", samples())
def test_every_prefix_and_appended_garbage_is_a_remote_error(wire: bytes) -> None:
    assert isinstance(decode(wire, max_size=MAX), Message)
    for n in range(len(wire)):
        assert_remote_error(wire[:n])
    for garbage in (b"\0", b"\x01" * 7, b"\0" * 8, wire):
        err = assert_remote_error(wire + garbage)
        assert isinstance(err, DecodeError)
    assert isinstance(assert_remote_error(wire, max_size=len(wire) - 1), Oversize)


def test_byte_by_byte_body_reader_then_decode() -> None:
    for wire in samples():
        reader = BodyReader(MAX)
        reader.expect(len(wire))
        for i in range(len(wire)):
            assert not reader.done
            reader.feed(wire[i : i + 1])
        assert reader.done and decode(reader.view(), max_size=MAX) == decode(wire, max_size=MAX)


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (b"XXXX\x01\0\0\0\0", "bad magic"),
        (MAGIC + b"\x02\0\0\0\0", "format version"),
        (MAGIC + b"\x01\xff\xff\xff\xff", "header of"),
        (frame([99, {}, []]), "unknown message type code 99"),
        (frame([True, ACK_FIELDS, []]), "unknown message type"),
        (frame([4, ACK_FIELDS]), "header is not"),
        (frame({"a": 1}), "header is not"),
        (frame([4, [1, 2], []]), "fields must be a map"),
        (frame([4, {**ACK_FIELDS, "extra": 1}, []]), "unknown fields \\['extra'\\]"),
        (frame([4, {"accepted": True, "reason": "r"}, []]), "missing fields \\['version'\\]"),
        (frame([4, {**ACK_FIELDS, "version": 1.0}, []]), "expected int, got float"),
        (frame([4, {**ACK_FIELDS, "accepted": 1}, []]), "expected bool"),
        (frame([4, {**ACK_FIELDS, "reason": b"r"}, []]), "expected str"),
        (frame([4, {**ACK_FIELDS, "version": -7}, []]), ">= -1"),
        (frame([4, ACK_FIELDS, [1]], [b"x"]), "not referenced"),
        (frame([4, ACK_FIELDS, ["1"]], [b"x"]), "bad blob length"),
        (frame([4, ACK_FIELDS, 5]), "blob lengths"),
        (frame([4, ACK_FIELDS, [-1]]), "bad blob length"),
        (frame([4, ACK_FIELDS, []]) + b"\0", "trailing"),
        (frame([4, ACK_FIELDS, [8]], [b"x" * 4]), "truncated or bad blob length"),
        (frame([4, msgpack.ExtType(1, b"x"), []]), "max_ext_len"),
        (frame(None, raw_header=b"\x93\x04\x83\xa1a\x01\xa1a\x02\xa1b\x03\x90"), "duplicate key"),
        (frame(None, raw_header=b"\x93\x04\x81\x01\x02\x90"), "map key"),
        (frame(None, raw_header=b"\x93\x04\x80\x90\xc1"), "malformed"),
        (frame(None, raw_header=b"\xa2\xff\xfe"), "malformed"),
        (frame(None, raw_header=b"\x91" * 5000), "malformed"),
        (frame([4, {**ACK_FIELDS, "reason": "x" * (CAPS.max_str + 1)}, []]), "malformed"),
        (
            frame(contribution_header([[1, T_FIELDS]], [4, 0]), [b"abcd", b""])[:-1] + b"",
            "truncated",
        ),
        (
            frame(
                contribution_header([[1, {**T_FIELDS, "data": 1, "scales": 0}]], [4, 0]),
                [b"abcd", b""],
            ),
            "out of order",
        ),
        (
            frame(contribution_header([[1, {**T_FIELDS, "data": "0"}]], [4, 0]), [b"abcd", b""]),
            "blob reference",
        ),
        (
            frame(contribution_header([[2, T_FIELDS]], [4, 0]), [b"abcd", b""]),
            "struct code 2 not allowed",
        ),
        (
            frame(contribution_header([[1, T_FIELDS, 3]], [4, 0]), [b"abcd", b""]),
            "must be \\[struct_code",
        ),
        (
            frame(contribution_header([[1, {**T_FIELDS, "shape": 1}]], [4, 0]), [b"abcd", b""]),
            "expected an array",
        ),
        (
            frame(contribution_header([[1, {**T_FIELDS, "codec": "zip"}]], [4, 0]), [b"abcd", b""]),
            "unknown tensor codec",
        ),
        (frame(contribution_header([[1, T_FIELDS]], [3, 0]), [b"abc", b""]), "needs 4 data bytes"),
        (
            frame(contribution_header([[1, {**T_FIELDS, "shape": [-1]}]], [4, 0]), [b"abcd", b""]),
            "bad tensor shape",
        ),
    ],
)
def test_malformed_headers_are_decode_errors(wire: bytes, reason: str) -> None:
    err = assert_remote_error(wire)
    assert isinstance(err, DecodeError | Oversize)
    assert re.search(reason, err.reason), err.reason


def test_nonzero_padding_is_refused() -> None:
    wire = bytearray(frame(contribution_header([[1, T_FIELDS]], [4, 0]), [b"abcd", b""]))
    pad_at = wire.index(b"abcd") - 1
    assert wire[pad_at] == 0
    wire[pad_at] = 1
    assert "padding" in assert_remote_error(bytes(wire)).reason


def test_non_contiguous_input_is_a_decode_error() -> None:
    wire = samples()[2]
    strided = memoryview(np.frombuffer(wire * 2, dtype=np.uint8)[::2])
    assert isinstance(assert_remote_error(strided), DecodeError)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_remote_errors(junk: bytes) -> None:
    assert_remote_error(junk)
    assert_remote_error(struct.pack(">4sBI", MAGIC, 1, len(junk)) + junk)


mutations: st.SearchStrategy[Callable[[bytes], bytes]] = st.one_of(
    st.tuples(st.integers(0, 10_000), st.integers(1, 255)).map(
        lambda p: (
            lambda w: w[: p[0] % len(w)] + bytes([w[p[0] % len(w)] ^ p[1]]) + w[p[0] % len(w) + 1 :]
        )
    ),
    st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=8)).map(
        lambda p: lambda w: w[: p[0] % len(w)] + p[1] + w[p[0] % len(w) :]
    ),
    st.tuples(st.integers(0, 10_000), st.integers(1, 8)).map(
        lambda p: lambda w: w[: p[0] % len(w)] + w[p[0] % len(w) + p[1] :]
    ),
)


@settings(max_examples=150, deadline=None)
@given(messages(), st.lists(mutations, min_size=1, max_size=3))
def test_mutated_encodings_decode_or_raise_remote_errors(
    msg: Message, muts: list[Callable[[bytes], bytes]]
) -> None:
    wire = encode(msg).tobytes()
    for mutate in muts:
        wire = mutate(wire)
    with contextlib.suppress(RemoteProtocolError):
        decode(wire, max_size=MAX)


# ── BodyReader ───────────────────────────────────────────────────────────────────────────────
def test_body_reader_reuses_its_buffer_and_refuses_overruns() -> None:
    buf = bytearray(64)
    reader = BodyReader(100, buf)
    reader.expect(10)
    reader.feed(b"0123")
    with pytest.raises(LocalProtocolError, match="incomplete"):
        reader.view()
    reader.feed(memoryview(b"456789"))
    assert reader.done and reader.view() == b"0123456789" and reader.view().obj is buf
    assert reader.buffer is buf and (reader.expected, reader.received) == (10, 10)
    with pytest.raises(DecodeError, match="longer than"):
        reader.feed(b"x")
    with pytest.raises(LocalProtocolError, match="already declared"):
        reader.expect(3)
    bigger = BodyReader(1000, buf)
    bigger.expect(100)
    assert bigger.buffer is not buf and len(bigger.buffer or b"") == 100


def test_body_reader_refuses_oversize_before_allocating() -> None:
    reader = BodyReader(1000)
    with pytest.raises(Oversize):
        reader.expect(1 << 40)
    assert reader.buffer is None
    with pytest.raises(DecodeError, match="negative"):
        BodyReader(10).expect(-1)
    with pytest.raises(LocalProtocolError):
        BodyReader(-1)
    prefixed = BodyReader(1000)
    with pytest.raises(Oversize):
        prefixed.feed(struct.pack(">Q", 1 << 50))
    assert prefixed.buffer is None


def test_body_reader_length_prefix_byte_by_byte() -> None:
    wire = samples()[0]
    stream = struct.pack(">Q", len(wire)) + wire
    reader = BodyReader(MAX)
    for i in range(len(stream)):
        reader.feed(stream[i : i + 1])
    assert reader.expected == len(wire) and reader.done
    assert decode(reader.view(), max_size=MAX) == decode(wire, max_size=MAX)
    whole = BodyReader(MAX)
    whole.feed(stream)
    assert whole.view() == wire


def test_encoded_is_a_plain_record() -> None:
    enc = encode(Ack(accepted=False, reason="", version=-1))
    assert isinstance(enc, Encoded) and enc.parts[0].nbytes == enc.size


def test_byte_view_flattens_typed_buffers() -> None:
    grid = np.zeros((2, 3), dtype=np.float16)
    mv = byte_view(memoryview(grid))
    assert (mv.format, mv.ndim, mv.nbytes) == ("B", 1, 12)
