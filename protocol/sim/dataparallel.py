"""Data-parallel baselines on the virtual clock: non-elastic and elastic.

Non-elastic (``simulate_data_parallel``): one job needs every chip. Its chips fail as one Poisson
process of rate ``chips / mtbi_s`` while it runs. A failure stops the job; it waits for the
repair (``hardware.repair``) and restarts (``restart_s``); the step in flight is part of that
outage. With ``checkpoint_s`` > 0 it instead resumes from its last checkpoint, taken every Young
interval ``sqrt(2 C / rate)`` (paying C each time, during which it can fail too), the interval
that minimises checkpoint cost plus expected rework. Failures while it is down are handled by
the same restart. Between failures nothing happens but whole checkpoint cycles, so an up period
is one random draw, not one event per step. Its hot spares (``spare_fraction``) are provisioned
chips that do no work.

Elastic (``simulate_elastic``): the job is one ``ElasticGroup`` of all chips: it drops a failed
slice and continues with the rest (``protocol.sim.group``).

Both multiply useful time by ``step_s / (step_s + dp_sync_s)``: data-parallel's gradient
exchange every step (0 inside a datacenter's fabric, as in the paper's Table 1).
"""

from __future__ import annotations

import math
import random

from protocol.sim.config import Outcome, SimConfig
from protocol.sim.events import EventQueue
from protocol.sim.group import ElasticGroup

__all__ = ["simulate_data_parallel", "simulate_elastic", "young_interval"]


def young_interval(checkpoint_s: float, rate: float) -> float:
    """Young's checkpoint interval ``sqrt(2 C / rate)`` (inf when C is 0: never checkpoint)."""
    return math.inf if checkpoint_s <= 0 or rate <= 0 else math.sqrt(2.0 * checkpoint_s / rate)


def _comm_factor(cfg: SimConfig) -> float:
    return cfg.timing.step_s / (cfg.timing.step_s + cfg.timing.dp_sync_s)


def simulate_data_parallel(cfg: SimConfig) -> Outcome:
    """Non-elastic data-parallel over ``cfg.hardware.chips`` for ``cfg.horizon_s``."""
    hw, horizon = cfg.hardware, cfg.horizon_s
    rng = random.Random(cfg.seed)
    rate = hw.failure_rate
    period = young_interval(hw.checkpoint_s, rate)
    t = useful = down = 0.0
    failures = 0
    while t < horizon:
        end = min(t + rng.expovariate(rate), horizon)
        useful += _kept(end - t, period, hw.checkpoint_s, failed=end < horizon)
        if end >= horizon:
            break
        failures += 1
        outage = hw.repair.sample(rng) + hw.restart_s
        down += min(outage, horizon - end)
        t = end + outage
    provisioned = horizon * (1.0 + hw.spare_fraction)
    return Outcome(
        method="data-parallel",
        chips=hw.chips,
        learners=1,
        goodput=useful / provisioned * _comm_factor(cfg),
        uptime=1.0 - down / horizon,
        horizon_s=horizon,
        failures=failures,
        lost_fraction=1.0 - useful / horizon - down / horizon,
    )


def _kept(run: float, period: float, checkpoint_s: float, *, failed: bool) -> float:
    """Work kept from ``run`` seconds of running: without checkpoints all of it (the step in
    flight is part of the outage); with them the whole periods before a failure, or all of it
    less checkpoint time at the horizon (the run ends with a save)."""
    if math.isinf(period):
        return run
    cycle = period + checkpoint_s
    whole = math.floor(run / cycle)
    return whole * period + (0.0 if failed else min(run - whole * cycle, period))


def simulate_elastic(cfg: SimConfig) -> Outcome:
    """Elastic data-parallel: one ``ElasticGroup`` of all chips for ``cfg.horizon_s``."""
    queue = EventQueue()
    group = ElasticGroup(
        queue,
        cfg.hardware,
        cfg.hardware.chips,
        random.Random(cfg.seed),
        until=cfg.horizon_s,
        failures=cfg.failures,
    )
    queue.run(cfg.horizon_s)
    group.advance(cfg.horizon_s)
    provisioned = cfg.hardware.chips * cfg.horizon_s
    return Outcome(
        method="elastic",
        chips=cfg.hardware.chips,
        learners=1,
        goodput=group.chip_s / provisioned * _comm_factor(cfg),
        uptime=group.compute_s / cfg.horizon_s,
        horizon_s=cfg.horizon_s,
        failures=group.failures,
    )
