"""LearnerActivity: which members claiming to learn an owner stops waiting for at the end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.activity import LearnerActivity, SilenceBounds

A, B, C, D = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3, 0xD4))


def test_a_member_never_heard_from_is_waited_for_the_unknown_bound_from_when_the_end_was_asked() -> None:
    activity = LearnerActivity()
    assert activity.bound(A) == 120.0
    assert activity.silent({A}, since=1000.0, now=1119.9) == set()
    assert activity.silent({A}, since=1000.0, now=1120.0) == {A}


def test_a_learner_at_work_is_waited_for_three_of_its_own_intervals() -> None:
    activity = LearnerActivity()
    for t in (0.0, 40.0, 80.0):  # contributes every 40 s (H steps of a slow GPU)
        activity.heard(A, t)
    assert activity.bound(A) == 120.0
    # the end was asked at 90 s: at 209 s it has been quiet 119 s, still within its bound
    assert activity.silent({A}, since=90.0, now=209.0) == set()
    assert activity.silent({A}, since=90.0, now=210.0) == {A}
    activity.heard(A, 120.0)  # it contributed again: the silence counts from there
    assert activity.silent({A}, since=90.0, now=210.0) == set()


def test_quiet_time_counts_from_when_the_end_was_asked_not_from_an_old_contribution() -> None:
    """A learner heard from long ago is not cut off the moment the first peer finishes."""
    activity = LearnerActivity()
    activity.heard(A, 0.0)
    activity.heard(A, 10.0)  # bound max(30, 3 x 10) = 30
    assert activity.silent({A}, since=500.0, now=501.0) == set()
    assert activity.silent({A}, since=500.0, now=530.0) == {A}


def test_a_member_never_heard_from_takes_the_fragments_usual_interval() -> None:
    activity = LearnerActivity()
    for sender, gap in ((A, 20.0), (B, 30.0), (C, 40.0)):
        activity.heard(sender, 0.0)
        activity.heard(sender, gap)
    assert activity.usual_interval() == 30.0
    assert activity.bound(D) == 90.0
    assert activity.silent({A, B, C, D}, since=100.0, now=190.0) == {A, B, D}  # C's bound is 120 s


def test_bounds_are_clamped_so_a_hostile_cadence_cannot_hold_the_end_for_long() -> None:
    """A member sending once an hour would earn a 3-hour bound: it gets ``cap_s``; one sending
    many times a second gets ``floor_s``, not a fraction of a second."""
    activity = LearnerActivity()
    activity.heard(A, 0.0)
    activity.heard(A, 3600.0)
    activity.heard(B, 0.0)
    activity.heard(B, 0.01)
    assert activity.bound(A) == 300.0
    assert activity.bound(B) == 30.0


def test_the_least_recently_heard_are_forgotten_beyond_max_senders() -> None:
    activity = LearnerActivity(max_senders=2)
    activity.heard(A, 0.0)
    activity.heard(B, 1.0)
    activity.heard(A, 2.0)  # A is now the most recent
    activity.heard(C, 3.0)
    assert activity.last_heard(B) is None and activity.last_heard(A) == 2.0 and activity.last_heard(C) == 3.0


@pytest.mark.parametrize("kw", [{"floor_s": 0.0}, {"floor_s": 200.0}, {"unknown_s": 400.0}, {"factor": 0.5}])
def test_inconsistent_bounds_are_refused_with_what_is_wrong(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="silence"):
        SilenceBounds(**kw)


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.floats(0, 10_000, allow_nan=False), min_size=1, max_size=20),
       since=st.floats(0, 10_000, allow_nan=False), later=st.floats(0, 1_000, allow_nan=False))
def test_silence_is_monotone_in_time_and_never_before_the_floor(times: list[float], since: float,
                                                              later: float) -> None:
    activity = LearnerActivity()
    for t in sorted(times):
        activity.heard(A, t)
    now = max(since, max(times))
    quiet_from = max(since, max(times))
    for dt in (0.0, later, later + 300.0):
        silent = A in activity.silent({A}, since=since, now=now + dt)
        assert silent == (now + dt - quiet_from >= activity.bound(A))
        if now + dt - quiet_from < 30.0:
            assert not silent
    assert A in activity.silent({A}, since=since, now=quiet_from + 301.0)  # the cap always ends the wait
