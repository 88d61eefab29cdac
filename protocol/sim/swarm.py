"""A user's own swarm: the same simulation, with peers as the failure domains.

Each peer is one learner and fails as a unit (mean time between failures ``mtbf_s``), is back
after a repair drawn with mean ``repair_s``, and then rejoins: it downloads the global model
(``restart_s``) and resyncs. ``compare`` runs Decoupled DiLoCo, synchronous DiLoCo, elastic and
non-elastic data-parallel on the same swarm; data-parallel pays ``dp_sync_s`` of
communication every step (by default the DiLoCo sync time: a gradient all-reduce moves about as
many bytes as one model sync).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.diloco.merge import MergeConfig
from protocol.sim.config import ExpWeibull, Hardware, Outcome, SimConfig, Timing
from protocol.sim.dataparallel import simulate_data_parallel, simulate_elastic
from protocol.sim.decoupled import simulate_decoupled, simulate_sync

__all__ = ["Swarm", "compare", "swarm_config"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Swarm:
    """A user's swarm, in the terms they know it by (times in seconds)."""

    peers: int
    mtbf_s: float
    repair_s: float
    step_s: float
    sync_s: float
    inner_steps: int = 100
    repair_shape: float = 1.0
    repair_power: float = 1.0
    reconfig_s: float = 30.0
    restart_s: float = 60.0
    rejoin_wait_s: float = 120.0
    dp_sync_s: float | None = None
    horizon_s: float | None = None
    failures: int = 400
    seed: int = 0


def swarm_config(swarm: Swarm, merge: MergeConfig) -> SimConfig:
    """The ``SimConfig`` of ``swarm``: one chip per peer, one peer per failure domain. Without a
    horizon, one holding about ``swarm.failures`` peer failures and at least 50 intervals."""
    hw = Hardware(
        chips=swarm.peers,
        chips_per_slice=1,
        mtbi_s=swarm.mtbf_s,
        repair=ExpWeibull.with_mean(
            swarm.repair_s, shape=swarm.repair_shape, power=swarm.repair_power
        ),
        reconfig_s=swarm.reconfig_s,
        rejoin_wait_s=swarm.rejoin_wait_s,
        restart_s=swarm.restart_s,
    )
    timing = Timing(
        step_s=swarm.step_s,
        inner_steps=swarm.inner_steps,
        sync_s=swarm.sync_s,
        upload_s=swarm.sync_s / 2.0,
        dp_sync_s=swarm.sync_s if swarm.dp_sync_s is None else swarm.dp_sync_s,
    )
    horizon = swarm.horizon_s
    if horizon is None:
        horizon = max(swarm.failures / hw.failure_rate, 50.0 * timing.interval_s)
    return SimConfig(
        hardware=hw,
        timing=timing,
        learners=swarm.peers,
        horizon_s=horizon,
        seed=swarm.seed,
        merge=merge,
    )


def compare(cfg: SimConfig) -> dict[str, Outcome]:
    """Decoupled, synchronous DiLoCo, elastic and non-elastic data-parallel on ``cfg``."""
    return {
        "decoupled": simulate_decoupled(cfg),
        "sync-diloco": simulate_sync(cfg),
        "elastic": simulate_elastic(cfg),
        "data-parallel": simulate_data_parallel(cfg),
    }
