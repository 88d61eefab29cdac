"""protocol.dht.member_lookups: which members a bounded view asks for by id, and keeps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.dht.member_lookups import MemberLookups


def pid(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_wanted_ids_are_asked_once_per_retry_most_recent_first() -> None:
    lookups = MemberLookups(per_read=2, kept=4, retry_s=5.0)
    for i, t in ((1, 0.0), (2, 1.0), (3, 2.0)):
        lookups.want(pid(i), t)
    assert lookups.due({}, now=3.0) == (pid(3), pid(2))
    assert lookups.due({}, now=3.5) == (pid(1),)  # 3 and 2 asked within retry_s
    assert lookups.due({}, now=4.0) == ()
    assert lookups.due({}, now=8.5) == (pid(3), pid(2))  # retry_s passed: asked again
    assert lookups.looked_up == 5


def test_a_member_held_live_is_not_asked_for() -> None:
    lookups = MemberLookups(per_read=4, kept=4, retry_s=0.0)
    lookups.want(pid(1), 0.0)
    lookups.want(pid(2), 0.0)
    assert lookups.due({pid(1): 30.0, pid(2): 0.5}, now=1.0) == (pid(2),)  # 2's record expired


def test_kept_are_the_most_recently_wanted() -> None:
    lookups = MemberLookups(per_read=1, kept=2, retry_s=0.0)
    for i in range(4):
        lookups.want(pid(i), float(i))
    lookups.want(pid(0), 9.0)  # wanted again: the most recent
    assert lookups.keep([pid(0), pid(1), pid(3), pid(7)]) == {pid(1), pid(7)}


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="per_read"):
        MemberLookups(per_read=0)
    with pytest.raises(ValueError, match="kept"):
        MemberLookups(per_read=8, kept=4)


@given(
    wants=st.lists(st.tuples(st.integers(0, 50), st.floats(0, 100)), max_size=300),
    reads=st.lists(st.floats(0, 200), max_size=20),
    per_read=st.integers(1, 8),
    max_wanted=st.integers(8, 40),
)
def test_state_and_reads_stay_bounded_whatever_is_wanted(
    wants: list[tuple[int, float]], reads: list[float], per_read: int, max_wanted: int
) -> None:
    lookups = MemberLookups(per_read=per_read, kept=per_read, retry_s=3.0, max_wanted=max_wanted)
    for i, t in wants:
        lookups.want(pid(i), t)
        assert len(lookups) <= max_wanted
    asked: dict[bytes, float] = {}
    for now in sorted(reads):
        due = lookups.due({}, now)
        assert len(due) <= per_read and len(set(due)) == len(due)
        for p in due:  # never asked again within retry_s
            assert now - asked.get(p, -1e9) >= 3.0
            asked[p] = now
    dropped = lookups.keep(pid(i) for i in range(60))
    assert len(set(pid(i) for i in range(60)) - dropped) == per_read


def test_ids_wanted_since_a_time_are_the_ones_worth_renewing() -> None:
    lookups = MemberLookups(per_read=2, kept=4, retry_s=5.0)
    for i, t in ((1, 0.0), (2, 10.0), (3, 20.0), (1, 30.0)):
        lookups.want(pid(i), t)
    assert lookups.wanted_since(15.0) == {pid(3), pid(1)}  # 1 wanted again at 30
    assert lookups.wanted_since(31.0) == set()
    assert lookups.wanted_since(0.0) == {pid(1), pid(2), pid(3)}
