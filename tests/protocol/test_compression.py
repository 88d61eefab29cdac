"""Tensor codecs: round trips, documented error bounds, error feedback, hostile remote bytes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.compression import QMAX, compress, decompress, wire_bytes
from protocol.errors import DecodeError, LocalProtocolError
from protocol.wire.tensors import EncodedTensor

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

CODECS = ("none", "bf16", "int8", "int4")
F32_TINY = 2.0**-149  # smallest fp32 subnormal


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def within_bound(x: torch.Tensor, y: torch.Tensor, codec: str, block_size: int) -> bool:
    """The module docstring's per-element bound, plus fp32 rounding slack."""
    x, y = x.reshape(-1).double(), y.reshape(-1).double()
    err = (x - y).abs()
    if codec == "none":
        return bool((err == 0).all())
    if codec == "bf16":
        return bool((err <= 2.0**-8 * x.abs() + 2.0**-134).all())
    n = x.numel()
    pad = -n % block_size
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block_size).amax(1)
    per_elem = absmax.repeat_interleave(block_size)[:n]
    bound = per_elem / (2 * QMAX[codec]) * (1 + 2.0**-20) + 130 * F32_TINY
    return bool((err <= bound).all())


# ---------------------------------------------------------------- round trips and bounds


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 63, 64, 65, 127, 1000])
def test_round_trip_sizes_and_residual(codec: str, n: int) -> None:
    t = torch.randn(n, generator=gen(n))
    enc, residual = compress(t, codec, block_size=16)
    out = decompress(enc)
    assert out.dtype == torch.float32 and out.shape == t.shape
    assert torch.equal(residual, t - out)
    assert within_bound(t, out, codec, 16)
    assert enc.nbytes == wire_bytes(n, codec, 16)


@pytest.mark.parametrize("codec", CODECS)
def test_zero_dim_and_non_contiguous(codec: str) -> None:
    scalar = torch.tensor(-2.5)
    enc, _ = compress(scalar, codec)
    assert enc.shape == () and decompress(enc).shape == ()
    assert float(decompress(enc)) == pytest.approx(-2.5, rel=2**-7)
    base = torch.randn(6, 7, generator=gen(1))
    t = base.t()[::2]
    assert not t.is_contiguous()
    enc, residual = compress(t, codec, block_size=5)
    assert enc.shape == (4, 6)
    assert torch.equal(decompress(enc) + residual, t)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("scale", [1e30, 1.0, 1e-30, 1e-40, 3e-45])
def test_error_bounds_across_magnitudes(codec: str, scale: float) -> None:
    t = torch.randn(1000, generator=gen(2)) * scale
    t[:64] = 0.0  # an all-zero block: scale 0, no division by zero
    enc, residual = compress(t, codec, block_size=64)
    out = decompress(enc)
    assert bool(torch.isfinite(out).all())
    assert within_bound(t, out, codec, 64)
    assert bool((out[:64] == 0).all())
    assert torch.equal(residual, t - out)


def test_bound_is_tight_for_int8_midpoints() -> None:
    t = torch.tensor([127.0, 0.5, 1.5, -0.5])  # scale 1: midpoints round to even
    out = decompress(compress(t, "int8")[0])
    assert out.tolist() == [127.0, 0.0, 2.0, -0.0]
    assert float((t - out).abs().max()) == 0.5 == 127 / 254


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=0, max_size=300),
    st.sampled_from(CODECS),
    st.integers(1, 80),
)
def test_bounds_hold_for_arbitrary_values(values: list[float], codec: str, block: int) -> None:
    t = torch.tensor(values, dtype=torch.float32)
    enc, residual = compress(t, codec, block_size=block)
    out = decompress(enc)
    assert within_bound(t, out, codec, block)
    assert torch.equal(residual, t - out)


# ---------------------------------------------------------------- wire layout (golden bytes)


def test_int8_layout() -> None:
    enc, _ = compress(torch.tensor([254.0, -127.0, 1.0, 0.0, 3.0]), "int8", block_size=4)
    assert bytes(enc.data) == bytes([127, 0xC0, 0, 0, 127])  # -63.5 rounds to even: -64
    assert torch.frombuffer(bytearray(enc.scales), dtype=torch.float32).tolist() == [
        2.0,
        pytest.approx(3 / 127, rel=1e-7),
    ]


def test_int4_layout_odd_count() -> None:
    enc, _ = compress(torch.tensor([7.0, -7.0, 0.0]), "int4")
    assert bytes(enc.data) == bytes([0x1F, 0x88])  # nibbles 15, 1 | 8, pad 8
    assert torch.frombuffer(bytearray(enc.scales), dtype=torch.float32).tolist() == [1.0]
    assert decompress(enc).tolist() == [7.0, -7.0, 0.0]


def test_records_dtype_and_block_size() -> None:
    for dtype, name in [
        (torch.float32, "float32"),
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
    ]:
        enc, residual = compress(torch.ones(3, dtype=dtype), "int8", block_size=2)
        assert (enc.dtype, enc.block_size, enc.codec) == (name, 2, "int8")
        assert residual.dtype == torch.float32
    assert compress(torch.ones(3), "bf16")[0].block_size == 0


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_error_feedback_keeps_the_running_sum(codec: str) -> None:
    t = torch.randn(200, generator=gen(3)) * 1e-3 + 0.01
    t_before = t.clone()
    residual = torch.zeros(200)
    sent = torch.zeros(200)
    for _ in range(50):
        r_before = residual.clone()
        enc, new = compress(t, codec, residual=residual)
        assert torch.equal(residual, r_before) and torch.equal(t, t_before)  # no mutation
        sent += decompress(enc)
        residual = new
    # what was sent plus what is still owed equals everything that was meant to be sent
    assert torch.allclose(sent + residual, 50 * t, rtol=1e-5, atol=1e-6)
    assert float(residual.abs().max()) <= float(t.abs().max())


def test_none_is_exact_and_independent_of_the_input() -> None:
    t = torch.randn(10, generator=gen(4))
    before = t.clone()
    enc, residual = compress(t, "none")
    t.add_(1.0)
    assert torch.equal(decompress(enc), before)
    assert bool((residual == 0).all())
    assert isinstance(enc.data, memoryview) and enc.data.readonly


def test_none_with_residual_adds_it() -> None:
    enc, residual = compress(torch.ones(4), "none", residual=torch.full((4,), 0.5))
    assert decompress(enc).tolist() == [1.5] * 4 and residual.tolist() == [0.0] * 4


def test_bf16_saturates_finite_values_beyond_its_range() -> None:
    t = torch.tensor([3.4e38, -3.4e38, 1.0])
    enc, residual = compress(t, "bf16")
    out = decompress(enc)
    bf16_max = torch.finfo(torch.bfloat16).max
    assert out.tolist() == [bf16_max, -bf16_max, 1.0]
    assert torch.equal(residual, t - out)


# ---------------------------------------------------------------- local misuse


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_local_input_is_refused(codec: str, bad: float) -> None:
    t = torch.ones(100)
    t[70] = bad
    with pytest.raises(LocalProtocolError, match="tensor to compress"):
        compress(t, codec)
    with pytest.raises(LocalProtocolError, match="residual"):
        compress(torch.ones(100), codec, residual=t)


@pytest.mark.parametrize("codec", CODECS)
def test_overflowing_sum_is_refused(codec: str) -> None:
    big = torch.full((3,), 3e38)
    with pytest.raises(LocalProtocolError, match="overflows"):
        compress(big, codec, residual=big)


def test_bad_arguments() -> None:
    with pytest.raises(LocalProtocolError, match="unknown codec"):
        compress(torch.ones(2), "int2")
    with pytest.raises(LocalProtocolError, match="block_size"):
        compress(torch.ones(2), "int8", block_size=0)
    with pytest.raises(LocalProtocolError, match="dtype"):
        compress(torch.ones(2, dtype=torch.float64), "none")
    with pytest.raises(LocalProtocolError, match="dtype"):
        compress(torch.ones(2, dtype=torch.int32), "int8")
    with pytest.raises(LocalProtocolError, match="residual shape"):
        compress(torch.ones(2), "int8", residual=torch.ones(3))
    with pytest.raises(LocalProtocolError, match="float"):
        compress(torch.ones(2), "int8", residual=torch.ones(2, dtype=torch.int64))
    with pytest.raises(LocalProtocolError, match="numel"):
        wire_bytes(-1, "int8")
    with pytest.raises(LocalProtocolError, match="unknown codec"):
        wire_bytes(1, "fp8")
    assert wire_bytes(130, "int8", 64) == 130 + 3 * 4
    assert wire_bytes(5, "int4", 64) == 3 + 4
    assert wire_bytes(5, "bf16", 1) == 10 and wire_bytes(5, "none", 1) == 20


# ---------------------------------------------------------------- remote bytes


def _f32(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize(
    ("codec", "data", "scales"),
    [
        ("none", _f32(1.0, math.nan), b""),
        ("none", _f32(math.inf, 1.0), b""),
        (
            "bf16",
            torch.tensor([1.0, -math.inf]).to(torch.bfloat16).view(torch.int16).numpy().tobytes(),
            b"",
        ),
        ("int8", bytes([1, 2]), _f32(math.nan)),
        ("int8", bytes([1, 2]), _f32(-1.0)),
        ("int8", bytes([1, 2]), _f32(3e38)),
        ("int4", bytes([0x11]), _f32(math.inf)),
    ],
)
def test_remote_bytes_that_decode_to_nan_or_inf(codec: str, data: bytes, scales: bytes) -> None:
    enc = EncodedTensor(
        codec=codec,
        shape=(2,),
        dtype="float32",
        block_size=64 if scales else 0,
        data=data,
        scales=scales,
    )
    out = torch.full((2,), 9.0)
    with pytest.raises(DecodeError):
        decompress(enc)
    with pytest.raises(DecodeError):
        decompress(enc, out=out)
    assert out.tolist() == [9.0, 9.0]  # untouched


def test_int4_pad_nibble_and_minus_eight_decode_finitely() -> None:
    enc = EncodedTensor(
        codec="int4",
        shape=(3,),
        dtype="float32",
        block_size=2,
        data=bytes([0x00, 0xF0]),
        scales=_f32(1.0, 2.0),
    )
    assert decompress(enc).tolist() == [-8.0, -8.0, -16.0]


# ---------------------------------------------------------------- out=


@pytest.mark.parametrize("codec", CODECS)
def test_decompress_into_out(codec: str) -> None:
    t = torch.randn(3, 5, generator=gen(5))
    enc, _ = compress(t, codec, block_size=4)
    expected = decompress(enc)
    direct = torch.empty(3, 5)
    assert decompress(enc, out=direct) is direct and torch.equal(direct, expected)
    half = torch.empty(3, 5, dtype=torch.float16)
    assert torch.equal(decompress(enc, out=half), expected.half())
    strided = torch.empty(5, 3).t()
    assert torch.equal(decompress(enc, out=strided), expected)
    with pytest.raises(DecodeError, match="shape"):
        decompress(enc, out=torch.empty(15))


def test_empty_out() -> None:
    enc, _ = compress(torch.empty(0, 4), "int4")
    out = torch.empty(0, 4)
    assert decompress(enc, out=out) is out
    assert decompress(enc).shape == (0, 4)


def test_decodes_from_unaligned_memoryview() -> None:
    enc, _ = compress(torch.arange(6.0), "none")
    shifted = memoryview(b"x" + bytes(enc.data))[1:]
    assert decompress(replace(enc, data=shifted)).tolist() == list(range(6))


# ---------------------------------------------------------------- sign1


@pytest.mark.parametrize("block", [1, 3, 8, 64, 512])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000])
def test_sign1_sends_each_sign_and_each_blocks_mean_magnitude(n: int, block: int) -> None:
    t = torch.randn(n, generator=gen(n + block)) * 3
    enc, residual = compress(t, "sign1", block_size=block)
    out = decompress(enc)
    assert enc.nbytes == wire_bytes(n, "sign1", block) == (n + 7) // 8 + 4 * -(-n // block)
    assert torch.equal(residual, t - out)
    assert torch.equal(out >= 0, t >= 0)  # zero is sent as +
    pad = -n % block
    means = torch.nn.functional.pad(t.abs(), (0, pad)).view(-1, block).sum(1) / torch.tensor(
        [block] * (-(-n // block) - (pad > 0)) + ([block - pad] if pad else []), dtype=torch.float32
    )
    assert torch.allclose(out.abs(), means.repeat_interleave(block)[:n], rtol=1e-5)
    assert bool(((t - out).abs() <= t.abs() + out.abs()).all())


def test_sign1_layout_and_error_feedback() -> None:
    enc, _ = compress(
        torch.tensor([1.0, -2.0, 3.0, 0.0, -4.0, 5.0, 6.0, -7.0, 8.0, -1.0]), "sign1", block_size=10
    )
    assert bytes(enc.data) == bytes([0b01101101, 0b01]) and enc.scales == _f32(3.7)
    r, total, sent = None, torch.zeros(500), torch.zeros(500)
    for i in range(40):  # error feedback: what was sent plus what is owed is what came in
        t = torch.randn(500, generator=gen(100 + i))
        enc, r = compress(t, "sign1", block_size=50, residual=r)
        total, sent = total + t, sent + decompress(enc)
    assert torch.allclose(sent + r, total, atol=1e-4)
    assert float(r.abs().max()) < 0.25 * float(total.abs().max())  # owed work stays bounded


def test_sign1_refuses_what_it_cannot_send_and_remote_scales_that_would_not_decode() -> None:
    with pytest.raises(LocalProtocolError, match="NaN or Inf"):
        compress(torch.tensor([1.0, math.nan]), "sign1")
    with pytest.raises(LocalProtocolError, match="too large"):
        compress(torch.full((64,), 3e38), "sign1", block_size=64)  # the block's |x| sum overflows
    for scales in (_f32(math.nan), _f32(-1.0), _f32(math.inf)):
        enc = EncodedTensor(
            codec="sign1",
            shape=(2,),
            dtype="float32",
            block_size=64,
            data=bytes([1]),
            scales=scales,
        )
        with pytest.raises(DecodeError):
            decompress(enc)
    spare = EncodedTensor(
        codec="sign1",
        shape=(3,),
        dtype="float32",
        block_size=2,
        data=bytes([0b11111010]),
        scales=_f32(1.5, 2.0),
    )
    assert decompress(spare).tolist() == [-1.5, 1.5, -2.0]  # bits past the last element are ignored
    t = torch.randn(3, 5, generator=gen(9))
    enc, _ = compress(t, "sign1", block_size=4)
    strided = torch.empty(5, 3).t()
    assert torch.equal(decompress(enc, out=strided), decompress(enc))
