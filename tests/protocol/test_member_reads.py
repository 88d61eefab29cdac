"""protocol.dht.member_reads: the membership read cadence and the capped roster of open swarms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.dht.member_reads import ReadCadence, RosterSeat, offers_to_own, roster_score


def test_reads_back_off_while_nothing_changes_and_come_back_on_a_change() -> None:
    cadence = ReadCadence(base_s=2.0, max_s=8.0)
    assert cadence.due(0.0)  # the first read
    gaps, now = [], 0.0
    for _ in range(4):
        cadence.read(now, changed=False)
        gaps.append(cadence.gap_s)
        assert not cadence.due(now + cadence.gap_s - 0.01)
        now += cadence.gap_s
        assert cadence.due(now)
    assert gaps == [4.0, 8.0, 8.0, 8.0]  # doubling, capped at max_s
    cadence.read(now, changed=True)
    assert cadence.gap_s == 2.0 and not cadence.due(now + 1.0)
    cadence.hurry()  # a suspect, a wanted member, a wait for members: read at the next pass
    assert cadence.due(now + 0.1) and cadence.gap_s == 2.0
    assert cadence.skipped == 5 and cadence.reads == 5


@given(
    changes=st.lists(st.booleans(), min_size=1, max_size=40),
    share=st.floats(1.0, 30.0),
    guard=st.floats(0.5, 10.0),
)
def test_no_record_left_unrenewed_comes_within_the_guard_of_expiry_before_the_next_read(
    changes: list[bool], share: float, guard: float
) -> None:
    """A record a read did not renew expires at or after ``renew_before``; the next read comes
    at most ``gap_s`` later, so it still has ``guard`` seconds to live then."""
    cadence, now = ReadCadence(base_s=2.0, max_s=8.0), 0.0
    for changed in changes:
        floor = cadence.renew_before(now, share_s=share, guard_s=guard)
        assert floor >= now + share
        cadence.read(now, changed=changed)
        now += cadence.gap_s
        assert floor - now >= guard - 1e-9


def test_a_cadence_needs_a_positive_base_no_larger_than_its_max() -> None:
    with pytest.raises(ValueError, match="base_s"):
        ReadCadence(base_s=0.0, max_s=8.0)
    with pytest.raises(ValueError, match="max_s"):
        ReadCadence(base_s=9.0, max_s=8.0)


def pid(i: int) -> bytes:
    return i.to_bytes(32, "big")


@given(n=st.integers(0, 60), cap=st.integers(1, 12), swarm=st.sampled_from(["a", "b", "s"]))
def test_every_view_of_the_same_candidates_picks_the_same_cap_best(
    n: int, cap: int, swarm: str
) -> None:
    """Read the same roster, every candidate decides alike: exactly the ``cap`` best-ranked offer
    (all of them when fewer), whoever asks; a newcomer offers only if it would rank among them."""
    members = [pid(i) for i in range(n)]
    offering = {m for m in members if offers_to_own(swarm, m, members, cap)}
    best = sorted(members, key=lambda m: roster_score(swarm, m), reverse=True)[:cap]
    assert offering == set(best)
    newcomer = pid(10_000)
    ranks_in = (
        len([m for m in best if roster_score(swarm, m) > roster_score(swarm, newcomer)]) < cap
    )
    assert offers_to_own(swarm, newcomer, offering, cap) == ranks_in


def test_the_roster_rank_depends_on_the_swarm_and_the_cap_must_be_positive() -> None:
    assert roster_score("a", pid(1)) != roster_score("b", pid(1))
    assert offers_to_own("s", pid(1), [], 1)  # alone: offers
    with pytest.raises(ValueError, match="cap"):
        offers_to_own("s", pid(1), [], 0)


def test_a_place_that_opens_in_an_established_roster_is_taken_only_after_the_grace() -> None:
    """An owner whose record lapses for a moment keeps its place: the next-ranked member takes it
    only once it stayed open ``grace_s``; in a roster still forming a place is taken at once, and
    a member offering withdraws at once when ``cap`` others outrank it."""
    swarm, cap = "s", 4
    members = sorted((pid(i) for i in range(cap + 2)), key=lambda m: roster_score(swarm, m))
    nxt, roster = members[1], members[2:]  # nxt ranks right below the roster's cap members
    seat = RosterSeat(cap=cap, grace_s=20.0)
    assert not seat.decide(swarm, nxt, roster, now=0.0)
    lapsed = roster[1:]  # one owner's record lapsed
    assert not seat.decide(swarm, nxt, lapsed, now=1.0)
    assert not seat.decide(swarm, nxt, roster, now=5.0)  # it came back: the wait starts over
    assert not seat.decide(swarm, nxt, lapsed, now=6.0)
    assert not seat.decide(swarm, nxt, lapsed, now=25.9)
    assert seat.decide(swarm, nxt, lapsed, now=26.0) and seat.offering
    assert seat.decide(swarm, nxt, lapsed, now=27.0)  # offering: stays while it ranks
    assert not seat.decide(swarm, nxt, roster, now=28.0)  # cap others outrank it: withdraws
    forming = RosterSeat(cap=cap, grace_s=20.0)
    assert forming.decide(swarm, members[0], roster[:1], now=0.0)  # 1 other < cap / 2: at once
    with pytest.raises(ValueError, match="grace_s"):
        RosterSeat(cap=cap, grace_s=-1.0)
