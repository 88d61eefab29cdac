"""Decoupled DiLoCo (arXiv 2604.21428) in pure functions and state machines.

``compression``: tensor codecs with error feedback. ``fragments``: balanced fragmentation, the
due-schedule, owners. ``outer``: pseudo-gradients, merge weights, RDA, outer Nesterov.
``merge``: the owner's per-fragment round (quorum, adaptive grace window, staleness).
``updates``: versions as compressed updates with the owner's error feedback.

The names below are imported from their modules on first use (PEP 562), so importing one light
module of this package (``fragments``, say, for a command line's parser) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "protocol.diloco.compression": ("QMAX", "compress", "decompress", "wire_bytes"),
    "protocol.diloco.fragments": (
        "Fragment",
        "FragmentPlan",
        "balanced_owners",
        "due_fragments",
        "due_offset",
        "owner_chain",
        "owners_of",
        "plan_fragments",
    ),
    "protocol.diloco.merge": ("Decision", "Entry", "FragmentMerger", "MergeConfig", "Phase"),
    "protocol.diloco.outer": (
        "OuterConfig",
        "clamp_weights",
        "clip_to_median_norm",
        "outer_step",
        "outer_step_",
        "pseudo_gradient",
        "radial_directional_average",
        "staleness_discount",
        "token_weight",
        "weighted_mean",
    ),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'protocol.diloco' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
