"""What a goodput simulation is given and what it returns: failures, repairs, timing, outcome.

Times are seconds of virtual time. ``Hardware`` is the failure and repair model (arXiv 2604.21428
models failures as a Poisson process per chip and repair times with an exponentiated Weibull
distribution; it does not publish its detection, reconfiguration and repair constants, so ours
are parameters, calibrated in ``protocol.sim.paper``). ``Timing`` is the training cadence.
``Outcome`` is what one simulated run measured.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from protocol.diloco.merge import MergeConfig
from protocol.errors import LocalProtocolError

__all__ = ["ExpWeibull", "Hardware", "Method", "Outcome", "SimConfig", "Timing"]

Method = Literal["data-parallel", "elastic", "decoupled", "sync-diloco"]
FailureModel = Literal["domain", "chip"]
YEAR_S = 365.0 * 86400.0


def _check(checks: list[tuple[bool, str]], what: object) -> None:
    for ok, message in checks:
        if not ok:
            raise LocalProtocolError(f"{type(what).__name__}: {message}: {what!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpWeibull:
    """Exponentiated Weibull: ``F(x) = (1 - exp(-(x / scale_s) ** shape)) ** power``.

    ``power = 1`` is the Weibull, ``shape = power = 1`` the exponential distribution.
    """

    scale_s: float
    shape: float = 1.0
    power: float = 1.0

    def __post_init__(self) -> None:
        _check(
            [
                (
                    self.scale_s >= 0 and math.isfinite(self.scale_s),
                    "scale_s must be finite and >= 0",
                ),
                (0 < self.shape < math.inf, "shape must be finite and > 0"),
                (0 < self.power < math.inf, "power must be finite and > 0"),
            ],
            self,
        )

    def quantile(self, u: float) -> float:
        """The inverse CDF at ``u`` in [0, 1)."""
        if not 0.0 <= u < 1.0:
            raise LocalProtocolError(f"quantile of {u}: expected 0 <= u < 1")
        base = -math.log1p(-math.pow(u, 1.0 / self.power))
        return self.scale_s * math.pow(base, 1.0 / self.shape)

    @classmethod
    def with_mean(cls, mean_s: float, *, shape: float = 1.0, power: float = 1.0) -> ExpWeibull:
        """The distribution of this shape and power whose mean is ``mean_s``."""
        return cls(
            scale_s=mean_s / cls(scale_s=1.0, shape=shape, power=power).mean(),
            shape=shape,
            power=power,
        )

    def sample(self, rng: random.Random) -> float:
        return self.quantile(rng.random())

    def mean(self) -> float:
        """E[X] = integral of the quantile over (0, 1) (midpoint rule, 1e-4 relative or better)."""
        n = 20000
        return sum(self.quantile((i + 0.5) / n) for i in range(n)) / n


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """Chips, failure domains and what a failure costs.

    A chip failure takes down its *slice* (``chips_per_slice`` chips, the unit of repair) for a
    repair time drawn from ``repair``. Elastic groups (a learner, or an elastic data-parallel
    job) drop the slice in a reconfiguration of ``reconfig_s`` during which none of their chips
    compute; failures during a reconfiguration join it. A repaired slice joins the next
    reconfiguration, or forces one after waiting ``rejoin_wait_s``. A group that loses every
    slice loses its state and restarts (``restart_s``) once one is back. Non-elastic
    data-parallel waits for the repair, restarts (``restart_s``) and loses the step in flight, or
    with ``checkpoint_s`` > 0 the work since its last checkpoint, taken every Young interval
    ``sqrt(2 * checkpoint_s / failure rate)``. It also holds hot spares, ``spare_fraction`` of
    its chips, provisioned but idle (a non-elastic job cannot run one slice short).
    """

    chips: int
    chips_per_slice: int = 1
    mtbi_s: float = YEAR_S
    repair: ExpWeibull = field(default_factory=lambda: ExpWeibull(scale_s=60.0))
    reconfig_s: float = 20.0
    rejoin_wait_s: float = 180.0
    restart_s: float = 20.0
    checkpoint_s: float = 0.0
    spare_fraction: float = 0.0

    def __post_init__(self) -> None:
        finite = [
            self.mtbi_s,
            self.reconfig_s,
            self.rejoin_wait_s,
            self.restart_s,
            self.checkpoint_s,
            self.spare_fraction,
        ]
        _check(
            [
                (self.chips >= 1, "chips must be >= 1"),
                (self.chips_per_slice >= 1, "chips_per_slice must be >= 1"),
                (self.mtbi_s > 0, "mtbi_s must be > 0"),
                (all(math.isfinite(x) and x >= 0 for x in finite), "times must be finite and >= 0"),
            ],
            self,
        )

    @property
    def failure_rate(self) -> float:
        """Failures per second of all ``chips`` together (a Poisson process: chips / MTBI)."""
        return self.chips / self.mtbi_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """The training cadence: inner step, H steps between a learner's contributions, the owner's
    merge-plus-transfer time (``sync_s``), a contribution's upload time (uniform in
    ``[0, upload_s]``), and data-parallel's non-overlapped communication per step."""

    step_s: float = 1.0
    inner_steps: int = 100
    sync_s: float = 1.0
    upload_s: float = 0.5
    dp_sync_s: float = 0.0

    def __post_init__(self) -> None:
        _check(
            [
                (self.step_s > 0 and math.isfinite(self.step_s), "step_s must be finite and > 0"),
                (self.inner_steps >= 1, "inner_steps must be >= 1"),
                (
                    all(
                        math.isfinite(x) and x >= 0
                        for x in (self.sync_s, self.upload_s, self.dp_sync_s)
                    ),
                    "sync_s, upload_s and dp_sync_s must be finite and >= 0",
                ),
            ],
            self,
        )

    @property
    def interval_s(self) -> float:
        """Time between two contributions of a learner that never stalls: H inner steps."""
        return self.inner_steps * self.step_s


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One simulated run: ``learners`` groups of ``hardware.chips / learners`` chips each (for
    data-parallel, one job of all chips), for ``horizon_s`` of virtual time."""

    hardware: Hardware
    timing: Timing = field(default_factory=Timing)
    learners: int = 1
    horizon_s: float = 86400.0
    seed: int = 0
    failures: FailureModel = "domain"
    merge: MergeConfig = field(default_factory=lambda: MergeConfig(late_policy="carry"))

    def __post_init__(self) -> None:
        _check(
            [
                (self.learners >= 1, "learners must be >= 1"),
                (self.hardware.chips >= self.learners, "every learner needs at least one chip"),
                (0 < self.horizon_s < math.inf, "horizon_s must be finite and > 0"),
                (self.failures in ("domain", "chip"), "failures must be 'domain' or 'chip'"),
            ],
            self,
        )

    @property
    def chips_per_learner(self) -> float:
        return self.hardware.chips / self.learners


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What one run measured.

    ``goodput``: useful chip-time over provisioned chip-time (chips x horizon); useful is, for the
    DiLoCo methods, the compute carried by contributions the owner's merger merged, for
    data-parallel the compute that was not rolled back. ``uptime``: fraction of the horizon in
    which the global model advanced (for the DiLoCo methods: not more than two intervals since
    the last published version). ``refusals`` counts the merger's refusals by kind.
    """

    method: Method
    chips: int
    learners: int
    goodput: float
    uptime: float
    horizon_s: float
    failures: int
    versions: int = 0
    merged: int = 0
    refusals: tuple[tuple[str, int], ...] = ()
    lost_fraction: float = 0.0
