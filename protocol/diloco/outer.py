"""The outer step of Decoupled DiLoCo: pseudo-gradients, merge weights, aggregation, Nesterov.

Implements the owner's merge arithmetic of arXiv 2604.21428 (token-weighted merge, radial-
directional averaging, outer Nesterov SGD as in DiLoCo). This module is the import point and
holds the aggregation and ``merge_update`` (one merge of a fragment); the rest lives beside it:

- ``outer_weights``: ``pseudo_gradient`` (``Delta = Theta_base - theta_local``), the token
  weights ``tokens^2 / steps`` and their caps, ``clip_factors``, ``staleness_discount``.
- ``outer_nesterov``: ``OuterConfig`` and ``outer_step`` / ``outer_step_``, Nesterov SGD
  bit-identical to ``torch.optim.SGD(nesterov=True)`` fed the pseudo-gradient as ``grad``.

Here:

- ``bound_to_norm`` scales an aggregate down to a bound (``ratio * |Theta|``).
- ``weighted_mean``, ``normed_mean`` (the mean of the deltas each scaled to the median norm) and
  ``radial_directional_average`` (RDA):
  ``Delta = (sum w |Delta_m| / sum w) * unit(sum w unit(Delta_m) / sum w)``, which keeps the step
  length when pseudo-gradients are near-orthogonal instead of shrinking it as ``1/sqrt(M)``.
  Deltas are **flat fp32 vectors** of one fragment (the node flattens a fragment's tensors in
  the plan's name order); any equal shapes work.
- ``merge_update``: clip, aggregate, scale, bound and apply the outer step, the same for the
  owner and ``atoll replay``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from protocol.diloco.norms import norm64
from protocol.diloco.outer_nesterov import OuterConfig, outer_step, outer_step_
from protocol.diloco.outer_weights import (
    cap_weights_by_others,
    check_weights,
    clamp_weights,
    clip_factors,
    pseudo_gradient,
    staleness_discount,
    token_weight,
)
from protocol.diloco.sliced import (
    SLICE,
    Delta,
    ScaledSource,
    as_source,
    norm_of,
    numel_of,
    slices,
)
from protocol.diloco.vectors import copy_vector, new_vector, new_vector_like
from protocol.errors import LocalProtocolError

__all__ = [
    "MergeUpdate",
    "OuterConfig",
    "bound_to_norm",
    "cap_weights_by_others",
    "clamp_weights",
    "clip_factors",
    "clip_to_median_norm",
    "median_norm",
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


# ---------------------------------------------------------------- bounds


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


# ---------------------------------------------------------------- aggregation


# Reads each slice of a round's contributions (unclipped, in entry order) while a merge sums
# them: the agreement's Gram matrix is summed in the same pass (``agreement.GramSum.add``)
Observer = Callable[[Sequence[torch.Tensor]], None]


@dataclass(frozen=True, slots=True)
class _Term:
    """One delta of a weighted sum: it is multiplied by ``clip`` (when below 1), then added with
    coefficient ``coef`` (None: it adds nothing, but an observer still reads it)."""

    source: Delta
    clip: float = 1.0
    coef: float | None = None


def weighted_mean(deltas: Sequence[Delta], weights: Sequence[float]) -> torch.Tensor:
    """``sum w_m Delta_m / sum w`` as a new fp32 tensor.

    Raises ``LocalProtocolError`` for no deltas, mismatched lengths or shapes, negative or
    non-finite weights, or a zero total weight.
    """
    total = _check_inputs(deltas, weights)
    return _weighted_sum(
        [_Term(d, coef=w / total if w > 0 else None) for d, w in zip(deltas, weights, strict=True)]
    )


def _weighted_sum(terms: Sequence[_Term], observe: Observer | None = None) -> torch.Tensor:
    """``sum coef_m * (clip_m * t_m)`` as a new fp32 tensor of the first term's shape (zeros for
    no coefficients), one ``SLICE`` of every term at a time (a contribution kept compressed is
    decoded a slice at a time: the same bits as decoded whole, the sum being element-wise). In
    each slice the first term is written by a multiply, not added to a zeroed tensor, into memory
    that is not fresh pages (``new_vector_like``); ``observe`` reads every term's slice."""
    like = terms[0].source
    out = new_vector_like(like) if isinstance(like, torch.Tensor) else new_vector(like.numel)
    flat, n = out.view(-1), out.numel()
    sources = [as_source(t.source) for t in terms]
    scratch = [new_vector(min(n, SLICE)) for _ in terms]
    for start in slices(n):
        stop = min(n, start + SLICE)
        parts = [s.read(start, stop, b) for s, b in zip(sources, scratch, strict=True)]
        if observe is not None:
            observe(parts)
        written, target = False, flat[start:stop]
        for term, part in zip(terms, parts, strict=True):
            if term.coef is None:
                continue
            value = (part * term.clip if term.clip < 1.0 else part).to(torch.float32)
            if written:
                target.add_(value, alpha=term.coef)
            else:
                torch.mul(value, term.coef, out=target)
                written = True
        if not written:
            target.zero_()
    return out


def _unit_average(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    eps: float,
    known: Sequence[float | None] | None = None,
    *,
    clips: Sequence[float] | None = None,
    observe: Observer | None = None,
) -> tuple[torch.Tensor, list[float], float]:
    """(``sum w unit(Delta_m) / sum w``, every delta's norm, the total weight); deltas with norm
    <= ``eps`` add no direction. ``known``: each delta's ``norm64`` where the caller measured it
    already (None: measured here). ``clips``: each delta is first multiplied by its factor
    when below 1 (its norm, when not known, measured of the product)."""
    total = _check_inputs(deltas, weights)
    if known is not None and len(known) != len(deltas):
        raise LocalProtocolError(f"{len(deltas)} deltas but {len(known)} known norms")
    clips = clips if clips is not None else [1.0] * len(deltas)
    norms, terms = [], []
    for i, (d, w, c) in enumerate(zip(deltas, weights, clips, strict=True)):
        given = known[i] if known is not None else None
        # in fp64: an fp32 sum of squares overflows near 3e38
        norm = given if given is not None else norm_of(_clipped(d, c))
        norms.append(norm)
        useful = w > 0 and norm > eps
        terms.append(_Term(d, c, w / (total * norm) if useful else None))
    return _weighted_sum(terms, observe), norms, total


def _clipped(delta: Delta, clip: float) -> Delta:
    """``delta`` times ``clip`` when below 1: a product of a held tensor (as the merge took it
    before), or a compressed one's decoded slice by slice."""
    if clip >= 1.0:
        return delta
    if isinstance(delta, torch.Tensor):
        return delta * clip
    return ScaledSource(delta, clip)


def radial_directional_average(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    eps: float = 1e-12,
    *,
    min_direction: float = 1e-6,
    radius: str = "mean",
    max_gain: float = math.inf,
    norms: Sequence[float | None] | None = None,
    clips: Sequence[float] | None = None,
    observe: Observer | None = None,
) -> torch.Tensor:
    """Radial-directional average: the weighted mean norm along the weighted mean direction.

    Deltas with norm <= ``eps`` count as zero (their norm 0 enters the mean norm, they add no
    direction). The mean direction is an average of unit vectors (norm in [0, 1]); if its norm
    is <= ``min_direction`` (all zero, or cancelling up to fp32 rounding) the result is zero.
    ``radius="median"`` takes the unweighted median norm of the contributions with a weight
    instead of the mean (``median_norm``): one contribution scaled up (even clipped to a few
    times the others), or weighted up by the counts it claims, then cannot lengthen the step.

    ``max_gain`` bounds the step to that many times the average of the deltas scaled to the
    radius (the length ``radius * |mean unit direction|``; ``normed_mean`` with the median
    radius). Unbounded, RDA keeps the radius however much the deltas disagree: ``M``
    near-orthogonal pseudo-gradients step ``sqrt(M)`` times further than their mean along
    their small common part, which at 16 contributions per merge overshot (docs/results.md,
    *Many contributions per merge*). ``norms``: each delta's ``norm64`` where already measured.
    ``clips`` and ``observe``: as ``merge_update`` passes them (``_unit_average``).
    Raises ``LocalProtocolError`` like ``weighted_mean``.
    """
    if radius not in ("mean", "median"):
        raise LocalProtocolError(f"radius must be 'mean' or 'median', got {radius!r}")
    direction, norms, total = _unit_average(
        deltas, weights, eps, norms, clips=clips, observe=observe
    )
    if radius == "median":
        r = median_norm(norms, weights)
    else:
        r = math.fsum(w * n for w, n in zip(weights, norms, strict=True)) / total
    length = float(torch.linalg.vector_norm(direction))
    if length <= min_direction:
        return direction.zero_()
    return _scale_(direction, r / length if length * max_gain >= 1.0 else r * max_gain)


def normed_mean(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    eps: float = 1e-12,
    norms: Sequence[float | None] | None = None,
    *,
    clips: Sequence[float] | None = None,
    observe: Observer | None = None,
) -> torch.Tensor:
    """The weighted mean of the deltas, each first scaled to the median norm:
    ``median |Delta_m| * sum w unit(Delta_m) / sum w``, the median unweighted over the
    contributions with a weight (``median_norm``): the step's length is one vote per sender,
    whatever tokens or steps a sender claims (a weighted median let a liar holding most of the
    weight pick its own norm as the step's length).

    Like the plain mean, the step shrinks when pseudo-gradients disagree (as ``1/sqrt(M)`` for
    near-orthogonal ones), so many contributions of mostly noise do not make a long step along
    their small common part, as ``radial_directional_average`` does (at 32 peers it overshot:
    docs/results.md, *Many contributions per merge*). Like RDA, no one contribution's length
    counts: a scaled or random one weighs as one unit direction at the median norm.
    Deltas with norm <= ``eps`` add no direction. ``norms``: each delta's ``norm64`` where
    already measured. ``clips`` and ``observe``: as ``merge_update`` passes them
    (``_unit_average``). Raises ``LocalProtocolError`` like ``weighted_mean``.
    """
    direction, norms, _ = _unit_average(deltas, weights, eps, norms, clips=clips, observe=observe)
    r = median_norm(norms, weights)
    if not r > 0:
        return direction.zero_()
    return _scale_(direction, r)


def median_norm(norms: Sequence[float], weights: Sequence[float]) -> float:
    """The median of the norms of the contributions with a positive weight, unweighted (each
    sender of a round has one contribution in it). Raises ``LocalProtocolError`` when none has."""
    voting = [n for n, w in zip(norms, weights, strict=True) if w > 0]
    if not voting:
        raise LocalProtocolError(f"median norm of {len(norms)} norms, none with a positive weight")
    return float(statistics.median(voting))


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value at half the total weight (the mean of the two values either side when the half
    falls exactly between them). Raises ``LocalProtocolError`` like ``weighted_mean``."""
    total = check_weights(weights)
    if not values or len(values) != len(weights) or total <= 0:
        raise LocalProtocolError(
            f"weighted median of {len(values)} values, {len(weights)} weights, total {total}"
        )
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


# ---------------------------------------------------------------- one merge


@dataclass(frozen=True, slots=True)
class MergeUpdate:
    """A merge's result: the new global fragment and momentum, and whether the aggregate was
    scaled down to ``max_delta_ratio`` × |Θ|."""

    theta: torch.Tensor
    buffer: torch.Tensor | None
    bounded: bool


def merge_update(
    theta: torch.Tensor,
    buffer: torch.Tensor | None,
    deltas: Sequence[Delta],
    weights: Sequence[float],
    clips: Sequence[float],
    cfg: OuterConfig,
    *,
    embedding: bool,
    scale: float = 1.0,
    norms: Sequence[float | None] | None = None,
    theta_norm: float | None = None,
    aggregate: str | None = None,
    observe: Observer | None = None,
) -> MergeUpdate:
    """One merge of a fragment: clip each delta by its factor, aggregate (a weighted mean for an
    embedding fragment or with ``aggregate`` (default ``cfg.aggregate``) "mean", else that
    aggregate), scale the aggregate by ``scale`` (the merger's ``Decision.scale``), bound it to
    ``cfg.max_delta_ratio`` × |Θ| and apply the outer step: with momentum, a scaled merge (a
    part of a step) is a plain step that leaves the buffer as it was. The inputs are not modified.
    ``norms``: each delta's ``norm64`` where the caller measured it already (the owner does, as
    each contribution arrives; None entries are measured here), and ``theta_norm`` ``theta``'s
    (the owner measures each version's as it checks it for NaN/Inf): the same bits either way.
    The aggregate's own norm is measured only when the bound might bite: every aggregate here is
    no longer than its longest delta (a weighted mean by the triangle inequality; the normed mean
    and RDA are at most the median or mean norm along a direction of norm <= 1), so when every
    norm is known and the longest, times ``scale``, is within the bound, it is not (the bits are
    the same: an aggregate within the bound is left as it is).

    The owner and ``atoll replay`` both call this, so a replayed log recomputes the same bits
    (on the same torch build and thread count). The result may be non-finite; the caller checks.
    ``aggregate``: this merge's, where it is not ``cfg.aggregate`` (``Decision.aggregate``).

    A delta may be a ``VectorSource`` (``protocol.diloco.sliced``: a contribution kept
    compressed): the deltas are read, clipped and summed a slice at a time, so the merge holds
    one slice of each beside the aggregate, with the bits of the whole-vector arithmetic.
    ``observe`` reads each slice of every delta, unclipped, in entry order, as it is summed.
    """
    aggregate = cfg.aggregate if aggregate is None else aggregate
    if len(clips) != len(deltas):
        raise LocalProtocolError(f"{len(deltas)} deltas but {len(clips)} clip factors")
    if norms is not None and len(norms) != len(deltas):
        raise LocalProtocolError(f"{len(deltas)} deltas but {len(norms)} known norms")
    # a clipped delta's norm is measured again: (d * c)'s is not c * |d| to the last bit
    known = (
        None
        if norms is None
        else [n if c >= 1.0 else None for n, c in zip(norms, clips, strict=True)]
    )
    if embedding or aggregate == "mean":
        total = _check_inputs(deltas, weights)
        delta = _weighted_sum(
            [
                _Term(d, c, w / total if w > 0 else None)
                for d, w, c in zip(deltas, weights, clips, strict=True)
            ],
            observe,
        )
    elif aggregate == "normed":
        delta = normed_mean(deltas, weights, norms=known, clips=clips, observe=observe)
    else:
        delta = radial_directional_average(
            deltas,
            weights,
            radius=cfg.rda_radius,
            max_gain=cfg.rda_max_gain or math.inf,
            norms=known,
            clips=clips,
            observe=observe,
        )
    if not 0.0 < scale <= 1.0:
        raise LocalProtocolError(f"a merge's scale must be in (0, 1], got {scale}")
    if scale < 1.0:
        delta.mul_(scale)
    scale_share, bounded = scale, False
    if math.isfinite(cfg.max_delta_ratio):
        theta_norm = norm64(theta) if theta_norm is None else theta_norm
        limit = cfg.max_delta_ratio * theta_norm
        longest = _longest(norms, scale)
        if theta_norm > 0 and (longest is None or not longest <= limit):
            delta, scale = bound_to_norm(delta, limit)
            bounded = scale < 1.0
    if scale_share < 1.0 and cfg.momentum != 0:
        # a part of a step (learners left or finished while the round was open): the plain step,
        # momentum neither fed nor coasting. Whole Nesterov steps (mu^2 b each) on a straggler's
        # tail of partial merges overshot; Liu et al. 2024 (Delayed Nesterov) keep momentum off
        # such in-between updates too
        plain, _ = outer_step(theta, delta, None, replace(cfg, momentum=0.0))
        return MergeUpdate(plain, None if buffer is None else copy_vector(buffer), bounded)
    # the aggregate is this merge's own: Nesterov's gradient is formed in its place
    new_theta, new_buffer = outer_step(theta, delta, buffer, cfg, consume_delta=True)
    return MergeUpdate(new_theta, new_buffer, bounded)


def _longest(norms: Sequence[float | None] | None, scale: float) -> float | None:
    """An upper bound on the norm of any aggregate of deltas with these norms, scaled by ``scale``
    (clipping only shortens a delta); None when a norm is not known. The margin covers fp32
    rounding, which can make an aggregate a few ulps longer than its longest term."""
    if not norms or any(n is None or not math.isfinite(n) for n in norms):
        return None
    return max(n for n in norms if n is not None) * scale * (1.0 + 1e-4)


# ---------------------------------------------------------------- checks


def _check_inputs(deltas: Sequence[Delta], weights: Sequence[float]) -> float:
    """Total weight after validating an aggregation's inputs (see ``weighted_mean``)."""
    if not deltas:
        raise LocalProtocolError("nothing to aggregate: no deltas")
    if len(deltas) != len(weights):
        raise LocalProtocolError(f"{len(deltas)} deltas but {len(weights)} weights")
    shapes = [_shape(d) for d in deltas]
    bad = [s for s in shapes if s != shapes[0]]
    if bad:
        raise LocalProtocolError(f"deltas differ in shape: {shapes[0]} vs {bad[0]}")
    total = check_weights(weights)
    if total <= 0:
        raise LocalProtocolError(f"total merge weight is {total}; need a positive weight")
    return total


def _shape(delta: Delta) -> tuple[int, ...]:
    """A delta's shape (a source's: its flat length)."""
    return tuple(delta.shape) if isinstance(delta, torch.Tensor) else (numel_of(delta),)
