"""How H grows as the inner learning rate decays (protocol.diloco.interval)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.diloco.interval import GROWTHS, MAX_GROWTH, SHRINKING, interval
from protocol.errors import LocalProtocolError


def test_constant_ignores_the_learning_rate() -> None:
    assert interval(30, 1.0, "constant") == interval(30, 0.1, "constant") == 30


def test_inverse_lr_and_qsr_grow_as_one_over_the_ratio_and_its_square() -> None:
    assert interval(30, 1.0, "inverse-lr") == interval(30, 1.0, "qsr") == 30
    assert interval(30, 0.5, "inverse-lr") == 60
    assert interval(30, 0.5, "qsr") == 120
    assert interval(100, 0.1, "qsr") == 10_000  # the cosine's floor at min_lr_ratio 0.1: 100 H
    assert interval(100, 0.01, "qsr") == 100 * MAX_GROWTH  # capped


def test_sqrt_lr_shrinks_as_the_root_of_the_ratio() -> None:
    assert interval(320, 1.0, "sqrt-lr") == 320
    assert interval(320, 0.25, "sqrt-lr") == 160
    assert interval(320, 0.1, "sqrt-lr") == 101  # the cosine's floor at min_lr_ratio 0.1
    assert interval(1, 1e-6, "sqrt-lr") == 1  # never below one step


@given(
    base=st.integers(1, 1000),
    a=st.floats(1e-6, 1.0),
    b=st.floats(1e-6, 1.0),
    growth=st.sampled_from([g for g in GROWTHS if g not in SHRINKING]),
)
def test_never_below_base_never_above_the_cap_and_longer_as_the_lr_falls(
    base: int, a: float, b: float, growth: str
) -> None:
    ha, hb = interval(base, a, growth), interval(base, b, growth)
    assert base <= ha <= base * MAX_GROWTH
    if a <= b:
        assert ha >= hb


@given(
    base=st.integers(1, 1000),
    a=st.floats(1e-6, 1.0),
    b=st.floats(1e-6, 1.0),
    growth=st.sampled_from(SHRINKING),
)
def test_a_shrinking_schedule_stays_within_one_step_and_base_and_shortens_as_the_lr_falls(
    base: int, a: float, b: float, growth: str
) -> None:
    ha, hb = interval(base, a, growth), interval(base, b, growth)
    assert 1 <= ha <= base
    if a <= b:
        assert ha <= hb


@pytest.mark.parametrize(
    ("base", "ratio", "growth", "says"),
    [
        (0, 1.0, "qsr", "base must be >= 1"),
        (30, 0.0, "qsr", "lr_ratio must be in (0, 1]"),
        (30, math.nan, "qsr", "lr_ratio must be in (0, 1]"),
        (30, 2.0, "qsr", "lr_ratio must be in (0, 1]"),
        (30, 0.5, "cubic", "growth must be one of constant, inverse-lr, qsr, sqrt-lr"),
    ],
)
def test_bad_arguments_say_what_was_wrong(base: int, ratio: float, growth: str, says: str) -> None:
    with pytest.raises(
        LocalProtocolError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        interval(base, ratio, growth)
