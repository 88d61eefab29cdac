"""Pseudo-gradients and the weights and clip factors of the outer step's merge.

The token-weighted merge of arXiv 2604.21428, its inputs made robust:

- ``pseudo_gradient``: ``Delta = Theta_base - theta_local``.
- ``token_weight``: ``w = tokens^2 / steps`` (tokens times tokens per step), tokens clamped to
  ``max_tokens_per_step * steps``; ``clamp_weights`` caps every weight at a multiple of the
  median, ``cap_weights_by_others`` at a multiple of the median of the *other* weights (so a
  liar's own weight never sets its cap); ``staleness_discount`` is ``discount ** staleness``.
- ``clip_factors`` scales each contribution down to ``c`` times a reference norm (the owner
  takes the median of this round's and recent rounds' norms, so a lone attacker cannot set it).

The owner's round applies them in ``protocol.diloco.merge_weights``; ``protocol.diloco.outer``
re-exports them.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence

import torch

from protocol.errors import LocalProtocolError

__all__ = [
    "cap_weights_by_others",
    "check_weights",
    "clamp_weights",
    "clip_factors",
    "pseudo_gradient",
    "staleness_discount",
    "token_weight",
]


def pseudo_gradient(global_: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``global_ - local`` in fp32, a new tensor; ``LocalProtocolError`` if shapes differ."""
    if global_.shape != local.shape:
        raise LocalProtocolError(f"shapes differ: {tuple(global_.shape)} vs {tuple(local.shape)}")
    return torch.sub(global_.detach().to(torch.float32), local.detach().to(torch.float32))


def token_weight(tokens: int, steps: int, *, max_tokens_per_step: int | None) -> float:
    """Merge weight ``tokens^2 / steps`` with tokens clamped to ``max_tokens_per_step * steps``.

    Zero steps give weight 0. Raises ``LocalProtocolError`` for negative tokens or steps or a
    non-positive ``max_tokens_per_step``.
    """
    if tokens < 0 or steps < 0:
        raise LocalProtocolError(f"tokens and steps must be >= 0, got {tokens} and {steps}")
    if max_tokens_per_step is not None and max_tokens_per_step < 1:
        raise LocalProtocolError(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
    if steps == 0:
        return 0.0
    if max_tokens_per_step is not None:
        tokens = min(tokens, max_tokens_per_step * steps)
    return float(tokens) * float(tokens) / float(steps)


def clamp_weights(weights: Sequence[float], *, max_median_multiple: float = 4.0) -> list[float]:
    """``weights`` with each capped at ``max_median_multiple`` times the median positive weight.

    Zero weights (contributions that counted no tokens) stay zero and do not enter the median:
    if they did, a majority of them would cap every weight to zero and leave nothing to merge.
    Raises ``LocalProtocolError`` for negative or non-finite weights or a multiple below 1.
    """
    if not max_median_multiple >= 1.0:
        raise LocalProtocolError(f"max_median_multiple must be >= 1, got {max_median_multiple}")
    check_weights(weights)
    positive = [w for w in weights if w > 0]
    if not positive:
        return [float(w) for w in weights]
    cap = max_median_multiple * statistics.median(positive)
    return [min(float(w), cap) for w in weights]


def cap_weights_by_others(
    weights: Sequence[float], *, multiple: float
) -> tuple[list[float], list[bool]]:
    """Each weight capped at ``multiple`` times the median positive weight of the *other* ones.

    Returns the weights and which were capped. A lone weight, or one whose others are all zero,
    is left as it is. Raises ``LocalProtocolError`` for negative or non-finite weights or a
    multiple below 1.
    """
    if not multiple >= 1.0:
        raise LocalProtocolError(f"multiple must be >= 1, got {multiple}")
    check_weights(weights)
    out, capped = [], []
    for i, w in enumerate(weights):
        others = [v for j, v in enumerate(weights) if j != i and v > 0]
        cap = multiple * statistics.median(others) if others else math.inf
        out.append(min(float(w), cap))
        capped.append(w > cap)
    return out, capped


def clip_factors(norms: Sequence[float], reference: float, c: float) -> list[float]:
    """Per-contribution scale in [0, 1] that brings each norm to at most ``c * reference``.

    A scale below the smallest normal float is 0: a subnormal one keeps too few digits for the
    scaled norm to stay under the limit (a norm of 1e29 against a reference of 1e-291).
    Raises ``LocalProtocolError`` for a negative or non-finite norm or reference, or ``c < 1``.
    """
    if not c >= 1.0:
        raise LocalProtocolError(f"clip multiple must be >= 1, got {c}")
    if not (math.isfinite(reference) and reference >= 0):
        raise LocalProtocolError(f"reference norm must be finite and >= 0, got {reference}")
    limit = c * reference
    out = []
    for n in norms:
        if not (math.isfinite(n) and n >= 0):
            raise LocalProtocolError(f"norms must be finite and >= 0, got {n}")
        scale = limit / n if n > limit else 1.0
        out.append(scale if scale >= sys.float_info.min else 0.0)
    return out


def staleness_discount(staleness: int, discount: float) -> float:
    """``discount ** staleness``; ``LocalProtocolError`` unless staleness >= 0, 0 <= discount <= 1."""
    if staleness < 0:
        raise LocalProtocolError(f"staleness must be >= 0, got {staleness}")
    if not 0.0 <= discount <= 1.0:
        raise LocalProtocolError(f"discount must be in [0, 1], got {discount}")
    return float(discount**staleness)


def check_weights(weights: Sequence[float]) -> float:
    """Sum of ``weights``; raises ``LocalProtocolError`` for a negative or non-finite one."""
    for w in weights:
        if not (math.isfinite(w) and w >= 0):
            raise LocalProtocolError(f"merge weights must be finite and >= 0, got {w}")
    return float(math.fsum(weights))
