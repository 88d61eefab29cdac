"""Goodput under failures, simulated on a virtual clock with protocol/'s own merger.

``config``: what a run is given (hardware, timing) and what it measured. ``events``: the virtual
clock. ``failures``: where failures come from (one process per failure domain, or per chip).
``group``: an elastic group of chips (a learner, or an elastic data-parallel job).
``dataparallel``: the data-parallel baselines. ``decoupled``: Decoupled and synchronous DiLoCo
driven through ``FragmentMerger``. ``swarm``: a user's swarm, all four methods. ``paper``: the
paper's Table 1 and the calibrated constants.
"""

from protocol.sim.config import ExpWeibull, Hardware, Method, Outcome, SimConfig, Timing
from protocol.sim.dataparallel import simulate_data_parallel, simulate_elastic, young_interval
from protocol.sim.decoupled import simulate_decoupled, simulate_sync, sync_merge_config
from protocol.sim.events import EventQueue
from protocol.sim.failures import DomainFailures, PerChipFailures
from protocol.sim.group import ElasticGroup
from protocol.sim.swarm import Swarm, compare, swarm_config

__all__ = [
    "DomainFailures",
    "ElasticGroup",
    "EventQueue",
    "ExpWeibull",
    "Hardware",
    "Method",
    "Outcome",
    "PerChipFailures",
    "SimConfig",
    "Swarm",
    "Timing",
    "compare",
    "simulate_data_parallel",
    "simulate_decoupled",
    "simulate_elastic",
    "simulate_sync",
    "swarm_config",
    "sync_merge_config",
    "young_interval",
]
