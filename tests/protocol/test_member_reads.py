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


def test_members_standing_by_that_outrank_us_each_add_a_grace_to_our_wait() -> None:
    """A view that lacks one roster record shows a place open to every member holding it: a deep
    member waits ``grace_s`` once for itself and once per member standing by ahead of it (at most
    ``cap``), so the members ranked right below the roster take a truly open place first."""
    swarm, cap, grace = "s", 4, 20.0
    members = sorted((pid(i) for i in range(40)), key=lambda m: roster_score(swarm, m))
    roster, line = members[-cap:], members[:-cap][::-1]  # line[0] ranks right below the roster
    lapsed = roster[1:]
    deep = RosterSeat(cap=cap, grace_s=grace)
    me = line[3]  # three standing by ahead of it in its view
    assert deep.ahead(swarm, me, lapsed, line) == 3
    assert not deep.decide(swarm, me, lapsed, 0.0, waiting=line)
    assert not deep.decide(swarm, me, lapsed, 79.9, waiting=line)  # 4 graces, not 1
    assert deep.decide(swarm, me, lapsed, 80.0, waiting=line)
    # the first in line waits one grace only; once it offers, the next one's line is shorter
    first, second = RosterSeat(cap=cap, grace_s=grace), RosterSeat(cap=cap, grace_s=grace)
    assert not first.decide(swarm, line[0], lapsed, 0.0, waiting=line)
    assert not second.decide(swarm, line[1], lapsed, 0.0, waiting=line)
    assert first.decide(swarm, line[0], lapsed, 20.0, waiting=line)
    assert not second.decide(swarm, line[1], lapsed, 20.0, waiting=line)  # line[0] ahead
    # line[0] took the place: the roster is full again for line[1] (cap others outrank it)
    assert not second.decide(swarm, line[1], [*lapsed, line[0]], 21.0, waiting=line[1:])
    # a second place opens: line[1] stands first in line now, one grace
    assert not second.decide(swarm, line[1], [*lapsed[1:], line[0]], 22.0, waiting=line[1:])
    assert second.decide(swarm, line[1], [*lapsed[1:], line[0]], 42.0, waiting=line[1:])
    # members below us, and ourselves, are no line; the line is at most cap long
    assert deep.ahead(swarm, line[0], lapsed, line) == 0
    assert deep.ahead(swarm, line[-1], lapsed, line) == cap
    forming = RosterSeat(cap=cap, grace_s=grace)
    assert forming.decide(swarm, me, roster[:1], 0.0, waiting=line)  # a roster still forming


def test_a_member_takes_no_place_from_a_stale_view() -> None:
    """A starved loop's view loses its records for want of reads: the roster looks empty, "still
    forming". A member not offering takes no place from such a view, neither at once nor after
    its grace; one offering keeps its place; a fresh read again decides as before."""
    swarm, cap, grace = "s", 4, 20.0
    members = sorted((pid(i) for i in range(cap + 4)), key=lambda m: roster_score(swarm, m))
    me, roster = members[0], members[-cap:]
    seat = RosterSeat(cap=cap, grace_s=grace)
    assert not seat.decide(swarm, me, [], 0.0, fresh=False)  # an emptied view: not "forming"
    assert not seat.decide(swarm, me, roster[1:], 1.0)  # fresh: a place looks open, the wait starts
    assert not seat.decide(swarm, me, roster[1:], 30.0, fresh=False)  # past the grace, but stale
    assert seat.decide(swarm, me, roster[1:], 31.0)  # read again: the place stayed open
    assert seat.decide(swarm, me, [], 32.0, fresh=False)  # offering: a stale view keeps it
    assert RosterSeat(cap=cap, grace_s=grace).decide(swarm, me, [], 0.0)  # forming, fresh
