"""How H grows as the inner learning rate decays (protocol.diloco.interval)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.diloco.interval import GROWTHS, MAX_GROWTH, interval
from protocol.errors import LocalProtocolError


def test_constant_ignores_the_learning_rate() -> None:
    assert interval(30, 1.0, "constant") == interval(30, 0.1, "constant") == 30


def test_inverse_lr_and_qsr_grow_as_one_over_the_ratio_and_its_square() -> None:
    assert interval(30, 1.0, "inverse-lr") == interval(30, 1.0, "qsr") == 30
    assert interval(30, 0.5, "inverse-lr") == 60
    assert interval(30, 0.5, "qsr") == 120
    assert interval(100, 0.1, "qsr") == 10_000  # the cosine's floor at min_lr_ratio 0.1: 100 H
    assert interval(100, 0.01, "qsr") == 100 * MAX_GROWTH  # capped


@given(base=st.integers(1, 1000), a=st.floats(1e-6, 1.0), b=st.floats(1e-6, 1.0), growth=st.sampled_from(GROWTHS))
def test_never_below_base_never_above_the_cap_and_longer_as_the_lr_falls(base: int, a: float, b: float,
                                                                          growth: str) -> None:
    ha, hb = interval(base, a, growth), interval(base, b, growth)
    assert base <= ha <= base * MAX_GROWTH
    if a <= b:
        assert ha >= hb


@pytest.mark.parametrize(("base", "ratio", "growth", "says"), [
    (0, 1.0, "qsr", "base must be >= 1"),
    (30, 0.0, "qsr", "lr_ratio must be in (0, 1]"),
    (30, math.nan, "qsr", "lr_ratio must be in (0, 1]"),
    (30, 2.0, "qsr", "lr_ratio must be in (0, 1]"),
    (30, 0.5, "cubic", "growth must be one of constant, inverse-lr, qsr"),
])
def test_bad_arguments_say_what_was_wrong(base: int, ratio: float, growth: str, says: str) -> None:
    with pytest.raises(LocalProtocolError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        interval(base, ratio, growth)
