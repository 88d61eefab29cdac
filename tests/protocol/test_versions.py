"""The version-jump fence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.diloco.versions import version_ceiling, version_jump_reason


def test_a_huge_version_is_refused_with_a_reason():
    reason = version_jump_reason(2**63 - 1, held=5, held_at=100.0, now=101.0, created=0.0)
    assert reason is not None and "above the 106" in reason


def test_the_creation_time_bounds_a_first_version():
    assert version_jump_reason(1_000_001, held=0, held_at=None, now=10_000.0, created=0.0) is None
    reason = version_jump_reason(1_000_002, held=0, held_at=None, now=10_000.0, created=0.0)
    assert reason is not None and "created" in reason


@given(st.integers(0, 10**6), st.floats(0, 1e4), st.floats(0, 1e4), st.floats(1, 1e3))
def test_an_honest_rate_is_never_refused(held, held_at, elapsed, rate):
    now = held_at + elapsed
    honest = held + int(elapsed * rate)
    assert (
        version_jump_reason(honest, held=held, held_at=held_at, now=now, max_rounds_per_s=rate)
        is None
    )
    assert version_ceiling(held=held, held_at=held_at, now=now, max_rounds_per_s=rate) >= honest


def test_nothing_known_means_no_bound():
    assert version_jump_reason(2**62, held=0, held_at=None, now=5.0) is None
