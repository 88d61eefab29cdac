"""The paper's Table 1 (goodput at 150k ... 2.4M chips, chip MTBI one year) and our constants.

arXiv 2604.21428 reports goodput for data-parallel, elastic data-parallel and Decoupled DiLoCo
with M = 2 ... 16 learners (``PAPER_TABLE``; docs/algorithm.md, "The paper's figures, as
read"). It models failures as a Poisson process per chip and repair times with an exponentiated
Weibull distribution, but gives no detection, reconfiguration or repair constants, so
``PAPER_CONSTANTS`` are ours:

- Failure domain: a slice of 256 chips; repair (the failed slice back in service) exponentiated
  Weibull with scale 30 s, shape 1, power 2 (mean 45 s).
- Elastic groups (elastic data-parallel, and each learner): a reconfiguration stalls the group
  20.5 s; a repaired slice waits up to 120 s to ride along with the next one before forcing one.
- Non-elastic data-parallel: restarts 20 s after the repair (65 s per failure in all) and holds
  10 % hot spares. Without spares the best pure-restart fit misses one cell by 3.2 points: the
  paper's row falls more slowly with scale than one outage per failure allows.
- DiLoCo: inner step 10 s, H = 60 (a contribution every 600 s), merge-plus-transfer 1 s,
  uploads within 0.5 s, and protocol/'s default merger (K = 1, grace gamma 0.8 with tau = 2,
  staleness bound 2) with late contributions carried (the node's default).

They were calibrated by ``calibrate_groups`` and ``calibrate_data_parallel`` (grid searches that
minimise the largest deviation from the table; ``atoll simulate --calibrate`` reruns them), the
elastic-group constants on the group sizes the table implies (chips / M), then checked on the
full simulation (``paper_grid``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from protocol.diloco.merge import MergeConfig
from protocol.sim.config import ExpWeibull, Hardware, Outcome, SimConfig, Timing
from protocol.sim.dataparallel import simulate_data_parallel, simulate_elastic
from protocol.sim.decoupled import simulate_decoupled

__all__ = [
    "CHIPS",
    "LEARNERS",
    "PAPER_CONSTANTS",
    "PAPER_TABLE",
    "Cell",
    "calibrate_data_parallel",
    "calibrate_groups",
    "paper_config",
    "paper_grid",
]

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
LEARNERS = (2, 4, 8, 16)
# method -> goodput (%) per entry of CHIPS; "decoupled-M" for Decoupled DiLoCo with M learners
PAPER_TABLE: dict[str, tuple[int, ...]] = {
    "data-parallel": (72, 57, 38, 27, 18),
    "elastic": (88, 80, 69, 58, 40),
    "decoupled-2": (94, 88, 80, 70, 54),
    "decoupled-4": (96, 93, 89, 82, 73),
    "decoupled-8": (98, 96, 94, 88, 80),
    "decoupled-16": (99, 98, 96, 93, 86),
}
PAPER_CONSTANTS = Hardware(
    chips=1,
    chips_per_slice=256,
    repair=ExpWeibull(scale_s=30.0, shape=1.0, power=2.0),
    reconfig_s=20.5,
    rejoin_wait_s=120.0,
    restart_s=20.0,
    spare_fraction=0.10,
)
PAPER_TIMING = Timing(step_s=10.0, inner_steps=60, sync_s=1.0, upload_s=0.5)
PAPER_MERGE = MergeConfig(late_policy="carry")


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """One cell of the grid: the paper's goodput and ours (both in %)."""

    chips: int
    learners: int
    method: str
    paper: float
    sim: float
    outcome: Outcome


def paper_config(
    chips: int,
    learners: int = 1,
    *,
    failures: int = 2000,
    seed: int = 0,
    hardware: Hardware = PAPER_CONSTANTS,
    min_days: float = 4.0,
) -> SimConfig:
    """The paper scenario at ``chips``: a horizon holding about ``failures`` chip failures, and
    at least ``min_days`` (the cells with more failures are the noisier ones)."""
    hw = replace(hardware, chips=chips)
    horizon = max(failures / hw.failure_rate, min_days * 86400.0)
    return SimConfig(
        hardware=hw,
        timing=PAPER_TIMING,
        learners=learners,
        horizon_s=horizon,
        seed=seed,
        merge=PAPER_MERGE,
    )


def _row(method: str) -> tuple[str, int]:
    if method.startswith("decoupled-"):
        return "decoupled", int(method.split("-")[1])
    return method, 1


def paper_grid(
    *,
    failures: int = 2000,
    seed: int = 0,
    hardware: Hardware = PAPER_CONSTANTS,
    methods: Iterable[str] = tuple(PAPER_TABLE),
    on_cell: Callable[[Cell], None] | None = None,
) -> list[Cell]:
    """Simulate every cell of ``PAPER_TABLE`` (data-parallel gets 100x the failures: it is cheap)."""
    cells = []
    for method in methods:
        kind, m = _row(method)
        for chips, paper in zip(CHIPS, PAPER_TABLE[method], strict=True):
            if kind == "data-parallel":
                out = simulate_data_parallel(
                    paper_config(chips, failures=100 * failures, seed=seed, hardware=hardware)
                )
            elif kind == "elastic":
                out = simulate_elastic(
                    paper_config(chips, failures=failures, seed=seed, hardware=hardware)
                )
            else:
                out = simulate_decoupled(
                    paper_config(chips, m, failures=failures, seed=seed, hardware=hardware)
                )
            cell = Cell(
                chips=chips,
                learners=m,
                method=kind,
                paper=float(paper),
                sim=100.0 * out.goodput,
                outcome=out,
            )
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    return cells


def _worst(devs: list[float]) -> float:
    return max(abs(d) for d in devs)


def calibrate_data_parallel(
    restarts: Iterable[float], spares: Iterable[float], *, failures: int = 200000
) -> list[tuple[float, float, float]]:
    """(largest deviation, restart_s, spare_fraction) over the data-parallel row, best first."""
    found = []
    for restart, spare in itertools.product(restarts, spares):
        hw = replace(PAPER_CONSTANTS, restart_s=restart, spare_fraction=spare)
        devs = [
            100.0
            * simulate_data_parallel(
                paper_config(c, failures=failures, seed=1, hardware=hw)
            ).goodput
            - p
            for c, p in zip(CHIPS, PAPER_TABLE["data-parallel"], strict=True)
        ]
        found.append((_worst(devs), restart, spare))
    return sorted(found)


def calibrate_groups(
    reconfigs: Iterable[float], waits: Iterable[float], *, failures: int = 4000
) -> list[tuple[float, float, float]]:
    """(largest deviation, reconfig_s, rejoin_wait_s), best first, over every elastic and
    decoupled cell, each taken as one elastic group of chips / M chips (the decoupled learners'
    failure model without the merger, which costs little with these timings; ``paper_grid``
    checks the whole)."""
    targets = [
        (c // m, float(p))
        for method in PAPER_TABLE
        if method != "data-parallel"
        for m in [_row(method)[1]]
        for c, p in zip(CHIPS, PAPER_TABLE[method], strict=True)
    ]
    found = []
    for reconfig, wait in itertools.product(reconfigs, waits):
        hw = replace(PAPER_CONSTANTS, reconfig_s=reconfig, rejoin_wait_s=wait)
        sim = {
            size: 100.0
            * simulate_elastic(paper_config(size, failures=failures, seed=1, hardware=hw)).goodput
            for size in sorted({size for size, _ in targets})
        }
        found.append((_worst([sim[size] - p for size, p in targets]), reconfig, wait))
    return sorted(found)
