"""topk2: round trips, wire sizes, golden layout, error feedback, hostile remote bytes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from protocol.diloco.compression import compress, decompress, wire_bytes
from protocol.errors import DecodeError, LocalProtocolError
from protocol.wire.codec import decode, encode
from protocol.wire.messages import Contribution
from protocol.wire.tensors import TOPK_CHUNK, EncodedTensor

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

F32_MAX = torch.finfo(torch.float32).max


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chunks(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.reshape(-1).split(TOPK_CHUNK))


def kept_per_chunk(length: int, block: int) -> int:
    return -(-length // block)


def topk2(shape: tuple[int, ...], block: int, data: bytes, scales: bytes) -> EncodedTensor:
    return EncodedTensor(
        codec="topk2", shape=shape, dtype="float32", block_size=block, data=data, scales=scales
    )


def u16(*values: int) -> bytes:
    return b"".join(v.to_bytes(2, "little") for v in values)


def f32(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("n", [1, 2, 63, 4095, 4096, 4097, 10_000])
@pytest.mark.parametrize("block", [1, 7, 64, 4096])
def test_round_trip_keeps_the_largest_of_each_chunk(n: int, block: int) -> None:
    t = torch.randn(n, generator=gen(n + block))
    enc, residual = compress(t, "topk2", block_size=block)
    out = decompress(enc)
    assert out.dtype == torch.float32 and out.shape == t.shape
    assert torch.equal(residual, t - out)
    assert enc.nbytes == wire_bytes(n, "topk2", block)
    for x, y in zip(chunks(t), chunks(out), strict=True):
        k = kept_per_chunk(x.numel(), block)
        top = set(x.abs().topk(k).indices.tolist())
        sent = set(torch.nonzero(y).reshape(-1).tolist())
        assert sent == top  # no ties in random normals; a kept value never decodes to 0 (step > 0)
        absmax = float(x.abs().max())
        assert float((x - y)[list(top)].abs().max()) <= absmax / 4 * (1 + 2**-20)


def test_golden_layout() -> None:
    t = torch.tensor([0.0, -4.0, 1.0, 3.0])
    enc, residual = compress(t, "topk2", block_size=2)  # keeps ceil(4 / 2) = 2: -4 and 3
    assert (enc.codec, enc.block_size) == ("topk2", 2)
    assert bytes(enc.data) == u16(1, 3) + bytes([0 | 3 << 2])  # codes 0 (-1.5 s) and 3 (+1.5 s)
    assert bytes(enc.scales) == f32(2.0)  # step = absmax / 2
    assert decompress(enc).tolist() == [0.0, -3.0, 0.0, 3.0]
    assert residual.tolist() == [0.0, -1.0, 1.0, 0.0]


def test_sizes_and_density() -> None:
    assert wire_bytes(0, "topk2", 64) == 0
    assert wire_bytes(4096, "topk2", 64) == 64 * 2 + 16 + 4
    assert wire_bytes(4097, "topk2", 64) == (64 + 1) * 2 + 17 + 8
    assert wire_bytes(1 << 20, "topk2", 50) / (1 << 20) < 0.05  # vs 1.06 bytes for int8
    with pytest.raises(LocalProtocolError, match="block_size"):
        wire_bytes(10, "topk2", TOPK_CHUNK + 1)


def test_shapes_dtypes_and_out() -> None:
    t = torch.randn(3, 50, 40, generator=gen(1)).to(torch.bfloat16)
    enc, residual = compress(t, "topk2", block_size=16)
    assert enc.shape == (3, 50, 40) and enc.dtype == "bfloat16" and residual.dtype == torch.float32
    expected = decompress(enc)
    assert torch.equal(expected + residual, t.float())
    strided = torch.empty(40, 50, 3).permute(2, 1, 0)
    assert torch.equal(decompress(enc, out=strided), expected)
    half = torch.empty(3, 50, 40, dtype=torch.float16)
    assert torch.equal(decompress(enc, out=half), expected.half())
    empty, _ = compress(torch.empty(0, 5), "topk2")
    assert empty.nbytes == 0 and decompress(empty).shape == (0, 5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=300),
    st.integers(1, 80),
)
def test_residual_identity_for_arbitrary_values(values: list[float], block: int) -> None:
    t = torch.tensor(values, dtype=torch.float32)
    enc, residual = compress(t, "topk2", block_size=block)
    out = decompress(enc)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(residual, t - out)
    assert int((out != 0).sum()) <= kept_per_chunk(len(values), block)


def test_travels_in_a_contribution() -> None:
    enc, _ = compress(torch.randn(5000, generator=gen(2)), "topk2", block_size=50)
    msg = Contribution(
        swarm="s",
        fragment=0,
        base_version=0,
        base_digest=bytes(32),
        tokens=1,
        steps=1,
        step_time=0.1,
        sender_step=0,
        tensors=(enc,),
    )
    back = decode(encode(msg).tobytes(), max_size=1 << 20)
    assert isinstance(back, Contribution)
    assert torch.equal(decompress(back.tensors[0]), decompress(enc))


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("block", [50, 64])
def test_error_feedback_converges(block: int) -> None:
    """A drifting signal in noise: the residual stays bounded, so the running sum of what was
    sent approaches the running sum of the inputs."""
    g = gen(3)
    signal = torch.randn(8192, generator=g) * 0.01
    residual, sent, total = torch.zeros(8192), torch.zeros(8192), torch.zeros(8192)
    gaps, owed = {}, {}
    for rnd in range(1, 401):
        x = signal + torch.randn(8192, generator=g) * 0.01
        x_before, r_before = x.clone(), residual.clone()
        enc, new = compress(x, "topk2", block_size=block, residual=residual)
        assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # no mutation
        sent += decompress(enc)
        total += x
        residual = new
        if rnd in (100, 200, 400):
            gaps[rnd] = float((sent - total).norm() / total.norm())
            owed[rnd] = float(residual.norm())
    assert torch.allclose(sent + residual, total, atol=1e-4)  # nothing lost, only delayed
    assert owed[400] < 1.15 * owed[200]  # bounded, while the total keeps growing
    assert gaps[400] < 0.6 * gaps[100] and gaps[400] < 0.15


# ---------------------------------------------------------------- local misuse


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_local_input_is_refused(bad: float) -> None:
    t = torch.ones(5000)
    t[4500] = bad
    with pytest.raises(LocalProtocolError, match="tensor to compress"):
        compress(t, "topk2")
    with pytest.raises(LocalProtocolError, match="residual"):
        compress(torch.ones(5000), "topk2", residual=t)
    big = torch.full((3,), 3e38)
    with pytest.raises(LocalProtocolError, match="overflows"):
        compress(big, "topk2", residual=big)


@pytest.mark.parametrize("block", [0, -1, TOPK_CHUNK + 1])
def test_bad_block_size_is_refused(block: int) -> None:
    with pytest.raises(LocalProtocolError, match="block_size"):
        compress(torch.ones(4), "topk2", block_size=block)
    with pytest.raises(DecodeError, match="block_size"):
        topk2((4,), block, b"", b"")


# ---------------------------------------------------------------- hostile remote bytes


@pytest.mark.parametrize(
    ("shape", "block", "data", "scales", "reason"),
    [
        ((4,), 2, u16(3, 1) + b"\x00", f32(1.0), "increase"),  # out of order
        ((4,), 2, u16(2, 2) + b"\x00", f32(1.0), "increase"),  # duplicate
        ((4,), 2, u16(1, 4) + b"\x00", f32(1.0), "increase"),  # past the chunk's end
        ((4,), 2, u16(1, 0xFFFF) + b"\x00", f32(1.0), "increase"),  # sign bit of uint16
        ((4097,), 4096, u16(5, 1) + b"\x00", f32(1.0, 1.0), "increase"),  # tail has 1 element
        ((4,), 2, u16(0, 1) + b"\x10", f32(1.0), "padding"),  # a third code in the padding
        ((4,), 2, u16(0, 1) + b"\x00", f32(math.nan), "steps"),
        ((4,), 2, u16(0, 1) + b"\x00", f32(-1.0), "steps"),
        ((4,), 2, u16(0, 1) + b"\x00", f32(math.inf), "steps"),
        ((4,), 2, u16(0, 1) + b"\x00", f32(F32_MAX), "steps"),  # 1.5 * step overflows
        ((4097,), 4096, u16(1, 0) + b"\x00", f32(1.0, -1.0), "steps"),  # the tail's step
    ],
)
def test_hostile_encodings_are_refused_before_writing(
    shape: tuple[int, ...], block: int, data: bytes, scales: bytes, reason: str
) -> None:
    enc = topk2(shape, block, data, scales)
    out = torch.full(shape, 9.0)
    with pytest.raises(DecodeError, match=reason):
        decompress(enc)
    with pytest.raises(DecodeError, match=reason):
        decompress(enc, out=out)
    assert bool((out == 9.0).all())  # untouched


@pytest.mark.parametrize(
    ("shape", "data", "scales"),
    [
        ((4,), u16(0, 1), f32(1.0)),  # codes missing
        ((4,), u16(0, 1) + b"\x00\x00", f32(1.0)),  # one byte too many
        ((4,), u16(0, 1, 2) + b"\x00", f32(1.0)),  # a third position
        ((4,), u16(0, 1) + b"\x00", f32(1.0, 1.0)),  # a step for a chunk that is not there
        ((4,), u16(0, 1) + b"\x00", b""),
        ((1 << 31, 2), u16(0, 1) + b"\x00", f32(1.0)),  # more elements than any tensor may have
    ],
)
def test_wrong_lengths_are_refused_on_construction(
    shape: tuple[int, ...], data: bytes, scales: bytes
) -> None:
    with pytest.raises(DecodeError):
        topk2(shape, 2, data, scales)


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(1, 9000), st.integers(1, 200))
def test_random_bytes_decode_finitely_or_are_refused(
    data: st.DataObject, n: int, block: int
) -> None:
    k_full, k_tail = kept_per_chunk(TOPK_CHUNK, block), kept_per_chunk(n % TOPK_CHUNK, block)
    kept = n // TOPK_CHUNK * k_full + k_tail
    n_chunks = -(-n // TOPK_CHUNK)
    g = gen(data.draw(st.integers(0, 1 << 30)))
    if data.draw(st.booleans()):  # anything (seeded: at block 1 up to 9,000 of them, more than a
        # Hypothesis list may hold)
        positions = torch.randint(0, 1 << 16, (kept,), generator=g).tolist()
    else:  # well-formed positions, so the values themselves are what is hostile
        lengths = [TOPK_CHUNK] * (n // TOPK_CHUNK) + [n % TOPK_CHUNK] * (n % TOPK_CHUNK > 0)
        positions = [
            p
            for length in lengths
            for p in sorted(
                torch.randperm(length, generator=g)[: kept_per_chunk(length, block)].tolist()
            )
        ]
    codes = data.draw(st.binary(min_size=(kept + 3) // 4, max_size=(kept + 3) // 4))
    steps = data.draw(st.lists(st.floats(width=32), min_size=n_chunks, max_size=n_chunks))
    enc = topk2((n,), block, u16(*positions) + codes, f32(*steps))
    try:
        out = decompress(enc)
    except DecodeError:
        event("refused")
        return
    event("decoded")
    assert bool(torch.isfinite(out).all())
    assert int((out != 0).sum()) <= kept
