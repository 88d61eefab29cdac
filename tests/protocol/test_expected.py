"""ExpectedLearners: the learners an owner's rounds wait for, and those that finished, from the
members' records and what the owner heard, at a time passed in (a fake clock, no sleeps)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.diloco.activity import LearnerActivity
from protocol.diloco.expected import (
    FINISHED_MIN_MERGES,
    Claim,
    ExpectedLearners,
    not_recent,
)

A, B, C, D = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3, 0xD4))


def _claims(now: float, **learning: bool) -> dict[bytes, Claim]:
    ids = {"a": A, "b": B, "c": C, "d": D}
    return {ids[k]: Claim(learning=v, expires_at=now + 60.0) for k, v in learning.items()}


def test_decoupled_rounds_wait_for_live_learning_members_less_suspects() -> None:
    expected = ExpectedLearners(mode="decoupled", provisioned=8)
    now = 1000.0
    claims = _claims(now, a=True, b=True, c=False)
    assert expected.expected(claims, set(), now) == 2
    assert expected.learning(claims, {B}, now) == {A}
    # a record that expired (at the clock passed in) is not waited for
    assert expected.expected(claims, set(), now + 60.0) == 0


def test_synchronous_rounds_wait_for_every_provisioned_learner_but_the_finished() -> None:
    expected = ExpectedLearners(mode="sync", provisioned=4)
    claims = _claims(0.0, a=True, b=True, c=True)
    assert expected.expected(claims, set(), 0.0) == 4  # three of four are up so far
    del claims[A]  # killed: its record lapsed, still waited for
    assert expected.expected(claims, {B}, 1e9) == 4  # suspects and expiry do not count here
    claims[C] = Claim(learning=False, expires_at=1e9)  # finished
    assert expected.expected(claims, set(), 0.0) == 3
    assert expected.finished_count(claims) == 0  # synchronous rounds count no share


def test_a_member_silent_past_its_bound_is_not_waited_for_and_one_in_the_round_is() -> None:
    activity = LearnerActivity(min_steps=1)
    expected = ExpectedLearners(mode="decoupled", provisioned=0)
    for t in (0.0, 4.0, 8.0):
        activity.heard(A, t, steps=1, step_time=4.0)
        activity.heard(B, t, steps=1, step_time=4.0)
    kwargs = {"round_seconds": None, "started_at": 0.0}
    assert expected.silent({A, B}, activity, contributors=frozenset(), now=10.0, **kwargs) == set()
    # 12 s bound (three times 4 s of work): B went quiet at 8 s
    activity.heard(A, 19.0, steps=1, step_time=4.0)
    assert expected.silent({A, B}, activity, contributors=frozenset(), now=20.0, **kwargs) == {B}
    # whose work waits in the open round is never silent: it waits on us
    fresh = LearnerActivity(min_steps=1)
    fresh.heard(B, 0.0, steps=1, step_time=4.0)
    assert expected.silent({B}, fresh, contributors={B}, now=100.0, **kwargs) == set()


def test_in_a_rounds_count_only_learners_whose_work_was_taken_lately() -> None:
    """Three of the owner's round times (4 s each: 12 s), at least the silence floor."""
    activity = LearnerActivity(min_steps=1)
    activity.heard(A, 100.0, steps=1, step_time=1e6)  # claims a huge bound: not silent for long
    activity.heard(B, 110.0, steps=1, step_time=1.0)
    old = not_recent(activity, {A, B}, contributors=frozenset(), round_seconds=4.0, now=113.0)
    assert old == {A}
    # nobody recent: waiting for nobody is no reason to drop rounds
    assert (
        not_recent(activity, {A}, contributors=frozenset(), round_seconds=4.0, now=500.0) == set()
    )
    # no pace yet: nothing to measure against
    assert (
        not_recent(activity, {A, B}, contributors=frozenset(), round_seconds=None, now=1e9) == set()
    )
    expected = ExpectedLearners(mode="decoupled", provisioned=0)
    at_end = expected.silent(
        {A, B},
        activity,
        contributors=frozenset(),
        round_seconds=4.0,
        started_at=0.0,
        now=113.0,
        at_end=True,
    )
    assert A not in at_end  # at the end only silence bounds count


def test_finished_learners_count_once_their_work_was_merged_twice() -> None:
    expected = ExpectedLearners(mode="decoupled", provisioned=0)
    assert expected.finished_count(_claims(0.0, a=True, b=True, c=False)) == 0
    stopped = _claims(0.0, a=True, b=False, c=False)  # b stopped; c never trained
    merges = {B: FINISHED_MIN_MERGES - 1}
    assert expected.finished_heard(stopped, lambda pid: merges.get(pid, 0)) == 0
    merges[B] = FINISHED_MIN_MERGES
    assert expected.finished_heard(stopped, lambda pid: merges.get(pid, 0)) == 1


@given(
    st.dictionaries(
        st.sampled_from([A, B, C, D]),
        st.tuples(st.booleans(), st.floats(min_value=0, max_value=100)),
    ),
    st.floats(min_value=0, max_value=100),
)
def test_decoupled_expected_is_the_live_learning_set(
    records: dict[bytes, tuple[bool, float]], now: float
) -> None:
    claims = {pid: Claim(learning=lr, expires_at=exp) for pid, (lr, exp) in records.items()}
    expected = ExpectedLearners(mode="decoupled", provisioned=3)
    live = {pid for pid, (lr, exp) in records.items() if lr and exp > now}
    assert expected.learning(claims, set(), now) == live
    assert expected.expected(claims, set(), now) == len(live)
    assert expected.expected(claims, {A}, now) == len(live - {A})
