"""Decoupled DiLoCo (arXiv 2604.21428) in pure functions and state machines.

``compression``: tensor codecs with error feedback. ``fragments``: balanced fragmentation, the
due-schedule, owners. ``outer``: pseudo-gradients, merge weights, RDA, outer Nesterov.
``merge``: the owner's per-fragment round (quorum, adaptive grace window, staleness).
"""

from protocol.diloco.compression import QMAX, compress, decompress, wire_bytes
from protocol.diloco.fragments import (
    Fragment,
    FragmentPlan,
    due_fragments,
    due_offset,
    owners_of,
    plan_fragments,
)
from protocol.diloco.merge import Decision, Entry, FragmentMerger, MergeConfig, Phase
from protocol.diloco.outer import (
    OuterConfig,
    clamp_weights,
    clip_to_median_norm,
    outer_step,
    outer_step_,
    pseudo_gradient,
    radial_directional_average,
    staleness_discount,
    token_weight,
    weighted_mean,
)

__all__ = [
    "QMAX",
    "Decision",
    "Entry",
    "Fragment",
    "FragmentMerger",
    "FragmentPlan",
    "MergeConfig",
    "OuterConfig",
    "Phase",
    "clamp_weights",
    "clip_to_median_norm",
    "compress",
    "decompress",
    "due_fragments",
    "due_offset",
    "outer_step",
    "outer_step_",
    "owners_of",
    "plan_fragments",
    "pseudo_gradient",
    "radial_directional_average",
    "staleness_discount",
    "token_weight",
    "weighted_mean",
    "wire_bytes",
]
