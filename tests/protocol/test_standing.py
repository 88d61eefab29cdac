"""Standing per sender key: bounded scores, attackers fall below honest keys, slow recovery,
Sybil keys cannot outrank long-honest ones, bounded memory, export/restore round-trips."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.standing import Event, Standing, StandingConfig, bounded_scale, hurt_scale

CFG = StandingConfig()
events = st.sampled_from(list(Event))
histories = st.lists(st.tuples(st.integers(0, 3), events, st.integers(0, 3)), max_size=200)


def _key(i: int) -> bytes:
    return bytes([i]) * 32


@settings(max_examples=200, deadline=None)
@given(histories)
def test_every_score_stays_within_floor_and_credit(history: list[tuple[int, Event, int]]) -> None:
    standing, version = Standing(), 0
    for peer, event, step in history:
        version += step
        score = standing.record(_key(peer), event, version=version)
        assert CFG.floor <= score <= CFG.max_credit
    for later in (version, version + 7, version + 10_000):
        for peer in range(4):
            assert CFG.floor <= standing.score(_key(peer), version=later) <= CFG.max_credit


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from([Event.CLIPPED, Event.HURT, Event.REFUSED, Event.BOUNDED]),
        min_size=1,
        max_size=60,
    ),
    st.lists(st.sampled_from([Event.MERGED, Event.HELPED]), min_size=60, max_size=60),
)
def test_an_attacker_whose_work_is_all_clipped_or_hurt_falls_below_honest(
    attack: list[Event], honest: list[Event]
) -> None:
    standing = Standing()
    attacker, learner = _key(1), _key(2)
    for version, (bad, good) in enumerate(zip(attack, honest, strict=False), start=1):
        standing.record(attacker, bad, version=version)
        standing.record(learner, good, version=version)
    end = len(attack)
    assert standing.score(attacker, version=end) < standing.score(learner, version=end)
    assert standing.refused(learner, version=end) is None


def test_a_key_clipped_every_round_is_refused_with_a_reason_then_recovers_slowly() -> None:
    standing, attacker = Standing(), _key(1)
    version = 0
    while standing.refused(attacker, version=version) is None:
        version += 1
        standing.record(attacker, Event.CLIPPED, version=version)
        assert version < 10, "a key clipped every round must be refused within ten rounds"
    reason = standing.refused(attacker, version=version)
    assert reason is not None and "standing" in reason and "below" in reason
    # slow: refused for several more versions with no new event, then let back in
    score = standing.score(attacker, version=version)
    needed = math.ceil((CFG.threshold - score) / CFG.recovery)
    assert needed >= 1
    assert standing.refused(attacker, version=version + needed - 1) is not None
    assert standing.refused(attacker, version=version + needed) is None
    # recovery stops at neutral: waiting never earns credit
    assert standing.score(attacker, version=version + 10_000) == 0.0


def test_a_key_refused_out_of_bounds_three_times_is_refused_at_once() -> None:
    standing, attacker = Standing(), _key(1)
    for _ in range(3):
        standing.record(attacker, Event.REFUSED, version=5)
    assert standing.refused(attacker, version=5) is not None


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 50),
    st.lists(st.sampled_from([Event.MERGED, Event.HELPED]), min_size=1, max_size=20),
)
def test_sybil_keys_that_contribute_once_never_outrank_a_long_honest_key(
    sybils: int, burst: list[Event]
) -> None:
    standing, honest = Standing(), _key(0)
    for version in range(1, 41):  # 40 clean rounds
        standing.record(honest, Event.MERGED, version=version)
    for i in range(
        sybils
    ):  # each Sybil sends one contribution; a burst of good events in one version
        for event in burst:
            standing.record(bytes([1, i]) * 16, event, version=41)
    top = standing.score(honest, version=41)
    assert all(
        standing.score(bytes([1, i]) * 16, version=41) <= CFG.helped < top for i in range(sybils)
    )


def test_credit_is_at_most_one_per_version() -> None:
    standing = Standing()
    for _ in range(100):
        standing.record(_key(1), Event.HELPED, version=3)
    assert standing.score(_key(1), version=3) == pytest.approx(CFG.helped)


def test_memory_is_bounded_and_a_flood_of_fresh_keys_keeps_the_refused_record() -> None:
    standing = Standing(StandingConfig(max_keys=8))
    attacker = _key(255)
    for _ in range(5):
        standing.record(attacker, Event.REFUSED, version=1)
    for i in range(100):
        standing.record(bytes([2, i]) * 16, Event.MERGED, version=1)
        assert len(standing) <= 8
    assert standing.refused(attacker, version=1) is not None


@settings(max_examples=100, deadline=None)
@given(histories, st.integers(0, 20))
def test_export_restore_round_trips(history: list[tuple[int, Event, int]], later: int) -> None:
    standing, version = Standing(), 0
    for peer, event, step in history:
        version += step
        standing.record(_key(peer), event, version=version)
    at = version + later
    peers, scores = standing.export(version=at)
    copy = Standing()
    copy.restore(peers, scores, version=at)
    for peer in range(4):
        assert copy.score(_key(peer), version=at) == pytest.approx(
            standing.score(_key(peer), version=at)
        )
        assert copy.score(_key(peer), version=at + 9) == pytest.approx(
            standing.score(_key(peer), version=at + 9)
        )
    assert copy.export(version=at) == (peers, scores)


@pytest.mark.parametrize(
    "peers,scores",
    [
        ((_key(1),), ()),
        ((_key(1),), (math.nan,)),
        ((_key(1),), (math.inf,)),
        ((_key(1),), (CFG.max_credit + 1,)),
        ((_key(1),), (CFG.floor - 1,)),
    ],
)
def test_restore_refuses_bad_tuples_and_changes_nothing(
    peers: tuple[bytes, ...], scores: tuple[float, ...]
) -> None:
    standing = Standing()
    standing.record(_key(9), Event.CLIPPED, version=0)
    before = standing.export(version=0)
    with pytest.raises(ValueError):
        standing.restore(peers, scores, version=0)
    assert standing.export(version=0) == before


def test_restore_keeps_what_this_owner_saw_itself() -> None:
    standing = Standing()
    standing.record(_key(1), Event.CLIPPED, version=0)
    standing.restore((_key(1), _key(2)), (CFG.max_credit, -1.0), version=0)
    assert standing.score(_key(1), version=0) == CFG.clipped
    assert standing.score(_key(2), version=0) == -1.0


def test_lowest_and_below_summarise_for_status() -> None:
    standing = Standing()
    for _ in range(6):
        standing.record(_key(1), Event.HURT, version=0)
    standing.record(_key(2), Event.MERGED, version=0)
    assert standing.below(version=0) == 1
    assert standing.lowest(1, version=0) == [
        (_key(1), CFG.floor if 6 * CFG.hurt < CFG.floor else 6 * CFG.hurt)
    ]


# --- on the wire: ReplicaState carries the reference and the standing ---------------------------


def _replica_state(**changes: object) -> object:
    from protocol.wire.messages import ReplicaState
    from protocol.wire.tensors import EncodedTensor

    theta = EncodedTensor(
        codec="none", shape=(4,), dtype="float32", block_size=0, data=bytes(16), scales=b""
    )
    fields: dict[str, object] = dict(
        swarm="s", fragment=0, epoch=1, version=3, digest=bytes(32), theta=(theta,), momentum=()
    )
    fields.update(changes)
    return ReplicaState(**fields)  # type: ignore[arg-type]


def test_replica_state_round_trips_the_reference_and_the_standing() -> None:
    from protocol.wire import codec

    msg = _replica_state(
        norm_history=(1.5, 2.0, 0.0), standing_peers=(_key(1), _key(2)), standing_scores=(-2.5, 1.0)
    )
    assert codec.decode(codec.encode(msg).tobytes(), max_size=1 << 20) == msg


def test_a_replica_state_without_the_new_fields_is_encoded_and_decoded_as_before() -> None:
    from protocol.wire import codec

    plain = _replica_state()
    data = codec.encode(plain).tobytes()
    # the bytes an older sender makes (no such fields): an older peer reads them, and we decode
    # them with the fields empty
    assert b"norm_history" not in data and b"standing_peers" not in data
    assert codec.decode(data, max_size=1 << 20) == plain


@pytest.mark.parametrize(
    "changes",
    [
        dict(norm_history=(-1.0,)),
        dict(norm_history=(1.0,) * 65),
        dict(standing_peers=(_key(1),), standing_scores=()),
        dict(standing_peers=(b"short",), standing_scores=(0.5,)),
        dict(standing_peers=(_key(1),), standing_scores=(1e9,)),
    ],
)
def test_replica_state_refuses_bad_references_and_standings(changes: dict[str, object]) -> None:
    from protocol.errors import DecodeError

    with pytest.raises(DecodeError):
        _replica_state(**changes)


def test_replica_state_refuses_non_finite_norms_on_the_wire() -> None:
    from protocol.errors import DecodeError
    from protocol.wire import codec

    with pytest.raises((DecodeError, ValueError)):
        codec.encode(_replica_state(norm_history=(math.inf,)))


# --- a new owner's starting reference (protocol.diloco.reference) --------------------------------


def test_a_plausible_handed_reference_is_taken_and_a_wild_one_ignored_for_what_is_measured() -> (
    None
):
    from protocol.diloco.reference import PLAUSIBLE_FACTOR, starting_reference

    ref, why = starting_reference((1.0, 1.2, 0.9), (1.1,))
    assert ref == (1.0, 1.2, 0.9) and "handed" in why
    for wild in (1.1 * PLAUSIBLE_FACTOR * 2, 1.1 / PLAUSIBLE_FACTOR / 2):
        ref, why = starting_reference((wild,) * 3, (1.1,))
        assert ref == (1.1,) and "ignored" in why


def test_with_nothing_handed_the_reference_is_seeded_from_measured_updates_and_junk_is_dropped() -> (
    None
):
    from protocol.diloco.reference import starting_reference, update_norm_estimate

    assert update_norm_estimate(2.0, 2, lr=0.5) == 2.0
    assert (
        update_norm_estimate(0.0, 1, lr=1.0) is None
        and update_norm_estimate(1.0, 0, lr=1.0) is None
    )
    assert update_norm_estimate(math.inf, 1, lr=1.0) is None
    assert starting_reference((), (0.5,))[0] == (0.5,)
    assert starting_reference((math.nan, -1.0), ())[0] == ()
    assert starting_reference((), ())[0] == ()


def test_handed_norms_longer_than_the_fragment_are_dropped_even_with_nothing_measured() -> None:
    from protocol.diloco.reference import starting_reference

    ref, why = starting_reference((1e9, 1e9, 0.5), (), ceiling=10.0)
    assert ref == (0.5,) and "2 of the handed norms dropped" in why
    assert starting_reference((1e9,), (), ceiling=10.0)[0] == ()


# --- handed norms carry their senders: a successor counts each sender once ----------------------
H = 200
A, B, C, X = (_key(i) for i in (0xA1, 0xB2, 0xC3, 0xEE))


def _merged_round(merger: object, now: float, sends: list[tuple[bytes, float]]) -> object:
    """One round of ``sends`` (sender, whole norm), closed on every expected one and published;
    returns the merge decision."""
    from protocol.diloco.merge import FragmentMerger

    assert isinstance(merger, FragmentMerger)
    merger.set_expected(len(sends), now=now)
    decision = None
    for peer, norm in sends:
        decision = merger.on_contribution(
            peer,
            base_version=merger.version,
            tokens=H * 100,
            steps=H,
            step_time=1.0,
            payload=None,
            norm=norm,
            now=now,
        )
    assert decision is not None and decision.kind == "merge", decision
    merger.on_published(merger.version + 1, sync_time=0.0, now=now)
    return decision


def _successor_round(handoff: object) -> dict[bytes, float]:
    """A new owner seeded from ``handoff`` (a decoded ``ReplicaState``), its first round: X and C
    at 10. Returns each sender's clip scale (1.0: not clipped)."""
    from protocol.diloco.merge import FragmentMerger
    from protocol.diloco.reference import starting_history
    from protocol.wire.messages import ReplicaState

    assert isinstance(handoff, ReplicaState)
    successor = FragmentMerger(0, _MERGE, version=handoff.version, now=100.0)  # type: ignore[arg-type]
    reference, _ = starting_history(handoff.handed_norms, ())
    successor.seed_reference(reference)
    decision = _merged_round(successor, 101.0, [(X, 10.0), (C, 10.0)])  # a second to step in
    return {e.peer: e.clip for e in decision.entries}  # type: ignore[attr-defined]


def _merge_config() -> object:
    from protocol.diloco.merge import MergeConfig

    return MergeConfig(
        quorum=1, max_tokens_per_step=100, max_claimed_steps=2 * H, reference_min_steps=H // 2
    )


_MERGE = _merge_config()


def test_a_sender_in_a_successors_first_round_counts_once_not_also_by_its_handed_norm() -> None:
    """The predecessor merged A and B at norm 1, then X (clipped to 4 x 1). Its successor's first
    round holds X and C at 10: one norm per sender is A 1, B 1, X 10, C 10, lower median 1, so
    both are clipped to 4. Counting X also by the norm it had merged before (4: handoffs without
    senders, as before them) makes the pool 1, 1, 4, 10, 10 and the reference 4: nothing clipped."""
    from protocol.diloco.merge import FragmentMerger
    from protocol.diloco.reference import on_the_wire
    from protocol.wire import codec

    predecessor = FragmentMerger(0, _MERGE, version=0, now=0.0)  # type: ignore[arg-type]
    _merged_round(predecessor, 1.0, [(A, 1.0), (B, 1.0)])
    _merged_round(predecessor, 2.0, [(X, 10.0)])
    assert predecessor.reference() == ((A, 1.0), (B, 1.0), (X, 4.0))
    norms, senders = on_the_wire(predecessor.reference())
    assert senders == (A, B, X)

    def handed(**fields: object) -> object:  # over the wire, as a successor decodes it
        msg = _replica_state(version=predecessor.version, **fields)
        return codec.decode(codec.encode(msg).tobytes(), max_size=1 << 20)

    clips = _successor_round(handed(norm_history=norms, norm_senders=senders))
    assert clips[X] == pytest.approx(0.4) and clips[C] == pytest.approx(0.4)
    # an older predecessor's handoff (norms alone) still reads, its norms anonymous: X's old
    # norm then votes beside its new one, which is what every handoff did before senders
    older = handed(norm_history=norms)
    assert older.handed_norms == ((None, 1.0), (None, 1.0), (None, 4.0))  # type: ignore[attr-defined]
    assert _successor_round(older) == {X: 1.0, C: 1.0}


def test_replica_state_norm_senders_pair_up_with_the_norms_or_are_absent() -> None:
    from protocol.errors import DecodeError
    from protocol.wire import codec

    msg = _replica_state(norm_history=(1.0, 2.0), norm_senders=(_key(1), b""))
    back = codec.decode(codec.encode(msg).tobytes(), max_size=1 << 20)
    assert back == msg and back.handed_norms == ((_key(1), 1.0), (None, 2.0))  # type: ignore[attr-defined]
    assert b"norm_senders" not in codec.encode(_replica_state(norm_history=(1.0,))).tobytes()
    for bad in ((_key(1),), (_key(1), b"short")):
        with pytest.raises(DecodeError):
            _replica_state(norm_history=(1.0, 2.0), norm_senders=bad)


def test_a_hurt_weighs_by_its_severity_so_honest_false_positives_do_not_get_a_key_refused() -> None:
    """An honest learner flagged just past the noise once every 5 versions (4x the rate measured
    at H = 20 under validation rule 2) stays above the threshold for 200 versions; an attacker
    flagged at 4 margins as often is refused, and one flagged at 4 margins once every 3 versions
    stays refused. With every HURT at full weight the honest learner would fall below too."""
    standing, honest, attacker, steady = Standing(), _key(1), _key(2), _key(3)
    flat = Standing()
    lowest_honest, lowest_flat = 0.0, 0.0
    for version in range(1, 201):
        for key, severity, every in ((honest, 1.1, 5), (attacker, 4.0, 5), (steady, 4.0, 3)):
            if version % every == 0:
                standing.record(key, Event.HURT, version=version, severity=severity)
            else:
                standing.record(key, Event.MERGED, version=version)
        lowest_honest = min(lowest_honest, standing.score(honest, version=version))
        if version % 5 == 0:  # the same record, every HURT at its whole effect
            flat.record(honest, Event.HURT, version=version)
        else:
            flat.record(honest, Event.MERGED, version=version)
        lowest_flat = min(lowest_flat, flat.score(honest, version=version))
    assert lowest_honest > CFG.threshold > lowest_flat  # weighted: kept; unweighted: refused
    assert standing.score(attacker, version=200) < lowest_honest
    assert standing.refused(steady, version=200) is not None
    assert hurt_scale(1.0) == 0.5 and hurt_scale(2.0) == 1.0 and hurt_scale(9.0) == 2.0
    assert hurt_scale(float("nan")) == 1.0 and hurt_scale(float("inf")) == 2.0


def test_other_events_ignore_severity_and_an_unmeasured_hurt_weighs_in_whole() -> None:
    a, b = Standing(), Standing()
    for event in (e for e in Event if e not in (Event.HURT, Event.BOUNDED)):
        assert a.record(_key(1), event, version=1, severity=8.0) == b.record(
            _key(1), event, version=1
        )
    assert a.record(_key(2), Event.HURT, version=1) == CFG.hurt


def test_a_claim_far_past_the_bound_costs_by_how_far_and_a_liar_ends_below_honest_keys() -> None:
    """``lie-tokens`` claims 1000x its steps and tokens: bounded on every contribution at ~500x
    the owner's count. Honest learners are bounded once or twice a run after a stall, at most ~2x.
    Before, a capped claim cost nothing: the liar earned what the honest keys earned. Now each cap
    costs by how far past the bound it went, so the liar falls below every honest key, which never
    nears the threshold."""
    assert bounded_scale(1.1) == 0.5 and bounded_scale(2.0) == 1.0 and bounded_scale(500.0) == 4.0
    assert bounded_scale(float("inf")) == 4.0 and bounded_scale(float("nan")) == 4.0
    standing = Standing()
    honest, liar = _key(1), _key(2)
    lowest_honest = 0.0
    for version in range(1, 31):
        if version in (3, 4):  # a stall: two claims capped at ~2x in a row
            standing.record(honest, Event.BOUNDED, version=version, severity=2.1)
        else:
            standing.record(honest, Event.MERGED, version=version)
        lowest_honest = min(lowest_honest, standing.score(honest, version=version))
        if version % 2:  # the liar sends every other version, as an attacker among 8 does
            standing.record(liar, Event.BOUNDED, version=version, severity=500.0)
    assert lowest_honest > -0.5 > CFG.threshold
    assert standing.score(liar, version=30) < -1.0 < standing.score(honest, version=30)
