"""Versions spread peer to peer (``protocol.diloco.spread.Fanout``): every holder uploads each
version a bounded number of times, however many learners ask, and every learner still gets it."""

from __future__ import annotations

import collections
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.spread import MAX_POINTERS, Fanout, PointTo, Refuse, Serve


def _id(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_the_first_requesters_are_served_and_the_rest_pointed_at_them_round_robin() -> None:
    fan = Fanout(2)
    assert isinstance(fan.decide(5, _id(1)), Serve)
    assert isinstance(fan.decide(5, _id(2)), Serve)
    pointers = [fan.decide(5, _id(n)) for n in range(3, 7)]
    assert all(isinstance(d, PointTo) for d in pointers)
    firsts = [d.holders[0] for d in pointers if isinstance(d, PointTo)]
    assert firsts == [_id(1), _id(2), _id(1), _id(2)]
    assert all(set(d.holders) == {_id(1), _id(2)} for d in pointers if isinstance(d, PointTo))
    assert fan.served == 2 and fan.pointed == 4
    assert isinstance(fan.decide(6, _id(9)), Serve)  # a new version starts afresh


def test_a_fallback_is_served_once_per_requester_and_version() -> None:
    fan = Fanout(1)
    fan.decide(1, _id(1))
    assert isinstance(fan.decide(1, _id(2)), PointTo)
    served = fan.decide(1, _id(2), fallback=True)
    assert isinstance(served, Serve) and "fallback" in served.reason
    again = fan.decide(1, _id(2), fallback=True)
    assert isinstance(again, Refuse) and "fallback was served" in again.reason
    assert isinstance(fan.decide(2, _id(2), fallback=True), Serve)  # the next version: a new share


def test_a_repeat_is_served_once_then_pointed_elsewhere() -> None:
    fan = Fanout(2)
    fan.decide(1, _id(1))
    fan.decide(1, _id(2))
    assert isinstance(fan.decide(1, _id(1)), Serve)  # its download broke: once more
    again = fan.decide(1, _id(1))
    assert isinstance(again, PointTo) and again.holders == (_id(2),)


def test_anonymous_requesters_are_pointed_at_holders_once_there_are_some() -> None:
    fan = Fanout(1)
    assert isinstance(fan.decide(1, None), Serve)  # nobody holds it yet
    assert isinstance(fan.decide(1, _id(1)), Serve)
    d = fan.decide(1, None)
    assert isinstance(d, PointTo) and d.holders == (_id(1),)


def test_an_anonymous_fallback_is_served() -> None:
    fan = Fanout(1)
    fan.decide(1, _id(1))
    assert isinstance(fan.decide(1, None), PointTo)
    assert isinstance(fan.decide(1, None, fallback=True), Serve)


def test_spreading_off_serves_everyone() -> None:
    fan = Fanout(0)
    assert all(isinstance(fan.decide(1, _id(n)), Serve) for n in range(50))


def test_a_lone_holder_cannot_be_pointed_at_itself() -> None:
    fan = Fanout(1)
    fan.decide(1, _id(1))
    fan.decide(1, _id(1))
    refused = fan.decide(1, _id(1))
    assert isinstance(refused, Refuse) and "no other holder" in refused.reason


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="fanout"):
        Fanout(-1)
    with pytest.raises(ValueError, match="versions_kept"):
        Fanout(1, versions_kept=0)


def test_pointers_name_at_most_max_pointers_holders() -> None:
    fan = Fanout(MAX_POINTERS + 3)
    for n in range(MAX_POINTERS + 3):
        fan.decide(1, _id(n))
    d = fan.decide(1, _id(100))
    assert isinstance(d, PointTo) and len(d.holders) == MAX_POINTERS


def _spread(
    n_learners: int, fanout: int, rng: random.Random
) -> tuple[dict[int, int], dict[int, int]]:
    """Every learner fetches one version from the owner (peer 0), following pointers from holder
    to holder; returns uploads per peer and the hops each learner took."""
    fanouts = {peer: Fanout(fanout) for peer in range(n_learners + 1)}
    holds = {0}
    uploads: collections.Counter[int] = collections.Counter()
    hops: dict[int, int] = {}
    order = list(range(1, n_learners + 1))
    rng.shuffle(order)
    for learner in order:  # learners arrive one by one; the holders they are pointed at hold it
        asked, depth = [0], 0
        while asked:
            holder = asked.pop(0)
            assert holder in holds
            decision = fanouts[holder].decide(7, _id(learner))
            depth += 1
            if isinstance(decision, Serve):
                uploads[holder] += 1
                holds.add(learner)
                break
            assert isinstance(decision, PointTo)
            asked = [int.from_bytes(h, "big") for h in decision.holders]
        hops[learner] = depth
    assert holds == set(range(n_learners + 1))
    return dict(uploads), hops


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), fanout=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_every_learner_gets_the_version_and_no_peer_uploads_it_more_than_fanout_times(
    n: int, fanout: int, seed: int
) -> None:
    uploads, hops = _spread(n, fanout, random.Random(seed))
    assert max(uploads.values()) <= fanout
    assert sum(uploads.values()) == n
    if fanout >= 2:  # a fanout-ary tree: the deepest learner is about log_fanout(n) pointers away
        assert max(hops.values()) <= 2 + math.ceil(math.log(n + 1, fanout)) * 2
    else:  # a chain
        assert max(hops.values()) <= n + 1


def test_a_thousand_learners_cost_the_owner_two_uploads() -> None:
    uploads, hops = _spread(1000, 2, random.Random(0))
    assert uploads[0] == 2 and max(uploads.values()) == 2
    assert max(hops.values()) <= 12


def test_a_budget_bounds_a_versions_uploads_whatever_the_fallbacks() -> None:
    fan = Fanout(1, max_uploads=3)
    assert isinstance(fan.decide(1, _id(1), size=100), Serve)
    decisions = [fan.decide(1, _id(n), fallback=True, size=100) for n in range(2, 40)]
    assert sum(isinstance(d, Serve) for d in decisions) == 2  # 3 x 100 bytes in all
    pointed = [d for d in decisions if isinstance(d, PointTo)]
    assert len(pointed) == 36 and fan.over_budget == 36
    # pointed at those that hold it: the direct serve, then the fallbacks served
    assert {h for d in pointed for h in d.holders} == {_id(1), _id(2), _id(3)}
    assert all("budget" in d.reason for d in pointed)


def test_past_the_budget_with_nobody_to_point_at_a_request_is_refused() -> None:
    fan = Fanout(1, max_uploads=1)
    assert isinstance(fan.decide(1, None, size=10), Serve)  # anonymous: it cannot hold the version
    refused = fan.decide(1, None, fallback=True, size=10)
    assert isinstance(refused, Refuse) and "take a later version" in refused.reason


def test_the_budget_counts_bytes_in_the_versions_first_upload() -> None:
    fan = Fanout(2, max_uploads=3)
    assert isinstance(fan.decide(1, _id(1), size=10), Serve)  # an update: the unit is 10 bytes
    over = fan.decide(1, _id(2), size=80)  # the full version would pass 30 bytes
    assert isinstance(over, PointTo) and over.holders == (_id(1),)
    assert isinstance(fan.decide(1, _id(3), size=10), Serve)


def test_a_budget_in_full_versions_lets_many_small_updates_and_a_few_full_ones_through() -> None:
    """An owner counts its budget in the version's full size, whichever form it serves: a
    learner that needs the full version (a resync) is not refused because updates, an eighth of
    its size, were served first."""
    fan = Fanout(1, max_uploads=3)
    decisions = [fan.decide(1, _id(1), size=10, unit=80)]
    decisions += [fan.decide(1, _id(n), fallback=True, size=10, unit=80) for n in range(2, 20)]
    assert sum(isinstance(d, Serve) for d in decisions) == 19  # 190 of 240 bytes
    assert isinstance(fan.decide(1, _id(30), fallback=True, size=80, unit=80), PointTo)  # 270 > 240
    assert isinstance(fan.decide(1, _id(31), fallback=True, size=10, unit=80), Serve)


def test_a_final_version_passes_the_budget() -> None:
    fan = Fanout(1, max_uploads=1)
    fan.decide(1, _id(1), size=10)
    assert isinstance(fan.decide(1, _id(2), fallback=True, size=10), PointTo)
    assert isinstance(fan.decide(1, _id(2), fallback=True, size=10, must=True), Serve)


def test_a_request_that_must_be_served_is_never_refused() -> None:
    # a learner told to resync that fetched this version already (not adopted yet) and has nobody
    # to be pointed at: refused as a repeat, it would wait for a later version that a round
    # waiting for its contribution never makes
    fan = Fanout(1)
    for _ in range(3):
        fan.decide(2, _id(1))
    assert isinstance(fan.decide(2, _id(1)), Refuse)
    assert isinstance(fan.decide(2, _id(1), must=True), Serve)
    fan.decide(2, _id(1), fallback=True)
    assert isinstance(fan.decide(2, _id(1), fallback=True), Refuse)  # a second fallback
    assert isinstance(fan.decide(2, _id(1), fallback=True, must=True), Serve)
    budget = Fanout(1, max_uploads=1)
    budget.decide(2, _id(1), size=10)
    assert isinstance(
        budget.decide(2, _id(1), size=10), Refuse
    )  # past the budget, nobody else holds it
    assert isinstance(budget.decide(2, _id(1), size=10, must=True), Serve)


def test_a_version_owed_to_a_resync_is_served_from_here_not_pointed_at_holders() -> None:
    # the holders a resyncing learner would be pointed at may be stuck in the same round, waiting
    # for the version themselves (the bench's kill test: 10 s a pointer, twice)
    fan = Fanout(1, max_uploads=1)
    fan.decide(2, _id(1), size=10)
    assert isinstance(fan.decide(2, _id(2), size=10), PointTo)
    assert isinstance(fan.decide(2, _id(2), size=10, must=True), PointTo)  # a final may be pointed
    pointed = fan.pointed
    d = fan.decide(2, _id(2), size=10, direct=True)
    assert isinstance(d, Serve) and fan.pointed == pointed
    assert isinstance(fan.decide(2, _id(3), size=10), PointTo)  # what it uploaded still counts


def test_a_requester_that_fell_back_is_not_named_a_likely_holder() -> None:
    fan = Fanout(1, max_uploads=1)
    fan.decide(1, _id(1), size=10)
    assert isinstance(fan.decide(1, _id(2), size=10), PointTo)  # pointed: likely to hold it soon
    assert isinstance(fan.decide(1, _id(3), size=10), PointTo)
    d = fan.decide(1, _id(4), fallback=True, size=10)
    assert isinstance(d, PointTo) and set(d.holders) == {_id(1), _id(2), _id(3)}
    fan.decide(1, _id(2), fallback=True, size=10)  # 2 did not get it after all
    d = fan.decide(1, _id(5), fallback=True, size=10)
    assert isinstance(d, PointTo) and _id(2) not in d.holders


def test_a_budget_below_the_fanout_is_refused() -> None:
    with pytest.raises(ValueError, match="max_uploads"):
        Fanout(2, max_uploads=1)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 120),
    hostile=st.floats(0.0, 0.6),
    budget=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_with_hostile_holders_every_honest_learner_gets_the_version_and_the_owner_stays_in_budget(
    n: int, hostile: float, budget: int, seed: int
) -> None:
    """Learners 1..n fetch one version; hostile ones never serve it. A learner tries the holders
    it is pointed at (following their pointers), falls back to the owner, and when that fails
    too, asks again later, and when the owner points it elsewhere instead of serving the fallback,
    asks those holders for a fallback; the owner (peer 0) has a budget of ``budget`` uploads. Once one honest
    learner holds the version, all do; when the owner's budget went to hostile learners only, the
    honest ones take a later version (the owner still uploads no more)."""
    rng = random.Random(seed)
    bad = {peer for peer in range(1, n + 1) if rng.random() < hostile}
    fanouts = {
        peer: Fanout(1, max_uploads=budget) if peer == 0 else Fanout(2) for peer in range(n + 1)
    }
    holds, uploads, from_owner = {0}, collections.Counter[int](), set[int]()

    def ask(holder: int, learner: int, fallback: bool = False) -> list[int] | None:
        """Serve (None) or the holders pointed at ([] for a refusal)."""
        if holder in bad or holder not in holds:
            return []
        decision = fanouts[holder].decide(3, _id(learner), fallback=fallback, size=10)
        if isinstance(decision, Serve):
            uploads[holder] += 1
            if holder == 0:
                from_owner.add(learner)
            holds.add(learner)
            return None
        return (
            [int.from_bytes(h, "big") for h in decision.holders]
            if isinstance(decision, PointTo)
            else []
        )

    def via(pointed: list[int], learner: int, fallback: bool = False) -> bool:
        queue, tried = list(pointed), {0, learner}
        while queue and len(tried) < 12:
            holder = queue.pop(0)
            if holder in tried:
                continue
            tried.add(holder)
            more = ask(holder, learner, fallback)
            if more is None:
                return True
            queue[:0] = more
        return False

    honest = [peer for peer in range(1, n + 1) if peer not in bad]
    for _ in range(30):  # rounds of asking again
        waiting = [peer for peer in range(1, n + 1) if peer not in holds]
        rng.shuffle(waiting)
        for learner in waiting:
            pointed = ask(0, learner)
            if pointed is None or via(pointed, learner):
                continue
            again = ask(0, learner, fallback=True)
            if again is not None:  # the owner's budget is spent: the likely holders, as a fallback
                via(again, learner, fallback=True)
        if all(peer in holds for peer in honest):
            break
    assert uploads[0] <= budget
    if not all(peer in holds for peer in honest):  # only when the budget went to hostile learners
        assert uploads[0] == budget and not from_owner - bad


def test_a_small_swarm_is_served_whole_by_its_owner_and_a_larger_one_spreads() -> None:
    # 3 learners asking, whole_swarm 3: none is pointed at a holder (one more transfer at the
    # end of every round); 4 asking: the owner serves its fanout and points the rest
    small = Fanout(1, max_uploads=3.0, whole_swarm=3)
    assert all(isinstance(small.decide(1, _id(n), learners=3), Serve) for n in range(1, 4))
    large = Fanout(1, max_uploads=3.0, whole_swarm=3)
    decisions = [large.decide(1, _id(n), learners=4) for n in range(1, 5)]
    assert isinstance(decisions[0], Serve)
    assert all(isinstance(d, PointTo) and d.holders == (_id(1),) for d in decisions[1:])
    unknown = Fanout(1, max_uploads=3.0, whole_swarm=3)  # no count: the fixed fanout
    assert isinstance(unknown.decide(1, _id(1)), Serve)
    assert isinstance(unknown.decide(1, _id(2)), PointTo)


def test_a_small_swarm_served_whole_stays_within_the_upload_budget() -> None:
    fan = Fanout(1, max_uploads=3.0, whole_swarm=3)
    for n in range(1, 4):
        assert isinstance(fan.decide(1, _id(n), size=100, learners=3), Serve)
    # a repeat of a direct serve would be a fourth upload: past the budget, pointed elsewhere
    again = fan.decide(1, _id(1), size=100, learners=3)
    assert isinstance(again, PointTo) and _id(1) not in again.holders
    assert fan.served == 3 and fan.over_budget == 1
    with pytest.raises(ValueError, match="whole_swarm"):
        Fanout(1, max_uploads=3.0, whole_swarm=4)
