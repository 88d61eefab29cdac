"""Outer step: pseudo-gradients, weights, weighted mean and RDA, Nesterov vs torch.optim.SGD."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.outer import (
    OuterConfig,
    clamp_weights,
    clip_to_median_norm,
    merge_update,
    normed_mean,
    outer_step,
    outer_step_,
    pseudo_gradient,
    radial_directional_average,
    staleness_discount,
    token_weight,
    weighted_mean,
)
from protocol.errors import LocalProtocolError


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- pseudo-gradient and weights


def test_pseudo_gradient() -> None:
    g, local = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0], dtype=torch.bfloat16)
    d = pseudo_gradient(g, local)
    assert d.dtype == torch.float32 and d.tolist() == [0.5, -1.0]
    with pytest.raises(LocalProtocolError, match="shapes"):
        pseudo_gradient(g, torch.zeros(3))


def test_token_weight() -> None:
    assert token_weight(1000, 10, max_tokens_per_step=None) == 100_000.0
    assert token_weight(1000, 10, max_tokens_per_step=50) == 500.0 * 500.0 / 10
    assert token_weight(0, 10, max_tokens_per_step=None) == 0.0
    assert token_weight(1000, 0, max_tokens_per_step=None) == 0.0
    for bad in [(-1, 1, None), (1, -1, None), (1, 1, 0)]:
        with pytest.raises(LocalProtocolError):
            token_weight(bad[0], bad[1], max_tokens_per_step=bad[2])


def test_clamp_weights() -> None:
    assert clamp_weights([1.0, 2.0, 3.0, 100.0]) == [1.0, 2.0, 3.0, 10.0]  # median 2.5
    assert clamp_weights([1.0, 1.0, 50.0], max_median_multiple=2.0) == [1.0, 1.0, 2.0]
    assert clamp_weights([5.0]) == [5.0]
    assert clamp_weights([]) == []
    # zeros neither enter the median nor get raised: the one real weight survives (found by the
    # merge's property test: a zero median used to cap every weight to 0)
    assert clamp_weights([0.0, 0.0, 7.0]) == [0.0, 0.0, 7.0]
    assert clamp_weights([0.0, 1.0, 1.0, 9.0], max_median_multiple=2.0) == [0.0, 1.0, 1.0, 2.0]
    assert clamp_weights([0.0, 0.0]) == [0.0, 0.0]
    ws = clamp_weights([3.0, 8.0, 1.0, 40.0, 2.0], max_median_multiple=4.0)
    assert max(ws) <= 4.0 * 3.0
    for bad in ([-1.0], [math.nan], [math.inf]):
        with pytest.raises(LocalProtocolError, match="finite"):
            clamp_weights(bad)
    with pytest.raises(LocalProtocolError, match="multiple"):
        clamp_weights([1.0], max_median_multiple=0.5)


def test_staleness_discount() -> None:
    assert staleness_discount(0, 0.5) == 1.0
    assert staleness_discount(3, 0.5) == 0.125
    with pytest.raises(LocalProtocolError):
        staleness_discount(-1, 0.5)
    with pytest.raises(LocalProtocolError):
        staleness_discount(1, 1.5)


# ---------------------------------------------------------------- aggregation


def orthogonal(m: int, n: int, radius: float) -> list[torch.Tensor]:
    q, _ = torch.linalg.qr(torch.randn(n, m, generator=gen(0), dtype=torch.float64))
    return [(q[:, i] * radius).to(torch.float32) for i in range(m)]


@pytest.mark.parametrize("m", [2, 4, 8])
def test_rda_keeps_the_norm_of_orthogonal_deltas(m: int) -> None:
    deltas = orthogonal(m, 64, 3.0)
    weights = [1.0] * m
    rda = radial_directional_average(deltas, weights)
    mean = weighted_mean(deltas, weights)
    assert float(rda.norm()) == pytest.approx(3.0, rel=1e-5)
    assert float(mean.norm()) == pytest.approx(3.0 / math.sqrt(m), rel=1e-5)
    cos = float(torch.dot(rda, mean) / (rda.norm() * mean.norm()))
    assert cos == pytest.approx(1.0, abs=1e-6)  # same direction, longer step


def test_weighted_mean_and_rda_weights() -> None:
    a, b = torch.tensor([4.0, 0.0]), torch.tensor([0.0, 2.0])
    assert weighted_mean([a, b], [3.0, 1.0]).tolist() == [3.0, 0.5]
    assert weighted_mean([a, b], [1.0, 0.0]).tolist() == [4.0, 0.0]
    rda = radial_directional_average([a, b], [3.0, 1.0])
    # radius (3*4 + 1*2)/4 = 3.5 along (3*(1,0) + (0,1))/4 normalised
    expected = torch.tensor([3.0, 1.0]) / math.sqrt(10) * 3.5
    assert torch.allclose(rda, expected)
    same = radial_directional_average([a, a * 2], [1.0, 1.0])
    assert torch.allclose(same, torch.tensor([6.0, 0.0]))


def test_rda_degenerate_inputs() -> None:
    zeros = [torch.zeros(3), torch.zeros(3)]
    assert radial_directional_average(zeros, [1.0, 1.0]).tolist() == [0.0] * 3
    a = torch.tensor([1.0, 2.0, 3.0])
    assert radial_directional_average([a, -a], [1.0, 1.0]).tolist() == [0.0] * 3  # cancelling
    # a zero delta adds no direction but halves the mean norm
    half = radial_directional_average([a, torch.zeros(3)], [1.0, 1.0])
    assert torch.allclose(half, a / 2)
    single = radial_directional_average([a], [2.0])
    assert torch.allclose(single, a)


@pytest.mark.parametrize("fn", [weighted_mean, radial_directional_average, normed_mean])
def test_aggregation_errors(fn: object) -> None:
    assert callable(fn)
    a = torch.ones(2)
    with pytest.raises(LocalProtocolError, match="no deltas"):
        fn([], [])
    with pytest.raises(LocalProtocolError, match="weights"):
        fn([a], [1.0, 2.0])
    with pytest.raises(LocalProtocolError, match="shape"):
        fn([a, torch.ones(3)], [1.0, 1.0])
    with pytest.raises(LocalProtocolError, match="positive"):
        fn([a, a], [0.0, 0.0])
    with pytest.raises(LocalProtocolError, match="finite"):
        fn([a], [math.nan])


def test_clip_to_median_norm() -> None:
    ds = [
        torch.tensor([3.0, 4.0]),
        torch.tensor([0.0, 1.0]),
        torch.tensor([0.0, 100.0]),
        torch.tensor([2.0, 0.0]),
    ]
    before = [d.clone() for d in ds]
    clipped = clip_to_median_norm(ds, 2.0)  # median norm 3.5 -> cap 7
    assert [round(float(d.norm()), 5) for d in clipped] == [5.0, 1.0, 7.0, 2.0]
    assert all(torch.equal(d, b) for d, b in zip(ds, before, strict=True))
    assert clipped[0] is not ds[0]
    assert clip_to_median_norm([], 1.0) == []
    with pytest.raises(LocalProtocolError):
        clip_to_median_norm(ds, 0.0)


# ---------------------------------------------------------------- outer Nesterov


def reference_sgd(
    cfg: OuterConfig, start: torch.Tensor, deltas: list[torch.Tensor], *, foreach: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(param, momentum buffer) after each step of ``torch.optim.SGD`` fed ``delta`` as grad."""
    p = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD(
        [p],
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov and cfg.momentum > 0,
        foreach=foreach,
    )
    out = []
    for d in deltas:
        p.grad = d.clone()
        opt.step()
        buf = opt.state[p].get("momentum_buffer")
        out.append((p.detach().clone(), None if buf is None else buf.detach().clone()))
    return out


@pytest.mark.parametrize(
    "cfg",
    [
        OuterConfig(),
        OuterConfig(lr=0.4, momentum=0.9),
        OuterConfig(lr=1.0, momentum=0.0),
        OuterConfig(lr=0.7, momentum=0.5, nesterov=False),
    ],
)
@pytest.mark.parametrize("foreach", [False, True])
def test_outer_step_matches_torch_sgd_to_the_bit(cfg: OuterConfig, foreach: bool) -> None:
    start = torch.randn(1000, generator=gen(1))
    deltas = [torch.randn(1000, generator=gen(10 + i)) * 0.01 for i in range(6)]
    expected = reference_sgd(cfg, start, deltas, foreach=foreach)
    param, buffer = start.clone(), None
    for d, (want_p, want_b) in zip(deltas, expected, strict=True):
        p_in, b_in = param, buffer
        p_before = p_in.clone()
        b_before = None if b_in is None else b_in.clone()
        param, buffer = outer_step(p_in, d, b_in, cfg)
        # parameter and momentum buffer equal torch.optim.SGD's, bit for bit
        assert torch.equal(param, want_p)
        if want_b is None:
            assert buffer is None
        else:
            assert buffer is not None and torch.equal(buffer, want_b)
        # the inputs passed in are untouched (outer_step works on copies)
        assert param is not p_in and torch.equal(p_in, p_before)
        if b_in is not None:
            assert b_before is not None and buffer is not b_in and torch.equal(b_in, b_before)
    assert (buffer is None) == (cfg.momentum == 0)
    # the in-place variant gives the same bits
    inplace, buf = start.clone(), None
    for d in deltas:
        buf = outer_step_(inplace, d, buf, cfg)
    assert torch.equal(inplace, expected[-1][0])
    assert (buf is None) == (expected[-1][1] is None)
    if buf is not None:
        assert torch.equal(buf, expected[-1][1])


@pytest.mark.parametrize(
    ("cfg", "params", "buffers"),
    [
        # Nesterov: b1 = d1 = 0.5, p1 = 1 - 0.5*(0.5 + 0.5*0.5) = 0.625;
        #           b2 = 0.5*0.5 + 0.25 = 0.5, p2 = 0.625 - 0.5*(0.25 + 0.5*0.5) = 0.375
        (OuterConfig(lr=0.5, momentum=0.5), [0.625, 0.375], [0.5, 0.5]),
        # heavy ball: p1 = 1 - 0.5*0.5 = 0.75, p2 = 0.75 - 0.5*0.5 = 0.5
        (OuterConfig(lr=0.5, momentum=0.5, nesterov=False), [0.75, 0.5], [0.5, 0.5]),
        # plain SGD: p1 = 1 - 0.5*0.5 = 0.75, p2 = 0.75 - 0.5*0.25 = 0.625
        (OuterConfig(lr=0.5, momentum=0.0), [0.75, 0.625], [None, None]),
    ],
)
def test_outer_step_hand_computed(
    cfg: OuterConfig, params: list[float], buffers: list[float | None]
) -> None:
    # dyadic inputs: every intermediate is exact in fp32, so the literals are exact
    param, buffer = torch.tensor([1.0, -2.0]), None
    for d, want_p, want_b in zip([0.5, 0.25], params, buffers, strict=True):
        param, buffer = outer_step(param, torch.tensor([d, -2 * d]), buffer, cfg)
        assert param.tolist() == [want_p, -2 * want_p]
        if want_b is None:
            assert buffer is None
        else:
            assert buffer is not None and buffer.tolist() == [want_b, -2 * want_b]


def test_outer_step_does_not_mutate_inputs() -> None:
    p, d, b = torch.ones(3), torch.full((3,), 0.1), torch.full((3,), 0.2)
    new_p, new_b = outer_step(p, d, b, OuterConfig())
    assert p.tolist() == [1.0] * 3 and b.tolist() == [pytest.approx(0.2)] * 3
    assert new_b is not None and new_b is not b and new_p is not p


def test_a_plain_step_spends_a_delta_it_may_consume_with_the_same_bits() -> None:
    p, d = torch.randn(1000, generator=gen(5)), torch.randn(1000, generator=gen(6))
    cfg = OuterConfig(lr=0.7, momentum=0.0)
    kept, _ = outer_step(p, d.clone(), None, cfg)
    spent = d.clone()
    new, buffer = outer_step(p, spent, None, cfg, consume_delta=True)
    assert buffer is None and torch.equal(new, kept)
    assert new.data_ptr() == spent.data_ptr()  # written in place of the aggregate, no new vector
    untouched = d.clone()
    outer_step(p, untouched, None, cfg)
    assert torch.equal(untouched, d)


def test_plain_averaging_recovers_the_mean_local_params() -> None:
    global_ = torch.randn(50, generator=gen(2))
    locals_ = [global_ + torch.randn(50, generator=gen(3 + i)) * 0.1 for i in range(4)]
    delta = weighted_mean([pseudo_gradient(global_, loc) for loc in locals_], [1.0] * 4)
    new, buffer = outer_step(global_, delta, None, OuterConfig(lr=1.0, momentum=0.0))
    assert buffer is None
    assert torch.allclose(new, torch.stack(locals_).mean(0), atol=1e-6)


def test_outer_config_and_shape_errors() -> None:
    for kwargs in ({"lr": 0.0}, {"lr": math.inf}, {"momentum": 1.0}, {"momentum": -0.1}):
        with pytest.raises(LocalProtocolError):
            OuterConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="shapes"):
        outer_step(torch.ones(2), torch.ones(3), None, OuterConfig())
    with pytest.raises(LocalProtocolError, match="shapes"):
        outer_step(torch.ones(2), torch.ones(2), torch.ones(3), OuterConfig())


def test_cap_weights_by_others_ignores_the_liars_own_weight() -> None:
    from protocol.diloco.outer import cap_weights_by_others

    weights, capped = cap_weights_by_others([1.0, 1e6], multiple=4.0)
    assert weights == [1.0, 4.0] and capped == [False, True]
    assert cap_weights_by_others([5.0], multiple=4.0) == (
        [5.0],
        [False],
    )  # alone: nothing to compare
    assert cap_weights_by_others([0.0, 3.0], multiple=4.0) == ([0.0, 3.0], [False, False])
    with pytest.raises(LocalProtocolError):
        cap_weights_by_others([1.0], multiple=0.5)


def test_clip_factors_and_bound_to_norm() -> None:
    from protocol.diloco.outer import bound_to_norm, clip_factors

    assert clip_factors([1.0, 4.0, 10.0], reference=2.0, c=2.0) == [1.0, 1.0, 0.4]
    # a scale that would be subnormal is 0 (hypothesis found 2.25e29 * 6.6e-321 over its limit)
    assert clip_factors([2.252956018866386e29], reference=1.4882256214878484e-291, c=1.0) == [0.0]
    with pytest.raises(LocalProtocolError):
        clip_factors([math.inf], reference=1.0, c=2.0)
    delta = torch.tensor([3.0e38, 3.0e38])  # its fp32 norm overflows; the bound still holds
    out, scale = bound_to_norm(delta, 5.0)
    assert torch.allclose(out, torch.tensor([5.0, 5.0]) / math.sqrt(2.0)) and scale < 1e-37
    small, scale = bound_to_norm(torch.tensor([3.0, 4.0]), 5.0)
    assert scale == 1.0 and torch.equal(small, torch.tensor([3.0, 4.0]))


def test_rda_keeps_the_norm_of_huge_finite_deltas() -> None:
    big = torch.full((4,), 3.0e38)
    out = radial_directional_average([big, big], [1.0, 1.0])
    assert torch.isfinite(out).all() and torch.allclose(out, big)


def test_weighted_median_and_a_median_radius() -> None:
    from protocol.diloco.outer import weighted_median

    assert weighted_median([1.0, 2.0, 100.0], [1.0, 1.0, 1.0]) == 2.0
    assert weighted_median([1.0, 3.0], [1.0, 1.0]) == 2.0  # the half falls between them
    assert weighted_median([1.0, 100.0], [1.0, 3.0]) == 100.0
    with pytest.raises(LocalProtocolError):
        weighted_median([], [])
    honest = torch.tensor([1.0, 0.0])
    scaled = torch.tensor([4.0, 0.0])  # one contribution 4x longer, same direction
    mean = radial_directional_average([honest, honest, scaled], [1.0, 1.0, 1.0])
    median = radial_directional_average([honest, honest, scaled], [1.0, 1.0, 1.0], radius="median")
    assert torch.allclose(mean, torch.tensor([2.0, 0.0]))
    assert torch.allclose(median, torch.tensor([1.0, 0.0]))
    with pytest.raises(LocalProtocolError):
        radial_directional_average([honest], [1.0], radius="max")


def test_the_mean_aggregate_is_the_token_weighted_mean_and_rda_is_not() -> None:
    theta = torch.zeros(4)
    deltas = [torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 3.0, 0.0, 0.0])]
    weights, clips = [1.0, 3.0], [1.0, 1.0]
    plain = OuterConfig(lr=1.0, momentum=0.0, max_delta_ratio=math.inf)
    mean = merge_update(
        theta,
        None,
        deltas,
        weights,
        clips,
        dataclasses.replace(plain, aggregate="mean"),
        embedding=False,
    )
    assert torch.allclose(mean.theta, -weighted_mean(deltas, weights))  # theta - lr * delta
    rda = merge_update(theta, None, deltas, weights, clips, plain, embedding=False)
    assert not torch.allclose(rda.theta, mean.theta)
    with pytest.raises(LocalProtocolError, match="aggregate"):
        OuterConfig(aggregate="median")


@pytest.mark.parametrize("m", [2, 4, 16])
def test_the_normed_mean_shrinks_like_the_mean_for_orthogonal_deltas_and_rda_does_not(
    m: int,
) -> None:
    """Many pseudo-gradients that mostly disagree: RDA steps the full median norm along their
    mean direction (at 32 peers, 16 per merge, that overshot), the normed mean as far as their
    mean does, in the same direction."""
    deltas = orthogonal(m, 64, 3.0)
    weights = [1.0] * m
    normed, mean = normed_mean(deltas, weights), weighted_mean(deltas, weights)
    assert torch.allclose(normed, mean, atol=1e-6)
    assert float(normed.norm()) == pytest.approx(3.0 / math.sqrt(m), rel=1e-5)
    assert float(
        radial_directional_average(deltas, weights, radius="median").norm()
    ) == pytest.approx(3.0, rel=1e-5)


def test_the_normed_mean_counts_no_contributions_length() -> None:
    """Each delta is scaled to the (unweighted) median norm first: one scaled up 1000x, or one of
    random direction and huge norm, weighs as one unit direction, where the mean follows it."""
    honest = [
        torch.tensor([1.0, 0.0, 0.0]),
        torch.tensor([0.8, 0.6, 0.0]),
        torch.tensor([0.6, 0.8, 0.0]),
    ]
    weights = [1.0, 1.0, 1.0, 1.0]
    for attack in (honest[0] * 1000, torch.tensor([0.0, 0.0, -500.0])):
        deltas = [*honest, attack]
        normed = normed_mean(deltas, weights)
        clean = normed_mean(honest, weights[:3])
        assert float(normed.norm()) <= 1.0 + 1e-6  # never beyond the median norm
        assert float((normed - clean).norm()) < 0.35  # one unit direction of four moves it little
        assert float(weighted_mean(deltas, weights).norm()) > 100  # the mean is the attacker's
    a, b = torch.tensor([4.0, 0.0]), torch.tensor([0.0, 2.0])
    # the median norm, 3, one vote a sender (a holding 3 of the 4 weight once made it a's 4),
    # times (3*(1,0) + 1*(0,1))/4
    assert torch.allclose(normed_mean([a, b], [3.0, 1.0]), torch.tensor([2.25, 0.75]))
    assert torch.allclose(
        normed_mean([a, b], [1.0, 1.0]), torch.tensor([1.5, 1.5])
    )  # median 3: (1,0)/2 + (0,1)/2
    assert normed_mean([torch.zeros(3), torch.zeros(3)], [1.0, 1.0]).tolist() == [0.0] * 3
    big = torch.full((4,), 3.0e38)
    assert torch.isfinite(normed_mean([big, big], [1.0, 1.0])).all()


def test_the_normed_aggregate_is_chosen_by_the_config() -> None:
    theta = torch.zeros(2)
    deltas, weights, clips = (
        [torch.tensor([4.0, 0.0]), torch.tensor([0.0, 2.0])],
        [1.0, 1.0],
        [1.0, 1.0],
    )
    cfg = OuterConfig(lr=1.0, momentum=0.0, max_delta_ratio=math.inf, aggregate="normed")
    got = merge_update(theta, None, deltas, weights, clips, cfg, embedding=False)
    assert torch.allclose(got.theta, -normed_mean(deltas, weights))
    embedding = merge_update(theta, None, deltas, weights, clips, cfg, embedding=True)
    assert torch.allclose(
        embedding.theta, -weighted_mean(deltas, weights)
    )  # embeddings: the plain mean


@pytest.mark.parametrize("m", [2, 4, 16])
def test_rdas_gain_over_the_normed_mean_can_be_bounded(m: int) -> None:
    """``max_gain`` G: the step is r * min(1, G * |mean unit direction|), along RDA's direction.
    Two orthogonal deltas at G = sqrt(2) are RDA exactly; sixteen step sqrt(2) times the normed mean."""
    deltas = orthogonal(m, 64, 3.0)
    weights = [1.0] * m
    gain = math.sqrt(2)
    bounded = radial_directional_average(deltas, weights, radius="median", max_gain=gain)
    normed = normed_mean(deltas, weights)
    assert float(bounded.norm()) == pytest.approx(min(3.0, gain * 3.0 / math.sqrt(m)), rel=1e-5)
    assert torch.allclose(bounded / bounded.norm(), normed / normed.norm(), atol=1e-6)
    same = [deltas[0], deltas[0] * 2]  # agreeing deltas: no gain to bound
    assert torch.allclose(
        radial_directional_average(same, [1.0, 1.0], max_gain=1.0),
        radial_directional_average(same, [1.0, 1.0]),
    )
    cfg = OuterConfig(lr=1.0, momentum=0.0, max_delta_ratio=math.inf, rda_max_gain=gain)
    got = merge_update(torch.zeros(64), None, deltas, weights, [1.0] * m, cfg, embedding=False)
    assert torch.allclose(got.theta, -bounded)
    for bad in (0.5, math.inf, math.nan, -1.0):
        with pytest.raises(LocalProtocolError, match="rda_max_gain"):
            OuterConfig(rda_max_gain=bad)


def test_a_merge_scales_its_aggregate_before_the_bound_and_the_outer_step() -> None:
    theta = torch.zeros(2)
    deltas, weights, clips = (
        [torch.tensor([4.0, 0.0]), torch.tensor([0.0, 4.0])],
        [1.0, 1.0],
        [1.0, 1.0],
    )
    cfg = OuterConfig(lr=1.0, momentum=0.0, max_delta_ratio=math.inf, aggregate="normed")
    whole = merge_update(theta, None, deltas, weights, clips, cfg, embedding=False)
    part = merge_update(theta, None, deltas, weights, clips, cfg, embedding=False, scale=0.25)
    assert torch.allclose(part.theta, whole.theta * 0.25)
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(LocalProtocolError, match="scale"):
            merge_update(theta, None, deltas, weights, clips, cfg, embedding=False, scale=bad)


def test_a_part_of_a_step_under_momentum_is_a_plain_step_that_leaves_the_buffer() -> None:
    """A whole merge is a Nesterov step (fed into the buffer, then mu * buffer on top); a scaled
    one, a part of a step, moves theta by lr * scale * aggregate and neither feeds nor spends the
    momentum: a straggler's lone tail merges must not coast on the whole swarm's buffer."""
    theta, buffer = torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.5])
    deltas, weights, clips = [torch.tensor([0.2, 0.4])], [1.0], [1.0]
    cfg = OuterConfig(
        lr=0.7, momentum=0.9, nesterov=True, max_delta_ratio=math.inf, aggregate="mean"
    )
    whole = merge_update(theta, buffer, deltas, weights, clips, cfg, embedding=False)
    assert whole.buffer is not None and torch.allclose(whole.buffer, 0.9 * buffer + deltas[0])
    assert torch.allclose(whole.theta, theta - 0.7 * (deltas[0] + 0.9 * whole.buffer))
    part = merge_update(theta, buffer, deltas, weights, clips, cfg, embedding=False, scale=0.25)
    assert torch.equal(part.theta, theta - 0.7 * 0.25 * deltas[0])
    assert (
        part.buffer is not None and torch.equal(part.buffer, buffer) and part.buffer is not buffer
    )
    assert torch.equal(buffer, torch.tensor([0.5, 0.5]))  # the input is not modified
    first = merge_update(theta, None, deltas, weights, clips, cfg, embedding=False, scale=0.5)
    assert first.buffer is None and torch.equal(first.theta, theta - 0.7 * 0.5 * deltas[0])


@pytest.mark.parametrize("aggregate", ["normed", "rda", "mean"])
def test_norms_measured_before_the_merge_give_the_same_bits(aggregate: str) -> None:
    """The owner passes each contribution's norm64 from when it arrived; ``atoll replay``
    measures them again: both must publish the same bits, clipped deltas included (their norm
    is measured anew). A list of the wrong length is refused."""
    from protocol.diloco.norms import norm64

    deltas = [torch.randn(3000, generator=gen(i)) * (i + 1) for i in range(4)]
    weights, clips = [1.0, 2.0, 1.0, 3.0], [1.0, 0.37, 1.0, 1.0]
    theta, buffer = torch.randn(3000, generator=gen(9)), torch.randn(3000, generator=gen(10))
    cfg = OuterConfig(lr=0.7, momentum=0.9, aggregate=aggregate)
    plain = merge_update(theta, buffer, deltas, weights, clips, cfg, embedding=False)
    known = [norm64(d) for d in deltas]
    given = merge_update(theta, buffer, deltas, weights, clips, cfg, embedding=False, norms=known)
    assert torch.equal(plain.theta, given.theta) and torch.equal(plain.buffer, given.buffer)
    some = merge_update(
        theta,
        buffer,
        deltas,
        weights,
        clips,
        cfg,
        embedding=False,
        norms=[known[0], None, None, known[3]],
    )
    assert torch.equal(plain.theta, some.theta)
    if aggregate != "mean":  # a norm that is not the delta's would change the result: it is used
        wrong = merge_update(
            theta,
            buffer,
            deltas,
            weights,
            clips,
            cfg,
            embedding=False,
            norms=[2 * n for n in known],
        )
        assert not torch.equal(plain.theta, wrong.theta)
        with pytest.raises(LocalProtocolError, match="known norms"):
            merge_update(
                theta, buffer, deltas, weights, clips, cfg, embedding=False, norms=known[:2]
            )


@settings(max_examples=60, deadline=None)
@given(
    aggregate=st.sampled_from(["normed", "mean", "rda"]),
    embedding=st.booleans(),
    sizes=st.lists(st.floats(1e-3, 50.0), min_size=1, max_size=5),
    theta_size=st.floats(1e-3, 100.0),
    ratio=st.sampled_from([0.1, 1.0, 3.0]),
    scale=st.sampled_from([1.0, 0.5]),
    seed=st.integers(0, 99),
)
def test_a_merge_given_every_norm_gives_the_same_bits_and_bounds_what_it_must(
    aggregate: str,
    embedding: bool,
    sizes: list[float],
    theta_size: float,
    ratio: float,
    scale: float,
    seed: int,
) -> None:
    """The owner passes every contribution's norm and Theta's (measured when each arrived and
    when Theta was made), and the aggregate's own norm is then measured only when the longest
    delta might break the bound: the result is bit-identical to a merge that measures them all,
    as ``atoll replay`` does, whether the bound bites or not."""
    from protocol.diloco.norms import norm64

    g = gen(seed)
    deltas = [torch.randn(257, generator=g) * s for s in sizes]
    weights = [float(i % 3 + 1) for i in range(len(deltas))]
    clips = [1.0 if i % 2 == 0 else 0.5 for i in range(len(deltas))]
    theta = torch.randn(257, generator=g) * theta_size
    cfg = OuterConfig(lr=1.0, momentum=0.0, aggregate=aggregate, max_delta_ratio=ratio)
    measured = merge_update(
        theta, None, deltas, weights, clips, cfg, embedding=embedding, scale=scale
    )
    given_all = merge_update(
        theta,
        None,
        deltas,
        weights,
        clips,
        cfg,
        embedding=embedding,
        scale=scale,
        norms=[norm64(d) for d in deltas],
        theta_norm=norm64(theta),
    )
    assert torch.equal(measured.theta, given_all.theta) and measured.bounded == given_all.bounded
    assert norm64(theta - given_all.theta) <= ratio * norm64(theta) * (1 + 1e-5)


def test_a_merge_skips_measuring_an_aggregate_that_cannot_break_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from protocol.diloco import outer
    from protocol.diloco.norms import norm64

    measured: list[int] = []
    real = outer.norm64
    monkeypatch.setattr(outer, "norm64", lambda t: measured.append(t.numel()) or real(t))
    deltas = [torch.full((64,), 0.01), torch.full((64,), -0.02)]
    theta = torch.ones(64)
    cfg = OuterConfig(lr=1.0, momentum=0.0, aggregate="normed", max_delta_ratio=1.0)
    norms = [norm64(d) for d in deltas]
    merge_update(
        theta,
        None,
        deltas,
        [1.0, 1.0],
        [1.0, 1.0],
        cfg,
        embedding=False,
        norms=norms,
        theta_norm=8.0,
    )
    assert measured == []  # neither Theta's norm (given) nor the aggregate's (|d| <= 0.16 < 8)
    merge_update(
        theta,
        None,
        deltas,
        [1.0, 1.0],
        [1.0, 1.0],
        cfg,
        embedding=False,
        norms=norms,
        theta_norm=0.1,
    )
    assert measured == [
        64
    ]  # the longest delta (0.16) could break 1.0 x 0.1: the aggregate is measured
