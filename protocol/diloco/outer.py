"""The outer step of Decoupled DiLoCo: pseudo-gradients, merge weights, aggregation, Nesterov.

Implements the owner's merge arithmetic of arXiv 2604.21428 (token-weighted merge, radial-
directional averaging, outer Nesterov SGD as in DiLoCo):

- ``pseudo_gradient``: ``Delta = Theta_base - theta_local``.
- ``token_weight``: ``w = tokens^2 / steps`` (tokens times tokens per step), tokens clamped to
  ``max_tokens_per_step * steps``; ``clamp_weights`` caps every weight at a multiple of the
  median, ``cap_weights_by_others`` at a multiple of the median of the *other* weights (so a
  liar's own weight never sets its cap); ``staleness_discount`` is ``discount ** staleness``.
- Robust aggregation: ``clip_factors`` scales each contribution down to ``c`` times a reference
  norm (the owner takes the median of this round's and recent rounds' norms, so a lone attacker
  cannot set it); ``bound_to_norm`` scales an aggregate down to a bound (``ratio * |Theta|``).
- ``weighted_mean``, ``normed_mean`` (the mean of the deltas each scaled to the median norm) and
  ``radial_directional_average`` (RDA):
  ``Delta = (sum w |Delta_m| / sum w) * unit(sum w unit(Delta_m) / sum w)``, which keeps the step
  length when pseudo-gradients are near-orthogonal instead of shrinking it as ``1/sqrt(M)``.
  Deltas are **flat fp32 vectors** of one fragment (the node flattens a fragment's tensors in
  the plan's name order); any equal shapes work.
- ``outer_step``: Nesterov SGD bit-identical to ``torch.optim.SGD(nesterov=True)`` fed the
  pseudo-gradient as ``grad``: first step ``b = Delta``, later ``b = mu*b + Delta``;
  ``Theta -= lr * (Delta + mu*b)``. With ``momentum = 0`` it is plain SGD; ``lr = 1`` then sets
  ``Theta`` to the weighted average of the local parameters.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.diloco.aggregates import AGGREGATES
from protocol.diloco.norms import norm64
from protocol.errors import LocalProtocolError

__all__ = [
    "MergeUpdate",
    "OuterConfig",
    "bound_to_norm",
    "cap_weights_by_others",
    "clamp_weights",
    "clip_factors",
    "clip_to_median_norm",
    "merge_update",
    "normed_mean",
    "outer_step",
    "outer_step_",
    "pseudo_gradient",
    "radial_directional_average",
    "staleness_discount",
    "token_weight",
    "weighted_mean",
    "weighted_median",
]


# ---------------------------------------------------------------- pseudo-gradients and weights


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
    _check_weights(weights)
    positive = [w for w in weights if w > 0]
    if not positive:
        return [float(w) for w in weights]
    cap = max_median_multiple * statistics.median(positive)
    return [min(float(w), cap) for w in weights]


def cap_weights_by_others(weights: Sequence[float], *, multiple: float) -> tuple[list[float], list[bool]]:
    """Each weight capped at ``multiple`` times the median positive weight of the *other* ones.

    Returns the weights and which were capped. A lone weight, or one whose others are all zero,
    is left as it is. Raises ``LocalProtocolError`` for negative or non-finite weights or a
    multiple below 1.
    """
    if not multiple >= 1.0:
        raise LocalProtocolError(f"multiple must be >= 1, got {multiple}")
    _check_weights(weights)
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


def bound_to_norm(delta: torch.Tensor, limit: float) -> tuple[torch.Tensor, float]:
    """``delta`` scaled down (in place) to norm at most ``limit``; returns it and the scale used."""
    if not (math.isfinite(limit) and limit >= 0):
        raise LocalProtocolError(f"norm limit must be finite and >= 0, got {limit}")
    norm = norm64(delta)
    if norm <= limit:
        return delta, 1.0
    scale = limit / norm
    return _scale_(delta, scale), scale


def _scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t *= factor`` in place, in two half steps when ``factor`` itself is beyond fp32's normal
    range (near 3e38 values, a norm ratio can be ~1e-38 or ~1e38 while the product is ordinary)."""
    if 1e-30 < factor < 1e30:
        return t.mul_(factor)
    half = math.sqrt(factor)
    return t.mul_(half).mul_(half)


def staleness_discount(staleness: int, discount: float) -> float:
    """``discount ** staleness``; ``LocalProtocolError`` unless staleness >= 0, 0 <= discount <= 1."""
    if staleness < 0:
        raise LocalProtocolError(f"staleness must be >= 0, got {staleness}")
    if not 0.0 <= discount <= 1.0:
        raise LocalProtocolError(f"discount must be in [0, 1], got {discount}")
    return float(discount**staleness)


# ---------------------------------------------------------------- aggregation


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum w_m Delta_m / sum w`` as a new fp32 tensor.

    Raises ``LocalProtocolError`` for no deltas, mismatched lengths or shapes, negative or
    non-finite weights, or a zero total weight.
    """
    total = _check_inputs(deltas, weights)
    out = torch.zeros(deltas[0].shape, dtype=torch.float32, device=deltas[0].device)
    for d, w in zip(deltas, weights, strict=True):
        if w > 0:
            out.add_(d.to(torch.float32), alpha=w / total)
    return out


def _unit_average(deltas: Sequence[torch.Tensor], weights: Sequence[float], eps: float,
                  known: Sequence[float | None] | None = None) -> tuple[torch.Tensor, list[float], float]:
    """(``sum w unit(Delta_m) / sum w``, every delta's norm, the total weight); deltas with norm
    <= ``eps`` add no direction. ``known``: each delta's ``norm64`` where the caller measured it
    already (None: measured here)."""
    total = _check_inputs(deltas, weights)
    if known is not None and len(known) != len(deltas):
        raise LocalProtocolError(f"{len(deltas)} deltas but {len(known)} known norms")
    direction = torch.zeros(deltas[0].shape, dtype=torch.float32, device=deltas[0].device)
    norms = []
    for i, (d, w) in enumerate(zip(deltas, weights, strict=True)):
        given = known[i] if known is not None else None
        norm = norm64(d) if given is None else given  # in fp64: an fp32 sum of squares overflows near 3e38
        norms.append(norm)
        if w > 0 and norm > eps:
            direction.add_(d.to(torch.float32), alpha=w / (total * norm))
    return direction, norms, total


def radial_directional_average(
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    eps: float = 1e-12,
    *,
    min_direction: float = 1e-6,
    radius: str = "mean",
    max_gain: float = math.inf,
    norms: Sequence[float | None] | None = None,
) -> torch.Tensor:
    """Radial-directional average: the weighted mean norm along the weighted mean direction.

    Deltas with norm <= ``eps`` count as zero (their norm 0 enters the mean norm, they add no
    direction). The mean direction is an average of unit vectors (norm in [0, 1]); if its norm
    is <= ``min_direction`` (all zero, or cancelling up to fp32 rounding) the result is zero.
    ``radius="median"`` takes the weighted median norm instead of the mean: one contribution
    scaled up (even clipped to a few times the others) then cannot lengthen the step.

    ``max_gain`` bounds the step to that many times the average of the deltas scaled to the
    radius (the length ``radius * |mean unit direction|``; ``normed_mean`` with the median
    radius). Unbounded, RDA keeps the radius however much the deltas disagree: ``M``
    near-orthogonal pseudo-gradients step ``sqrt(M)`` times further than their mean along
    their small common part, which at 16 contributions per merge overshot (docs/results.md,
    *Many contributions per merge*). ``norms``: each delta's ``norm64`` where already measured.
    Raises ``LocalProtocolError`` like ``weighted_mean``.
    """
    if radius not in ("mean", "median"):
        raise LocalProtocolError(f"radius must be 'mean' or 'median', got {radius!r}")
    direction, norms, total = _unit_average(deltas, weights, eps, norms)
    if radius == "median":
        r = weighted_median(norms, weights)
    else:
        r = math.fsum(w * n for w, n in zip(weights, norms, strict=True)) / total
    length = float(torch.linalg.vector_norm(direction))
    if length <= min_direction:
        return direction.zero_()
    return _scale_(direction, r / length if length * max_gain >= 1.0 else r * max_gain)


def normed_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float], eps: float = 1e-12,
                norms: Sequence[float | None] | None = None) -> torch.Tensor:
    """The weighted mean of the deltas, each first scaled to the weighted median norm:
    ``median_w |Delta_m| * sum w unit(Delta_m) / sum w``.

    Like the plain mean, the step shrinks when pseudo-gradients disagree (as ``1/sqrt(M)`` for
    near-orthogonal ones), so many contributions of mostly noise do not make a long step along
    their small common part, as ``radial_directional_average`` does (at 32 peers it overshot:
    docs/results.md, *Many contributions per merge*). Like RDA, no one contribution's length
    counts: a scaled or random one weighs as one unit direction at the median norm.
    Deltas with norm <= ``eps`` add no direction. ``norms``: each delta's ``norm64`` where
    already measured. Raises ``LocalProtocolError`` like ``weighted_mean``.
    """
    direction, norms, _ = _unit_average(deltas, weights, eps, norms)
    r = weighted_median(norms, weights)
    if not r > 0:
        return direction.zero_()
    return _scale_(direction, r)


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value at half the total weight (the mean of the two values either side when the half
    falls exactly between them). Raises ``LocalProtocolError`` like ``weighted_mean``."""
    total = _check_weights(weights)
    if not values or len(values) != len(weights) or total <= 0:
        raise LocalProtocolError(f"weighted median of {len(values)} values, {len(weights)} weights, total {total}")
    pairs = sorted((v, w) for v, w in zip(values, weights, strict=True) if w > 0)
    half, seen = total / 2.0, 0.0
    for i, (v, w) in enumerate(pairs):
        seen += w
        if math.isclose(seen, half, rel_tol=1e-12) and i + 1 < len(pairs):
            return (v + pairs[i + 1][0]) / 2.0
        if seen >= half:
            return v
    return pairs[-1][0]


def clip_to_median_norm(deltas: Sequence[torch.Tensor], c: float) -> list[torch.Tensor]:
    """Each delta scaled down to norm at most ``c`` times the median norm (new tensors).

    Raises ``LocalProtocolError`` unless ``c > 0``.
    """
    if not c > 0:
        raise LocalProtocolError(f"clip multiple c must be > 0, got {c}")
    if not deltas:
        return []
    norms = [float(torch.linalg.vector_norm(d.to(torch.float32))) for d in deltas]
    cap = c * statistics.median(norms)
    return [
        d.to(torch.float32) * (cap / n) if n > cap else d.to(torch.float32).clone()
        for d, n in zip(deltas, norms, strict=True)
    ]


# ---------------------------------------------------------------- outer Nesterov


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterConfig:
    """Outer SGD: ``lr`` eta, ``momentum`` mu, ``nesterov``. DiLoCo's defaults; short runs with
    few outer steps did best with ``lr=1.0, momentum=0.0`` (plain averaging)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    max_delta_ratio: float = 1.0  # the owner bounds an aggregate's norm to this times |Theta|
    rda_radius: str = "median"  # radial-directional averaging's step length: "median" or "mean"
    rda_max_gain: float = 0.0  # RDA's step at most this many times the normed mean's (0: unbounded; see max_gain)
    aggregate: str = "rda"  # non-embedding fragments: "rda", "normed" (``normed_mean``) or "mean" (weighted)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise LocalProtocolError(f"outer lr must be finite and > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise LocalProtocolError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.aggregate not in AGGREGATES:
            raise LocalProtocolError(f"aggregate must be one of {', '.join(AGGREGATES)}; got {self.aggregate!r}")
        if self.rda_radius not in ("mean", "median"):
            raise LocalProtocolError(f"rda_radius must be 'mean' or 'median', got {self.rda_radius!r}")
        if not (self.rda_max_gain == 0.0 or 1.0 <= self.rda_max_gain < math.inf):
            raise LocalProtocolError(f"rda_max_gain must be >= 1 and finite, or 0 (unbounded); got {self.rda_max_gain}")
        if not self.max_delta_ratio > 0:
            raise LocalProtocolError(f"max_delta_ratio must be > 0 (inf: unbounded), got {self.max_delta_ratio}")


def outer_step(
    param: torch.Tensor, delta: torch.Tensor, buffer: torch.Tensor | None, cfg: OuterConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(new param, new momentum buffer) without touching the inputs; see ``outer_step_``.

    The buffer stays ``None`` when ``cfg.momentum == 0``.
    """
    if buffer is None and cfg.momentum == 0 and param.shape == delta.shape:
        # the same kernel as outer_step_'s param.add_(grad, alpha=-lr), into a new tensor: one
        # pass over the fragment instead of a copy and then an in-place add
        with torch.no_grad():
            return torch.add(param.detach(), delta.detach(), alpha=-cfg.lr), None
    new_param = param.detach().clone()
    new_buffer = None if buffer is None else buffer.detach().clone()
    return new_param, outer_step_(new_param, delta, new_buffer, cfg)


def outer_step_(
    param: torch.Tensor, delta: torch.Tensor, buffer: torch.Tensor | None, cfg: OuterConfig
) -> torch.Tensor | None:
    """In place: one SGD step on ``param`` (and ``buffer``) with ``delta`` as the gradient.

    Replicates ``torch.optim.SGD``'s single-tensor op order exactly. Returns the buffer to keep
    (a new one on the first momentum step, ``None`` without momentum). Raises
    ``LocalProtocolError`` when shapes differ.
    """
    if param.shape != delta.shape or (buffer is not None and buffer.shape != param.shape):
        raise LocalProtocolError(f"outer step shapes differ: param {tuple(param.shape)}, delta "
                                 f"{tuple(delta.shape)}, buffer {None if buffer is None else tuple(buffer.shape)}")
    grad = delta.detach()
    if cfg.momentum != 0:
        if buffer is None:
            buffer = grad.clone()
        else:
            buffer.mul_(cfg.momentum).add_(grad, alpha=1)
        grad = grad.add(buffer, alpha=cfg.momentum) if cfg.nesterov else buffer
    with torch.no_grad():
        param.add_(grad, alpha=-cfg.lr)
    return buffer


@dataclass(frozen=True, slots=True)
class MergeUpdate:
    """A merge's result: the new global fragment and momentum, and whether the aggregate was
    scaled down to ``max_delta_ratio`` × |Θ|."""

    theta: torch.Tensor
    buffer: torch.Tensor | None
    bounded: bool


def merge_update(
    theta: torch.Tensor, buffer: torch.Tensor | None, deltas: Sequence[torch.Tensor], weights: Sequence[float],
    clips: Sequence[float], cfg: OuterConfig, *, embedding: bool, scale: float = 1.0,
    norms: Sequence[float | None] | None = None,
) -> MergeUpdate:
    """One merge of a fragment: clip each delta by its factor, aggregate (a weighted mean for an
    embedding fragment or with ``cfg.aggregate == "mean"``, else ``cfg.aggregate``'s), scale the
    aggregate by ``scale`` (the merger's ``Decision.scale``), bound it to
    ``cfg.max_delta_ratio`` × |Θ| and apply the outer step. The inputs are not modified.
    ``norms``: each delta's ``norm64`` where the caller measured it already (the owner does, as
    each contribution arrives; None entries are measured here): the same bits either way.

    The owner and ``atoll replay`` both call this, so a replayed log recomputes the same bits
    (on the same torch build and thread count). The result may be non-finite; the caller checks.
    """
    clipped = [d * c if c < 1.0 else d for d, c in zip(deltas, clips, strict=True)]
    if norms is not None and len(norms) != len(deltas):
        raise LocalProtocolError(f"{len(deltas)} deltas but {len(norms)} known norms")
    # a clipped delta's norm is measured again: (d * c)'s is not c * |d| to the last bit
    known = None if norms is None else [n if c >= 1.0 else None for n, c in zip(norms, clips, strict=True)]
    if embedding or cfg.aggregate == "mean":
        delta = weighted_mean(clipped, weights)
    elif cfg.aggregate == "normed":
        delta = normed_mean(clipped, weights, norms=known)
    else:
        delta = radial_directional_average(clipped, weights, radius=cfg.rda_radius, max_gain=cfg.rda_max_gain or math.inf,
                                           norms=known)
    if not 0.0 < scale <= 1.0:
        raise LocalProtocolError(f"a merge's scale must be in (0, 1], got {scale}")
    if scale < 1.0:
        delta.mul_(scale)
    bounded = False
    theta_norm = norm64(theta)
    if theta_norm > 0 and math.isfinite(cfg.max_delta_ratio):
        delta, scale = bound_to_norm(delta, cfg.max_delta_ratio * theta_norm)
        bounded = scale < 1.0
    new_theta, new_buffer = outer_step(theta, delta, buffer, cfg)
    return MergeUpdate(new_theta, new_buffer, bounded)


# ---------------------------------------------------------------- checks


def _check_weights(weights: Sequence[float]) -> float:
    """Sum of ``weights``; raises ``LocalProtocolError`` for a negative or non-finite one."""
    for w in weights:
        if not (math.isfinite(w) and w >= 0):
            raise LocalProtocolError(f"merge weights must be finite and >= 0, got {w}")
    return float(math.fsum(weights))


def _check_inputs(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> float:
    """Total weight after validating an aggregation's inputs (see ``weighted_mean``)."""
    if not deltas:
        raise LocalProtocolError("nothing to aggregate: no deltas")
    if len(deltas) != len(weights):
        raise LocalProtocolError(f"{len(deltas)} deltas but {len(weights)} weights")
    shape = deltas[0].shape
    bad = [tuple(d.shape) for d in deltas if d.shape != shape]
    if bad:
        raise LocalProtocolError(f"deltas differ in shape: {tuple(shape)} vs {bad[0]}")
    total = _check_weights(weights)
    if total <= 0:
        raise LocalProtocolError(f"total merge weight is {total}; need a positive weight")
    return total
