"""The simulator's clock, repair distribution, elastic group rules, and the failure-domain model
against one clock per chip."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from protocol.errors import LocalProtocolError
from protocol.sim import (
    ElasticGroup,
    EventQueue,
    ExpWeibull,
    Hardware,
    Outcome,
    SimConfig,
    Timing,
    simulate_decoupled,
    simulate_elastic,
)

# -- the virtual clock ---------------------------------------------------------------------------


def test_queue_runs_in_time_order_ties_in_scheduling_order() -> None:
    q, seen = EventQueue(), []
    q.at(2.0, seen.append, "b")
    q.at(1.0, seen.append, "a")
    q.at(2.0, seen.append, "c")
    q.at(math.inf, seen.append, "never")
    q.run(until=1.5)
    assert (seen, q.now) == (["a"], 1.0)
    q.run()
    assert (seen, q.now, q.executed) == (["a", "b", "c"], 2.0, 3)


def test_queue_refuses_the_past() -> None:
    q = EventQueue()
    q.at(5.0, lambda: None)
    q.run()
    with pytest.raises(LocalProtocolError, match="before now"):
        q.at(4.0, lambda: None)
    with pytest.raises(LocalProtocolError):
        q.at(math.nan, lambda: None)


# -- exponentiated Weibull -----------------------------------------------------------------------


def test_exp_weibull_quantile_inverts_its_cdf() -> None:
    d = ExpWeibull(scale_s=30.0, shape=1.5, power=2.0)
    for u in (0.01, 0.3, 0.5, 0.9, 0.999):
        x = d.quantile(u)
        assert (1 - math.exp(-((x / 30.0) ** 1.5))) ** 2.0 == pytest.approx(u)


def test_exp_weibull_means() -> None:
    assert ExpWeibull(scale_s=10.0).mean() == pytest.approx(10.0, rel=1e-3)  # exponential
    assert ExpWeibull(scale_s=30.0, power=2.0).mean() == pytest.approx(
        45.0, rel=1e-3
    )  # 1.5 x scale
    d = ExpWeibull.with_mean(1200.0, shape=0.7, power=1.8)
    assert d.mean() == pytest.approx(1200.0, rel=1e-3)
    rng = random.Random(1)
    assert statistics.fmean(d.sample(rng) for _ in range(40000)) == pytest.approx(1200.0, rel=0.03)


@pytest.mark.parametrize(
    "kw", [{"scale_s": -1.0}, {"scale_s": 1.0, "shape": 0.0}, {"scale_s": 1.0, "power": math.inf}]
)
def test_exp_weibull_validates(kw: dict[str, float]) -> None:
    with pytest.raises(LocalProtocolError):
        ExpWeibull(**kw)


# -- the elastic group's rules, on a scripted failure schedule -----------------------------------


class Scripted:
    """Failures at given (time, slice); ``remove`` consumes the one that fired."""

    def __init__(self, script: list[tuple[float, int]]) -> None:
        self.script = list(script)

    def next_failure(self, now: float) -> tuple[float, int]:
        return self.script[0] if self.script else (math.inf, -1)

    def remove(self, slice_id: int) -> None:
        assert self.script and self.script[0][1] == slice_id
        self.script.pop(0)

    def add(self, slice_id: int, now: float) -> None:
        pass


class FixedRepair(random.Random):
    """``random()`` = 1 - 1/e: an exponential repair draw is exactly its scale."""

    def random(self) -> float:
        return 1.0 - math.exp(-1.0)


HW = Hardware(
    chips=4,
    chips_per_slice=1,
    repair=ExpWeibull(scale_s=100.0),
    reconfig_s=10.0,
    rejoin_wait_s=30.0,
    restart_s=50.0,
)


def scripted_group(
    script: list[tuple[float, int]], until: float = 300.0
) -> tuple[EventQueue, ElasticGroup]:
    q = EventQueue()
    g = ElasticGroup(q, HW, 4, FixedRepair(), until=until, source=Scripted(script))
    return q, g


def test_group_drops_absorbs_and_forces_a_rejoin() -> None:
    # 100: slice 0 fails, reconfiguration to 110; 105: slice 1 fails inside it (absorbed);
    # 200, 205: both repaired, READY; 230: the first waited 30 s, a forced reconfiguration to 240
    q, g = scripted_group([(100.0, 0), (105.0, 1)])
    q.run(300.0)
    g.advance(300.0)
    assert (g.failures, g.reconfigurations, g.live, g.down, g.ready) == (2, 2, 4, 0, set())
    assert g.compute_s == pytest.approx(100 + 90 + 30 + 60)
    assert g.chip_s == pytest.approx(4 * 100 + 2 * 90 + 2 * 30 + 4 * 60)


def test_group_repaired_slice_rides_along_with_the_next_failure() -> None:
    # 200: slice 0 READY; 220: slice 1 fails, its reconfiguration (to 230) takes slice 0 back in;
    # no forced rejoin at 230; 320: slice 1 READY, forced rejoin at 350 (to 360)
    q, g = scripted_group([(100.0, 0), (220.0, 1)], until=400.0)
    q.run(400.0)
    g.advance(400.0)
    assert (g.failures, g.reconfigurations, g.live) == (2, 3, 4)
    assert g.chip_s == pytest.approx(4 * 100 + 3 * 90 + 3 * 20 + 3 * 120 + 4 * 40)


def test_group_losing_every_slice_loses_its_state_and_restarts() -> None:
    lost: list[float] = []
    restarted: list[float] = []
    q, g = scripted_group([(10.0, 0), (11.0, 1), (12.0, 2), (13.0, 3)])
    g.on_lost, g.on_restart = lost.append, restarted.append
    q.run(300.0)
    g.advance(300.0)
    # 110: slice 0 back, restart (50 s) with it alone; 111-113 the others join that reconfiguration
    assert (lost, restarted, g.losses, g.live) == ([13.0], [110.0], 1, 4)
    assert g.compute_s == pytest.approx(10 + (300 - 160))


def test_group_computes_nothing_after_the_horizon_or_while_blocked() -> None:
    q, g = scripted_group([], until=100.0)
    g.block(20.0)
    g.unblock(50.0)
    q.run()
    g.advance(500.0)
    assert (g.compute_s, g.chip_s) == (pytest.approx(70.0), pytest.approx(280.0))


# -- failure domains against a clock per chip ----------------------------------------------------


def _hw(chips: int) -> Hardware:
    # a chip fails every 2 days: 2048 chips see ~1000 failures a day, slices of 32 chips
    return Hardware(
        chips=chips,
        chips_per_slice=32,
        mtbi_s=2 * 86400.0,
        repair=ExpWeibull(scale_s=300.0, shape=0.8, power=2.0),
        reconfig_s=20.0,
        rejoin_wait_s=120.0,
        restart_s=30.0,
    )


def _runs(fn, learners: int, kind: str, seeds: range, inner_steps: int) -> list[Outcome]:  # type: ignore[no-untyped-def]
    return [
        fn(
            SimConfig(
                hardware=_hw(2048),
                timing=Timing(step_s=1.0, inner_steps=inner_steps),
                learners=learners,
                horizon_s=2 * 86400.0,
                seed=s,
                failures=kind,
            )
        )
        for s in seeds
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("fn", "learners", "seeds", "inner_steps"),
    [
        (simulate_elastic, 1, range(16), 60),
        (simulate_decoupled, 4, range(8), 600),
    ],
    ids=["elastic", "decoupled"],
)
def test_domain_model_matches_a_clock_per_chip(
    fn, learners: int, seeds: range, inner_steps: int
) -> None:  # type: ignore[no-untyped-def]
    """The aggregated model (one Poisson process per group, uniform slice hit) gives the same
    goodput and failure rate as 2048 chips with a clock each: the mean goodputs over the seeds
    differ by less than 4 standard errors, and that is under 0.5 points."""
    by = {kind: _runs(fn, learners, kind, seeds, inner_steps) for kind in ("domain", "chip")}
    goodput = {k: [o.goodput for o in v] for k, v in by.items()}
    rate = {k: statistics.fmean(o.failures / o.horizon_s for o in v) for k, v in by.items()}
    diff = statistics.fmean(goodput["domain"]) - statistics.fmean(goodput["chip"])
    se = math.sqrt(sum(statistics.variance(g) / len(g) for g in goodput.values()))
    assert 0.5 < statistics.fmean(goodput["domain"]) < 0.95, goodput
    assert abs(diff) < 4 * se and abs(diff) < 0.005, (diff, se)
    assert rate["domain"] == pytest.approx(rate["chip"], rel=0.03), rate
