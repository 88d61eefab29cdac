"""The names of the ways an owner combines a round's pseudo-gradients (``OuterConfig.aggregate``).

- ``rda``: radial-directional averaging, the paper's: the weighted median norm along the
  weighted mean of unit directions.
- ``normed``: every pseudo-gradient scaled to the weighted median norm, then the weighted mean.
- ``mean``: the token-weighted mean.

Kept apart from ``protocol.diloco.outer`` (which needs torch) so that checking a command line
does not import torch.
"""

from __future__ import annotations

__all__ = ["AGGREGATES"]

AGGREGATES: tuple[str, ...] = ("rda", "normed", "mean")
