"""Validated publication's pure decisions (``protocol.diloco.validation``) on a fake problem: a
quadratic loss per window around a noisy target, honest steps towards it, hurtful ones away."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.validation import (
    MIN_POOL_RATIO,
    ValidationConfig,
    compare,
    draw_seed,
    draw_windows,
    judge,
)

CFG = ValidationConfig(windows=16)
DIM = 8


def _problem(seed: int) -> tuple[list[float], list[list[float]]]:
    """A start point and, per window of a pool of 1024, a target near the origin."""
    rng = random.Random(seed)
    start = [rng.uniform(1.0, 2.0) * rng.choice((-1, 1)) for _ in range(DIM)]
    targets = [[rng.gauss(0.0, 0.1) for _ in range(DIM)] for _ in range(1024)]
    return start, targets


def _losses(
    theta: list[float], targets: list[list[float]], windows: tuple[int, ...]
) -> list[float]:
    return [sum((a - b) ** 2 for a, b in zip(theta, targets[w], strict=True)) for w in windows]


def _apply(theta: list[float], *steps: list[float]) -> list[float]:
    """The mean of ``steps`` applied (an outer step at lr 1 over the round's contributions)."""
    return [t + sum(s[i] for s in steps) / len(steps) for i, t in enumerate(theta)]


def test_windows_reproducible_from_the_logged_seed() -> None:
    seed = draw_seed(random.Random(7))
    first = draw_windows(4096, 16, seed)
    assert first == draw_windows(4096, 16, seed)  # what replay redraws from the log
    assert len(set(first)) == 16 and all(0 <= w < 4096 for w in first)
    assert draw_windows(4096, 16, seed + 1) != first


def test_windows_vary_between_checks() -> None:
    rng = random.Random(1)
    draws = {draw_windows(4096, 16, draw_seed(rng)) for _ in range(50)}
    assert len(draws) == 50


def test_a_pool_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        draw_windows(MIN_POOL_RATIO * 16 - 1, 16, 0)


def test_compare_noise_floor() -> None:
    flat = [2.0] * 16
    assert not compare(flat, [2.0 + 1e-4] * 16, CFG).hurts  # under min_rise of the loss
    assert compare(flat, [2.1] * 16, CFG).hurts
    noisy_after = [2.0 + (0.5 if i % 2 else -0.45) for i in range(16)]  # mean +0.025, spread 0.5
    assert not compare(flat, noisy_after, CFG).hurts
    assert compare(flat, [float("nan")] + flat[1:], CFG).hurts


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    honest=st.integers(1, 3),
    strength=st.floats(0.3, 2.0),
    kind=st.sampled_from(["signflip", "ipm", "away"]),
)
def test_the_contribution_that_raises_the_loss_is_dropped(
    seed: int, honest: int, strength: float, kind: str
) -> None:
    start, targets = _problem(seed)
    rng = random.Random(seed)
    windows = draw_windows(len(targets), CFG.windows, draw_seed(rng))
    honest_steps = {bytes([i]): [-x * rng.uniform(0.3, 0.6) for x in start] for i in range(honest)}
    mean = [sum(s[i] for s in honest_steps.values()) / honest for i in range(DIM)]
    bad = {
        "signflip": [-x for x in mean],
        "ipm": [-strength * x for x in mean],
        "away": [x * strength for x in start],
    }[kind]
    steps = {**honest_steps, b"\xff": bad}
    before = _losses(start, targets, windows)
    candidate = _losses(_apply(start, *steps.values()), targets, windows)
    alone = {p: _losses(_apply(start, s), targets, windows) for p, s in steps.items()}
    verdict = judge(before, candidate, alone, CFG)
    if verdict.publish:  # the honest work outweighed it: the candidate is better than the current
        assert compare(before, candidate, CFG).rise <= compare(before, candidate, CFG).margin
        return
    assert b"\xff" in verdict.drop
    assert verdict.drop == {b"\xff"}  # every honest one is kept
    assert set(honest_steps) <= verdict.helped
    assert set(verdict.severity) == verdict.drop and verdict.severity[b"\xff"] >= 1.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), honest=st.integers(1, 4))
def test_honest_rounds_publish(seed: int, honest: int) -> None:
    start, targets = _problem(seed)
    rng = random.Random(seed)
    windows = draw_windows(len(targets), CFG.windows, draw_seed(rng))
    steps = [[-x * rng.uniform(0.2, 0.8) for x in start] for _ in range(honest)]
    verdict = judge(
        _losses(start, targets, windows),
        _losses(_apply(start, *steps), targets, windows),
        None,
        CFG,
    )
    assert verdict.publish and not verdict.drop, verdict.reason


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), pairs=st.integers(1, 3), strength=st.floats(1.0, 3.0))
def test_colluders_who_cancel_the_honest_work_are_scored_and_dropped(
    seed: int, pairs: int, strength: float
) -> None:
    """Each colluder sends minus ``strength`` times one honest learner's step, so that the round's
    candidate barely moves: it does not raise the loss, which let them through when only a
    hurtful candidate was scored; a flat one is scored too, and every colluder hurts alone."""
    start, targets = _problem(seed)
    rng = random.Random(seed)
    windows = draw_windows(len(targets), CFG.windows, draw_seed(rng))
    honest = {bytes([i]): [-x * rng.uniform(0.3, 0.6) for x in start] for i in range(pairs)}
    bad = {
        bytes([0xF0 + i]): [-strength * x for x in step] for i, step in enumerate(honest.values())
    }
    before = _losses(start, targets, windows)
    # the normed mean takes each contribution as a unit direction at the median norm: the
    # colluders' directions cancel the honest ones whatever their own norm
    at_honest_norm = [[x / strength for x in step] for step in bad.values()]
    candidate = _losses(_apply(start, *honest.values(), *at_honest_norm), targets, windows)
    overall = compare(before, candidate, CFG)
    assert (
        not overall.hurts and not overall.rise < -overall.margin
    )  # flat: the old rule published it
    assert judge(before, candidate, None, ValidationConfig(windows=16, rule=1)).publish
    first = judge(before, candidate, None, CFG)
    assert not first.publish and not first.drop and "does not lower the loss" in first.reason
    alone = {p: _losses(_apply(start, s), targets, windows) for p, s in {**honest, **bad}.items()}
    verdict = judge(before, candidate, alone, CFG)
    assert not verdict.publish and verdict.drop == set(bad) and verdict.helped == set(honest)


def test_a_flat_candidate_none_of_whose_work_hurts_is_published() -> None:
    before = [1.0 + 0.01 * i for i in range(16)]
    flat = [b + (0.001 if i % 2 else -0.001) for i, b in enumerate(before)]
    first = judge(before, flat, None, CFG)
    assert not first.publish and not first.drop  # the owner scores each contribution
    better = [b - 0.05 for b in before]
    second = judge(before, flat, {b"a": better, b"b": flat}, CFG)
    assert second.publish and not second.drop and second.helped == {b"a"} and not second.whole


def test_a_hurtful_candidate_asks_for_scores_then_drops_the_round_when_none_hurts_alone() -> None:
    before = [1.0 + 0.01 * i for i in range(16)]
    worse = [b + 0.2 for b in before]
    first = judge(before, worse, None, CFG)
    assert not first.publish and not first.drop and "scoring" in first.reason
    fine = [b - 0.05 for b in before]
    second = judge(before, worse, {b"a": fine, b"b": before}, CFG)
    assert (
        not second.publish and second.drop == {b"a", b"b"} and "round is dropped" in second.reason
    )
    assert second.helped == {b"a"}


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="at least 2 windows"):
        ValidationConfig(windows=1)
    with pytest.raises(ValueError, match="every"):
        ValidationConfig(every=0)


def test_severity_is_the_rise_in_noise_margins_so_a_bare_false_positive_weighs_least() -> None:
    """A contribution just past the noise is dropped with severity near 1, a gross one far above:
    standing (``hurt_scale``) charges the first half a HURT and the second twice."""
    before = [1.0 + 0.01 * (w % 4) for w in range(16)]
    marginal = [b + 0.0035 for b in before]  # a rise just past the 0.2 % floor (0.00209)
    gross = [b + 0.05 for b in before]
    alone = {b"\x01": marginal, b"\x02": gross, b"\x03": [b - 0.01 for b in before]}
    candidate = [b + 0.02 for b in before]
    verdict = judge(before, candidate, alone, CFG)
    assert not verdict.publish and verdict.drop == {b"\x01", b"\x02"}
    assert 1.0 <= verdict.severity[b"\x01"] < 2.0 < 4.0 < verdict.severity[b"\x02"]
