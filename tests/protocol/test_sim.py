"""The goodput simulation: its orderings, its agreement with renewal theory, and that Decoupled
DiLoCo's goodput is what protocol/'s own merger decided."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

import protocol.sim.decoupled as decoupled_module
from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig
from protocol.sim import (
    ExpWeibull,
    Hardware,
    Outcome,
    SimConfig,
    Timing,
    simulate_data_parallel,
    simulate_decoupled,
    simulate_elastic,
    simulate_sync,
    young_interval,
)

DAY = 86400.0
HW = Hardware(
    chips=4096,
    chips_per_slice=64,
    mtbi_s=30 * DAY,
    repair=ExpWeibull(scale_s=60.0, power=2.0),
    reconfig_s=20.0,
    rejoin_wait_s=120.0,
    restart_s=30.0,
)
TIMING = Timing(step_s=2.0, inner_steps=60, sync_s=1.0, upload_s=0.5)


def cfg(**kw: Any) -> SimConfig:
    hw = replace(HW, **kw.pop("hw", {}))
    return SimConfig(
        hardware=hw, timing=kw.pop("timing", TIMING), horizon_s=kw.pop("horizon_s", 2 * DAY), **kw
    )


def test_decoupled_goodput_falls_as_mtbi_shrinks() -> None:
    goodput = [
        simulate_decoupled(cfg(learners=4, hw={"mtbi_s": d * DAY})).goodput for d in (120, 30, 8, 2)
    ]
    assert all(a > b for a, b in zip(goodput, goodput[1:], strict=False)), goodput
    assert goodput[0] > 0.97 and goodput[-1] < 0.85, goodput


def test_decoupled_goodput_rises_with_learners() -> None:
    goodput = [
        simulate_decoupled(cfg(learners=m, hw={"mtbi_s": 4 * DAY})).goodput
        for m in (1, 2, 4, 8, 16)
    ]
    assert all(a < b for a, b in zip(goodput, goodput[1:], strict=False)), goodput


def test_methods_rank_as_in_the_paper() -> None:
    c = cfg(learners=8, hw={"mtbi_s": 4 * DAY})
    g = {
        f.__name__: f(c).goodput
        for f in (simulate_data_parallel, simulate_elastic, simulate_sync, simulate_decoupled)
    }
    assert g["simulate_data_parallel"] < g["simulate_elastic"] < g["simulate_decoupled"], g
    assert g["simulate_sync"] < g["simulate_decoupled"], g


def test_no_failures_means_full_goodput() -> None:
    quiet = cfg(learners=4, hw={"mtbi_s": 1e6 * 365 * DAY, "spare_fraction": 0.25})
    assert simulate_decoupled(quiet).goodput == pytest.approx(1.0, abs=1e-9)
    assert simulate_elastic(quiet).goodput == pytest.approx(1.0, abs=1e-9)
    assert simulate_data_parallel(quiet).goodput == pytest.approx(1 / 1.25)
    # a synchronous learner idles for each merge: H steps of compute per H steps + upload + sync
    sync = simulate_sync(quiet)
    assert 0.97 < sync.goodput < 1.0 and sync.uptime == 1.0


def test_data_parallel_matches_renewal_theory() -> None:
    """Up ~ Exp(rate), down = repair + restart: goodput 1 / (1 + rate * E[outage])."""
    c = cfg(hw={"mtbi_s": 365 * DAY, "chips": 600_000}, horizon_s=200 * DAY)
    rate, outage = c.hardware.failure_rate, c.hardware.repair.mean() + c.hardware.restart_s
    out = simulate_data_parallel(c)
    assert out.goodput == pytest.approx(1 / (1 + rate * outage), abs=0.003)
    assert out.uptime == pytest.approx(out.goodput, abs=1e-9)


def test_data_parallel_checkpoints_at_young_interval() -> None:
    assert young_interval(0.0, 1.0) == math.inf
    assert young_interval(2.0, 1 / 400) == pytest.approx(40.0)
    c = cfg(hw={"mtbi_s": 365 * DAY, "chips": 600_000, "checkpoint_s": 2.0}, horizon_s=100 * DAY)
    rate, period = c.hardware.failure_rate, young_interval(2.0, c.hardware.failure_rate)
    # expected committed work per up period: whole cycles of (period + C) in an Exp(rate) draw
    q = math.exp(-rate * (period + 2.0))
    per_cycle = period * q / (1 - q)
    outage = c.hardware.repair.mean() + c.hardware.restart_s
    expected = per_cycle / (1 / rate + outage)
    assert simulate_data_parallel(c).goodput == pytest.approx(expected, abs=0.004)


def test_runs_are_deterministic_for_a_seed() -> None:
    c = cfg(learners=4, hw={"mtbi_s": 4 * DAY})
    assert simulate_decoupled(c) == simulate_decoupled(c)
    assert simulate_decoupled(c) != simulate_decoupled(replace(c, seed=1))


# -- the merger decides what counts --------------------------------------------------------------


class SpyMerger(FragmentMerger):
    """The real merger, recording every decision it returns."""

    made: list[SpyMerger] = []

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.decisions: list[Decision] = []
        self.published: list[int] = []
        SpyMerger.made.append(self)

    def _dispatch(self, event: object, now: float) -> Decision:
        d = super()._dispatch(event, now)
        self.decisions.append(d)
        return d

    def on_published(self, new_version: int, *, sync_time: float, now: float) -> Decision:
        self.published.append(new_version)
        return super().on_published(new_version, sync_time=sync_time, now=now)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> type[SpyMerger]:
    SpyMerger.made = []
    monkeypatch.setattr(decoupled_module, "FragmentMerger", SpyMerger)
    return SpyMerger


def _merged_chip_s(m: SpyMerger) -> float:
    return sum(float(e.payload) for d in m.decisions if d.kind == "merge" for e in d.entries)  # type: ignore[arg-type]


@pytest.mark.parametrize("simulate", [simulate_decoupled, simulate_sync])
def test_goodput_is_what_the_merger_merged(spy: type[SpyMerger], simulate: Any) -> None:
    c = cfg(learners=4, hw={"mtbi_s": 2 * DAY})
    out: Outcome = simulate(c)
    (merger,) = spy.made
    merges = [d for d in merger.decisions if d.kind == "merge"]
    assert out.merged == len(merges) == out.versions == merger.version
    assert merger.published == list(range(1, merger.version + 1))  # every merge published in order
    assert out.goodput * c.hardware.chips * c.horizon_s == pytest.approx(_merged_chip_s(merger))
    refused = [d.refusal for d in merger.decisions if d.refusal is not None]
    assert sorted(dict(out.refusals).items()) == sorted(
        {r: refused.count(r) for r in set(refused)}.items()
    )


def test_a_quorum_above_the_learners_is_lowered_to_them_instead_of_stalling(
    spy: type[SpyMerger],
) -> None:
    """Quorum 5 with 4 learners used to hold one contribution each forever (goodput 0, every
    later send refused as a duplicate). The effective quorum is the learners expected, so the
    swarm merges every round with all 4 in, as K = 4 would."""
    out = simulate_decoupled(cfg(learners=4, merge=MergeConfig(quorum=5, late_policy="carry")))
    (merger,) = spy.made
    merges = [d for d in merger.decisions if d.kind == "merge"]
    assert out.versions == len(merges) > 100 and out.goodput > 0.9 and out.uptime > 0.9
    assert all(len(d.entries) == 4 for d in merges)
    assert any("K = 5 lowered to the 4 learners expected" in d.reason for d in merger.decisions)
    four = simulate_decoupled(cfg(learners=4, merge=MergeConfig(quorum=4, late_policy="carry")))
    assert out.goodput == pytest.approx(four.goodput, abs=0.02)


def test_late_policy_drop_refuses_stragglers_and_costs_goodput() -> None:
    c = cfg(learners=8, hw={"mtbi_s": 2 * DAY})
    carry = simulate_decoupled(c)
    drop = simulate_decoupled(replace(c, merge=MergeConfig(late_policy="drop")))
    assert dict(drop.refusals).get("closed", 0) > 10
    assert drop.goodput < carry.goodput - 0.005
    assert drop.lost_fraction > carry.lost_fraction
