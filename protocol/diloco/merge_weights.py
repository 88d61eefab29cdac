"""The robust weights and norm clips a closing round gives its contributions (``weigh``).

Weights are ``tokens^2 / steps`` (steps and tokens as ``merge_admission`` bounded them: a claim
counts at most what the owner can bound) times the discount ``stale_discount ** staleness``, then
capped at ``max_weight_median_multiple`` times the median and at ``n - 1`` times (at most that
multiple) the median of the *other* contributions, ``n`` the senders with a weight: a liar's own
weight never sets its cap, and against equal honest weights one sender never holds more than
half (4x the others' median gave one liar 80 % against one honest learner). If every weight is
0 (no peer counted tokens) they fall back to the discounts.

Norm clipping: a contribution reported with its ``norm`` is scaled down (``Entry.clip``) so that
its **whole** norm is at most ``clip_multiple`` times a reference, the lower median of one norm
per distinct sender: this round's, and the (clipped) ones the last ``norm_history`` senders had
merged (``NormHistory``; a sender in this round is counted once, by its contribution here), so
one attacker, even alone in a round at K = 1, cannot set its own bound, nor, sending round after
round, fill the history. Not per step: the steps are the sender's claim, and dividing by them let
a liar who claimed 20,001 steps look honest. A staggered fragment's first contribution covers a
step or a few; its small norm is clipped like any other (being small it never is) but is no
evidence for the reference (``Pending.evidence``, ``MergeConfig.reference_min_steps``), or it
would have the next honest ones clipped. With no evidence at all (a fresh owner's first round of first contributions) the
round's own norms are the reference; an owner with no history alone with one sender has only
its own norm to go by, and the last bound there is ``OuterConfig.max_delta_ratio``.
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

__all__ = ["NormHistory", "clip_reference", "clip_scales", "others_multiple", "weigh", "work_scale"]


NormHistory = list[
    tuple[bytes | None, float]
]  # (sender, clipped whole norm), oldest first; None: seeded


def weigh(
    pending: Sequence[Pending], *, version: int, history: NormHistory, config: MergeConfig
) -> tuple[tuple[Entry, ...], NormHistory]:
    """The ``Entry`` of each contribution of a round closing at ``version``, and the (sender,
    clipped norm) of those that are evidence (to join ``history`` once the merge is published)."""
    stale = [version - e.base_version for e in pending]
    discounts = [staleness_discount(s, config.stale_discount) for s in stale]
    weights = [e.weight * d for e, d in zip(pending, discounts, strict=True)]
    claimed = any(w > 0 for w in weights) and not any(e.last for e in pending)
    if not claimed:
        weights = discounts  # an end-of-run round: each learner's island counts once
    weights = clamp_weights(weights, max_median_multiple=config.max_weight_median_multiple)
    # the others' cap is for weights from claims: discounts are the owner's own (a fresh
    # contribution outweighs a stale one, whatever the number of senders)
    weights, capped = (
        cap_weights_by_others(weights, multiple=others_multiple(weights, config))
        if claimed
        else (weights, [False] * len(weights))
    )
    clips = clip_scales(pending, history, config.clip_multiple)
    norms: NormHistory = [
        (e.peer, e.norm * c)
        for e, c in zip(pending, clips, strict=True)
        if e.norm is not None and e.evidence
    ]
    work = [work_scale(e.steps, config.max_work_steps) for e in pending]
    entries = tuple(
        Entry(
            peer=e.peer,
            payload=e.payload,
            weight=w,
            staleness=s,
            clip=c * ws,
            norm=e.norm,
            weight_capped=k,
            steps_bounded=e.steps_bounded,
            tokens_bounded=e.tokens_bounded,
            work_scale=ws,
            last=e.last,
            overclaim=e.overclaim,
        )
        for e, w, s, c, k, ws in zip(pending, weights, stale, clips, capped, work, strict=True)
    )
    return entries, norms  # norms as the norm clip left them: the work cap is no evidence of a norm


def others_multiple(weights: Sequence[float], config: MergeConfig) -> float:
    """The multiple of the others' median weight a weight is capped at: ``n - 1`` for ``n``
    positive weights (1 at least), at most ``max_weight_median_multiple``: one of two senders
    weighs at most as much as the other, one of three twice the others' median."""
    n = sum(1 for w in weights if w > 0)
    return min(config.max_weight_median_multiple, max(1.0, float(n - 1)))


def work_scale(steps: int, max_work_steps: int | None) -> float:
    """The share of a contribution of ``steps`` inner steps that counts under ``max_work_steps``
    (``MergeConfig``): 1.0 up to it, ``max_work_steps / steps`` beyond."""
    if max_work_steps is None or steps <= max_work_steps:
        return 1.0
    return max_work_steps / steps


def clip_reference(pending: Sequence[Pending], history: NormHistory) -> float | None:
    """The norm clips are measured against (see above): the lower median of the history's
    norms of senders not in this round and this round's evidence; None: no norm known."""
    here = {e.peer for e in pending}
    pool = [n for peer, n in history if peer is None or peer not in here]
    pool += [e.norm for e in pending if e.norm is not None and e.evidence]
    if not pool:  # no evidence at all: the round's own norms
        pool = [e.norm for e in pending if e.norm is not None]
    return statistics.median_low(pool) if pool else None


def clip_scales(
    pending: Sequence[Pending], history: NormHistory, clip_multiple: float
) -> list[float]:
    """Scale per contribution bringing its whole norm to ``clip_multiple`` x ``clip_reference``
    (1.0: not clipped; see above)."""
    reference = clip_reference(pending, history)
    if reference is None or math.isinf(clip_multiple):
        return [1.0] * len(pending)
    known = [e.norm for e in pending if e.norm is not None]
    factors = iter(clip_factors(known, reference, clip_multiple))
    return [1.0 if e.norm is None else next(factors) for e in pending]
