"""LearnerActivity: which members claiming to learn an owner stops waiting for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.activity import LearnerActivity, SilenceBounds

A, B, C, D, E = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3, 0xD4, 0xE5))


def test_before_anyone_is_heard_nobody_is_silent_but_at_the_end_the_unknown_bound_applies() -> None:
    """Nothing tells how long H steps take until a contribution arrives: a swarm whose first
    round is slow is not cut down. At the end a member never heard from gets ``unknown_s``."""
    activity = LearnerActivity()
    assert activity.bound(A) is None
    assert activity.silent({A}, since=1000.0, now=1e9) == set()
    assert activity.bound(A, at_end=True) == 120.0
    assert activity.silent({A}, since=1000.0, now=1119.9, at_end=True) == set()
    assert activity.silent({A}, since=1000.0, now=1120.0, at_end=True) == {A}


def test_a_learner_at_work_is_waited_for_three_times_the_work_it_sends() -> None:
    activity = LearnerActivity()
    for t in (0.0, 40.0, 80.0):  # 40 s of work a contribution (H steps of a slow GPU)
        activity.heard(A, t, steps=1, step_time=40.0)
    assert activity.bound(A) == 120.0
    assert activity.silent({A}, since=0.0, now=199.0) == set()
    assert activity.silent({A}, since=0.0, now=200.0) == {A}
    activity.heard(A, 210.0, steps=1, step_time=40.0)  # it contributed again: waited for again
    assert activity.silent({A}, since=0.0, now=300.0) == set()


def test_the_time_between_contributions_does_not_lengthen_the_bound() -> None:
    """A learner sends one contribution a round: while a round waits (on silent members, say),
    its gaps grow. Measured by them, the bound for the silent members grew with the wait they
    caused; it is the work a contribution holds that counts."""
    activity = LearnerActivity()
    activity.heard(A, 0.0, steps=1, step_time=2.0)
    activity.heard(A, 60.0, steps=1, step_time=2.0)  # a minute later: its round had waited
    assert activity.bound(A) == 6.0 and activity.bound(B) == 6.0
    activity.heard(C, 0.0, steps=1, step_time=100.0)
    activity.heard(C, 10.0, steps=1, step_time=float("nan"))  # an unusable claim keeps the last one
    assert activity.bound(C) == 300.0


def test_silence_counts_from_when_a_member_was_first_seen_or_from_since() -> None:
    activity = LearnerActivity()
    activity.heard(A, 10.0, steps=1, step_time=10.0)  # bound 30 s
    activity.seen({B}, 100.0)  # B joins at 100 s and has sent nothing yet
    activity.seen({B}, 120.0)  # seen again: still counted from the first time
    assert activity.silent({A, B}, since=0.0, now=129.0, at_end=True) == {A}
    assert activity.silent({A, B}, since=0.0, now=130.0, at_end=True) == {A, B}
    assert (
        activity.silent({A, B}, since=500.0, now=529.0, at_end=True) == set()
    )  # owning since 500 s
    assert activity.silent({A, B}, since=500.0, now=530.0, at_end=True) == {A, B}


def test_a_member_never_heard_from_takes_the_median_work_of_those_heard() -> None:
    activity = LearnerActivity()
    for sender, work in ((A, 20.0), (B, 30.0), (C, 40.0)):
        activity.heard(sender, 100.0, steps=1, step_time=work)
    assert activity.usual_interval() == 30.0
    assert activity.bound(D) == 90.0
    assert activity.silent({A, B, C, D}, since=100.0, now=190.0) == {A, B, D}  # C's bound is 120 s


def test_a_member_found_silent_stays_so_until_it_is_heard_from() -> None:
    """Members heard later may claim longer work and lift the median: a member already left out
    is not counted back in by that (its silence would otherwise hold rounds again), only by a
    contribution of its own."""
    activity = LearnerActivity()
    activity.heard(A, 0.0, steps=1, step_time=2.0)
    assert activity.silent({A, D}, since=0.0, now=6.0) == {A, D}
    for sender in (B, C, E):
        activity.heard(
            sender, 6.0, steps=1, step_time=100.0
        )  # the median is now 100 s: D's bound 300 s
    assert activity.silent({A, D}, since=0.0, now=7.0) == {A, D}
    assert activity.silent({D}, since=0.0, now=7.0, at_end=True) == set()  # the end looks afresh
    activity.heard(D, 8.0, steps=1, step_time=2.0)
    assert activity.silent({A, D}, since=0.0, now=9.0) == {A}


def test_bounds_are_clamped_so_a_hostile_claim_cannot_hold_anything_for_long() -> None:
    """A member claiming hours of work would earn a bound of hours: it gets ``cap_s``; one
    claiming milliseconds gets ``floor_s`` (``end_floor_s`` at the end of a run)."""
    activity = LearnerActivity()
    activity.heard(A, 0.0, steps=1, step_time=3600.0)
    activity.heard(B, 0.0, steps=1, step_time=1e12)
    activity.heard(C, 0.0, steps=1, step_time=0.01)
    assert activity.bound(A) == activity.bound(B) == 300.0
    assert activity.bound(C) == 5.0 and activity.bound(C, at_end=True) == 30.0


def test_the_least_recently_heard_are_forgotten_beyond_max_senders() -> None:
    activity = LearnerActivity(max_senders=2)
    activity.heard(A, 0.0, steps=1, step_time=2.0)
    activity.heard(B, 1.0, steps=1, step_time=2.0)
    activity.heard(A, 2.0, steps=1, step_time=2.0)  # A is now the most recent
    activity.heard(C, 3.0, steps=1, step_time=2.0)
    assert (
        activity.last_heard(B) is None
        and activity.last_heard(A) == 2.0
        and activity.last_heard(C) == 3.0
    )
    activity.seen([A, B, C, D], 4.0)  # only C's and D's sightings are kept
    assert activity.silent({B, D}, since=0.0, now=7.0) == {
        B
    }  # bound 6 s: B counted from since, D from 4 s


@pytest.mark.parametrize(
    "kw",
    [
        {"floor_s": 0.0},
        {"floor_s": 40.0},
        {"end_floor_s": 200.0},
        {"unknown_s": 400.0},
        {"factor": 0.5},
    ],
)
def test_inconsistent_bounds_are_refused_with_what_is_wrong(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="silence"):
        SilenceBounds(**kw)


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.floats(0, 10_000, allow_nan=False), min_size=1, max_size=20),
    work=st.floats(1e-3, 1e6, allow_nan=False),
    since=st.floats(0, 10_000, allow_nan=False),
    later=st.floats(0, 1_000, allow_nan=False),
    at_end=st.booleans(),
)
def test_silence_comes_exactly_at_the_bound_never_before_the_floor_and_always_by_the_cap(
    times: list[float], work: float, since: float, later: float, at_end: bool
) -> None:
    activity = LearnerActivity()
    for t in sorted(times):
        activity.heard(A, t, steps=1, step_time=work)
    quiet_from = max(since, max(times))
    bound = activity.bound(A, at_end=at_end)
    assert bound is not None and (30.0 if at_end else 5.0) <= bound <= 300.0
    assert A not in activity.silent(
        {A}, since=since, now=quiet_from + min(later, bound * 0.999), at_end=at_end
    )
    assert A in activity.silent(
        {A}, since=since, now=quiet_from + bound * 1.0001 + later, at_end=at_end
    )
    assert A in activity.silent({A}, since=since, now=quiet_from + 301.0, at_end=at_end)


def test_a_learner_is_given_at_least_two_rounds_of_its_steps_between_contributions() -> None:
    """A staggered fragment's first contribution holds 101 steps, the next one a round later, and
    a learner that holds one in flight sends every 2H: at H = 200 and 0.1 s a step, measured by
    the first contribution alone (10 s of work), an honest learner was found silent after 30 s
    and left out of the quorum until its next one 34 s later (the default main job, 2026-12-04).
    With ``min_steps`` = 2H it is waited for 3 x 40 s, whatever the steps a contribution holds."""
    activity = LearnerActivity(min_steps=400)
    activity.heard(A, 0.0, steps=101, step_time=0.1)
    assert activity.bound(A) == pytest.approx(120.0)
    assert activity.silent({A}, since=0.0, now=34.0) == set()
    # more than 2H: a contribution that waited in a round held below its quorum; a bound from
    # its steps would grow with the stall it is there to end
    activity.heard(B, 0.0, steps=1000, step_time=0.1)
    assert activity.bound(B) == pytest.approx(120.0)


def test_a_refused_contribution_tells_the_pace_but_is_not_hearing_from_its_sender() -> None:
    """A staggered fragment's first contributions come at step 1 with no step time yet; in a
    round held below its quorum every later one is a duplicate, refused. Learning the pace only
    from accepted ones, the owner never learned it, never found the silent members silent, and
    the round waited for ever (fragment 0 of the integration test, once)."""
    activity = LearnerActivity(min_steps=40)
    activity.heard(A, 0.0, steps=1, step_time=0.0)
    assert activity.bound(D) is None
    activity.heard(A, 1.0, steps=40, step_time=0.1, accepted=False)  # a duplicate: 4 s of work
    assert activity.bound(D) == pytest.approx(12.0) and activity.last_heard(A) == 0.0
    activity.seen({D}, 0.0)
    assert activity.silent({D}, since=0.0, now=12.1) == {D}
