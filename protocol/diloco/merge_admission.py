"""Which contributions an owner's round accepts, and how their self-reported counts are bounded.

Acceptance: a contribution is refused with a reason (never raised: it is a peer's doing) when
its counts are malformed, its base is ahead of ``v``, it is stale by more than
``staleness_bound``, a contribution from the same peer is already in the round, or, under
``late_policy="drop"``, its base is older than ``v`` (its own round closed; the learner should
resync). Under ``"carry"`` older bases are accepted (weighed with a discount, see
``merge_weights``), and contributions arriving while MERGING are kept for round ``v + 1`` (their
staleness counted against ``v + 1``); under ``"drop"`` those are refused too, so every merged
contribution has staleness 0.

Self-reported counts are bounded before they count: ``steps`` by ``max_claimed_steps`` (the
node's 2H: what the owner can bound, whatever the sender says) and by the time since the base
version was published divided by ``min_step_time_s`` (a learner resets its count when it adopts
a version), ``tokens`` by ``max_tokens_per_step * steps``. Each bound that bit is flagged on the
``Pending`` contribution, and then on its ``Entry``, so the node can count it per peer. The
bounded steps set only the token weight (itself capped by the others', ``merge_weights``) and
whether a norm is evidence for the clip reference (few steps: not); they never scale a bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from protocol.diloco.merge_config import MergeConfig
from protocol.diloco.merge_results import Refusal
from protocol.diloco.outer import token_weight

__all__ = ["ContributionEvent", "Pending", "bounded_pending", "refusal_for"]


@dataclass(frozen=True, slots=True)
class ContributionEvent:
    """A learner's contribution as ``FragmentMerger.on_contribution`` received it: one of the
    events of the merger's transition table (the others live in ``protocol.diloco.merge``)."""

    peer: bytes
    base_version: int
    tokens: int
    steps: int
    step_time: float
    payload: object
    norm: float | None
    last: bool = False  # the sender's last contribution of its run (its end-of-run flush)


@dataclass(frozen=True, slots=True)
class Pending:
    """A contribution accepted into a round, its counts bounded; weighed when the round closes."""

    peer: bytes
    base_version: int
    weight: float  # token weight before discount and clamp
    payload: object
    norm: float | None  # as reported with the contribution; None: not reported, never clipped
    steps_bounded: bool
    tokens_bounded: bool
    steps: int = 1  # its inner steps, bounded
    last: bool = False  # the sender's last contribution of its run
    # its norm may set the clip reference: not when it covers fewer than ``reference_min_steps``
    # (a staggered fragment's first contribution, a step or a few, whose tiny norm would have the
    # next honest ones clipped); a claim of few steps only withdraws its own sender's evidence
    evidence: bool = True
    # how far its claims went past what the owner counted (claimed / counted steps, or tokens /
    # the tokens its counted steps allow; 1.0: within bounds): an honest stall lands near 1-2,
    # a liar far beyond, and standing charges a capped claim by it
    overclaim: float = 1.0


def refusal_for(
    ev: ContributionEvent,
    *,
    version: int,
    target: int,
    pool: Sequence[Pending],
    config: MergeConfig,
) -> tuple[Refusal, str] | None:
    """Why ``ev`` may not join the round for version ``target`` of a merger holding ``version``
    (``pool``: that round's contributions so far), or None to accept it."""
    stale = target - ev.base_version
    if ev.steps < 1 or ev.tokens < 0:
        return ("invalid", f"steps must be >= 1 and tokens >= 0, got {ev.steps} and {ev.tokens}")
    if not (math.isfinite(ev.step_time) and ev.step_time >= 0):
        return ("invalid", f"step_time must be finite and >= 0, got {ev.step_time}")
    if ev.base_version > version:
        return ("future", f"base version {ev.base_version} is ahead of version {version}")
    if stale > config.staleness_bound:
        return ("stale", f"stale by {stale} versions (bound {config.staleness_bound}); resync")
    if config.late_policy == "drop" and stale > 0:
        return ("closed", f"merge for version {ev.base_version} closed; resync")
    if any(e.peer == ev.peer for e in pool):
        return (
            "duplicate",
            f"duplicate contribution from {ev.peer.hex()[:8]} for version {target}",
        )
    return None


def bounded_pending(
    ev: ContributionEvent, *, config: MergeConfig, published_at: Mapping[int, float], now: float
) -> Pending:
    """``ev`` as a round holds it, its counts bounded (``published_at``: when each recent version
    opened, never empty; a base not in it counts from the oldest)."""
    steps = ev.steps
    if config.max_claimed_steps is not None:  # no more than the owner can bound
        steps = min(steps, config.max_claimed_steps)
    if config.min_step_time_s > 0:  # no more steps than the time since its base allowed
        opened = published_at.get(ev.base_version, min(published_at.values()))
        steps = min(steps, 1 + math.floor(max(0.0, now - opened) / config.min_step_time_s))
    cap = config.max_tokens_per_step
    tokens_bounded = cap is not None and ev.tokens > cap * steps
    w = token_weight(ev.tokens, steps, max_tokens_per_step=cap)
    evidence = steps >= config.reference_min_steps
    overclaim = max(ev.steps / steps, ev.tokens / (cap * steps) if cap else 1.0, 1.0)
    return Pending(
        ev.peer,
        ev.base_version,
        w,
        ev.payload,
        ev.norm,
        steps_bounded=steps < ev.steps,
        tokens_bounded=tokens_bounded,
        steps=steps,
        last=ev.last,
        evidence=evidence,
        overclaim=overclaim,
    )
