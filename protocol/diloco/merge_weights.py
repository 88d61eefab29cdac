"""The robust weights and norm clips a closing round gives its contributions (``weigh``).

Weights are ``tokens^2 / steps`` (tokens clamped to ``max_tokens_per_step * steps``, see
``merge_admission``) times the discount ``stale_discount ** staleness``, then capped at
``max_weight_median_multiple`` times the median and at the same multiple of the median of the
*other* contributions when the round closes (a liar's own weight never sets its cap); if every
weight is 0 (no peer counted tokens) they fall back to the discounts.

Norm clipping: a contribution reported with its ``norm`` is scaled down (``Entry.clip``) so that
its norm per (bounded) inner step is at most ``clip_multiple`` times a reference, the median of
this round's norms per step and of the (clipped) ones of the last ``norm_history`` merged
contributions, so one attacker, even alone in a round at K = 1, cannot set its own bound. Per
step, because a learner's first contribution of a fragment covers only the few steps of its
staggered offset: whole norms made those tiny and had every later honest contribution clipped.
Every bound that bit is flagged on the ``Entry`` so the node can count it per peer.

Work cap (``MergeConfig.max_work_steps``, set under outer momentum): a contribution covering more
inner steps than the cap has its payload scaled to the cap's share (``Entry.work_scale``, folded
into ``Entry.clip``), so that a round's outer step sees at most that many steps of any learner's
work however long the round took; norms per step and weights are as without it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from protocol.diloco.merge_admission import Pending
from protocol.diloco.merge_config import MergeConfig
from protocol.diloco.merge_results import Entry
from protocol.diloco.outer import (
    cap_weights_by_others,
    clamp_weights,
    clip_factors,
    staleness_discount,
)

__all__ = ["clip_scales", "weigh", "work_scale"]


def weigh(pending: Sequence[Pending], *, version: int, history: list[float],
          config: MergeConfig) -> tuple[tuple[Entry, ...], list[float]]:
    """The ``Entry`` of each contribution of a round closing at ``version``, and their clipped
    norms per step (to join ``history``, the recent ones, once the merge is published)."""
    stale = [version - e.base_version for e in pending]
    discounts = [staleness_discount(s, config.stale_discount) for s in stale]
    weights = [e.weight * d for e, d in zip(pending, discounts, strict=True)]
    if not any(w > 0 for w in weights) or any(e.last for e in pending):
        weights = discounts  # an end-of-run round: each learner's island counts once
    weights = clamp_weights(weights, max_median_multiple=config.max_weight_median_multiple)
    weights, capped = cap_weights_by_others(weights, multiple=config.max_weight_median_multiple)
    clips = clip_scales(pending, history, config.clip_multiple)
    rates = [e.rate * c for e, c in zip(pending, clips, strict=True) if e.rate is not None]
    work = [work_scale(e.steps, config.max_work_steps) for e in pending]
    entries = tuple(
        Entry(peer=e.peer, payload=e.payload, weight=w, staleness=s, clip=c * ws, norm=e.norm, weight_capped=k,
              steps_bounded=e.steps_bounded, tokens_bounded=e.tokens_bounded, work_scale=ws, last=e.last)
        for e, w, s, c, k, ws in zip(pending, weights, stale, clips, capped, work, strict=True)
    )
    return entries, rates  # rates as the norm clip left them: the work cap is no evidence of a norm


def work_scale(steps: int, max_work_steps: int | None) -> float:
    """The share of a contribution of ``steps`` inner steps that counts under ``max_work_steps``
    (``MergeConfig``): 1.0 up to it, ``max_work_steps / steps`` beyond."""
    if max_work_steps is None or steps <= max_work_steps:
        return 1.0
    return max_work_steps / steps


def clip_scales(pending: Sequence[Pending], history: list[float], clip_multiple: float) -> list[float]:
    """Scale per contribution bringing its rate to ``clip_multiple`` x the reference rate, the
    median of the rates of ``pending`` and ``history`` (1.0: not clipped; see above)."""
    known = [e.rate for e in pending if e.rate is not None]
    if not known or math.isinf(clip_multiple):
        return [1.0] * len(pending)
    reference = statistics.median(known + history)
    factors = iter(clip_factors(known, reference, clip_multiple))
    return [1.0 if e.rate is None else next(factors) for e in pending]
