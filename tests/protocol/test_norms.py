"""The two hot reductions: ``norm64`` (fp32 sums of squares added in fp64) and ``all_finite``."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.norms import SUM_CHUNK, all_finite, norm64


def _exact(t: torch.Tensor) -> float:
    return math.sqrt(float((t.double() ** 2).sum()))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_norm_of_a_large_vector_matches_the_fp64_sum(scale: float) -> None:
    t = (
        torch.randn(5 * SUM_CHUNK + 123, generator=torch.Generator().manual_seed(0)) * scale
        + scale / 3
    )
    assert norm64(t) == pytest.approx(_exact(t), rel=1e-7)


def test_values_whose_squares_overflow_fp32_still_have_a_finite_norm() -> None:
    t = torch.full((3 * SUM_CHUNK,), 1e30)  # each square is 1e60: far beyond fp32, well inside fp64
    assert norm64(t) == pytest.approx(_exact(t), rel=1e-12)
    assert all_finite(t)  # its fp32 sum overflows too; the min/max pass tells it apart from an Inf


def test_tiny_values_are_measured_in_fp64_not_lost_to_subnormals() -> None:
    t = torch.full((2 * SUM_CHUNK,), 1e-20)  # squares of 1e-40 are fp32 subnormals
    assert norm64(t) == pytest.approx(1e-20 * math.sqrt(2 * SUM_CHUNK), rel=1e-6)
    assert norm64(torch.zeros(2 * SUM_CHUNK)) == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, SUM_CHUNK + 5, 3 * SUM_CHUNK - 1])
def test_one_nan_or_inf_anywhere_is_seen_by_both(bad: float, where: int) -> None:
    t = torch.randn(3 * SUM_CHUNK, generator=torch.Generator().manual_seed(1))
    t[where] = bad
    assert not all_finite(t)
    assert not math.isfinite(norm64(t))
    assert math.isnan(norm64(t)) == math.isnan(bad)


def test_an_inf_and_a_minus_inf_do_not_cancel() -> None:
    t = torch.zeros(2 * SUM_CHUNK)
    t[3], t[SUM_CHUNK + 3] = math.inf, -math.inf
    assert not all_finite(t) and math.isinf(norm64(t))


def test_other_dtypes_shapes_and_empty() -> None:
    assert all_finite(torch.empty(0)) and norm64(torch.empty(0)) == 0.0
    assert all_finite(torch.arange(10))  # integers are always finite
    half = torch.full((4, SUM_CHUNK), 2.0, dtype=torch.bfloat16)
    assert norm64(half) == pytest.approx(2.0 * math.sqrt(4 * SUM_CHUNK))
    assert not all_finite(torch.tensor([1.0, math.nan], dtype=torch.bfloat16))
    assert not all_finite(torch.tensor([60000.0, math.inf], dtype=torch.float16))
    assert all_finite(
        torch.full((8,), 60000.0, dtype=torch.float16)
    )  # the fp16 sum overflows; the values do not


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=40),
    st.integers(0, 3 * SUM_CHUNK),
)
def test_finiteness_agrees_with_torch_isfinite(values: list[float], at: int) -> None:
    t = torch.ones(3 * SUM_CHUNK + len(values))
    t[at : at + len(values)] = torch.tensor(values)
    finite = bool(torch.isfinite(t).all())
    assert all_finite(t) == finite
    assert math.isfinite(norm64(t)) == finite


def test_the_same_vector_has_the_same_norm_bits_in_any_thread() -> None:
    # an owner measures contributions in worker threads and ``atoll replay`` in its main thread:
    # a BLAS dot product took its thread count from the calling thread and differed in the last bits
    t = torch.randn(40 * SUM_CHUNK + 7, generator=torch.Generator().manual_seed(3)) * 1e-3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every peer runs; a new thread's BLAS still used every core
    try:
        here = [norm64(t), norm64(t.double())]
        there: list[float] = []
        worker = threading.Thread(target=lambda: there.extend([norm64(t), norm64(t.double())]))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert there == here
