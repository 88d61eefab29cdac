"""The parameters of an owner's round: ``MergeConfig``, validated on construction.

What each parameter does is told where it is used: the round itself in ``protocol.diloco.merge``,
acceptance and bounded counts in ``merge_admission``, weights and norm clipping in
``merge_weights``, the effective quorum and the grace window in ``merge_quorum``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from protocol.errors import LocalProtocolError

__all__ = ["LatePolicy", "MergeConfig"]

LatePolicy = Literal["carry", "drop"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MergeConfig:
    """Owner round parameters (see ``protocol.diloco.merge``); validated on construction."""

    quorum: int = 1
    # K also at least this share of the learners expected (``set_expected``), rounded up: 0 is
    # the paper's fixed K; with desynchronised learners a fixed K = 1 makes most versions one
    # learner's work (8 tiny peers: 2.54 / 2.67 nats/byte at K = 1, 2.35 / 2.26 at half)
    quorum_fraction: float = 0.0
    gamma: float = 0.8
    tau: float = 2.0
    grace_cap_s: float = 30.0
    staleness_bound: int = 2
    stale_discount: float = 0.5
    late_policy: LatePolicy = "drop"
    max_tokens_per_step: int | None = None
    max_weight_median_multiple: float = 4.0
    ema_alpha: float = 0.3
    step_time_rounds: int = 4
    retry_s: float = 1.0
    # c = 4 over the last 4 senders' merged norms: with c = 2 or 16 merges of history, honest
    # pseudo-gradients, whose norms grow several-fold through the learning-rate warmup, were
    # clipped and a 3-peer tiny swarm ended at 3.6-4.6 nats/byte instead of 2.46; with these, 2.56.
    # The clip is on a contribution's whole norm (``merge_weights``): a claim never scales it
    clip_multiple: float = 4.0
    norm_history: int = 4
    min_step_time_s: float = 1e-3
    # a contribution's steps count at most this many (on top of the time bound, which 1 ms a step
    # let a 20 s-old version claim 20,001 steps under): the node sets 2H, the most a learner trains
    # between two sends of a fragment with one in flight. None: no bound but time
    max_claimed_steps: int | None = None
    # a contribution of fewer (bounded) steps is no evidence for the norm clip's reference: a
    # staggered fragment's first one covers a step or a few, and its tiny norm would have the next
    # honest ones clipped. It is still clipped itself. The node sets H/2; 0: every one is evidence
    reference_min_steps: int = 0
    # a contribution counts at most this many inner steps of work: one covering more (its
    # bounded steps) has its payload scaled by max_work_steps / steps (``Entry.work_scale``).
    # The node sets 2H under outer momentum (``RunConfig.merge_max_work_steps``): a learner
    # faster than the round's pace ships ~3.5H steps a round, and Nesterov's ~eta/(1-mu) gain on
    # that diverged (docs/benchmarks.md, *A slow learner under outer momentum*). None: every
    # step counts (plain averaging)
    max_work_steps: int | None = None
    # synchronous DiLoCo: the quorum is every live learner (``set_expected``), whatever ``quorum``
    # says, so learners that leave or die stop being waited for once the node knows
    quorum_is_expected: bool = False
    # a round holding a learner's last contribution (its end-of-run flush) waits this long from
    # the latest one (at most grace_cap_s from the first) for every expected learner's work
    # before closing: learners that stop together flush together, a few seconds apart, and two
    # rounds of their last work (the first closing on the quorum, the rest carried into the
    # next, or merged alone on its version) moved the final model by two steps of it
    last_wait_s: float = 3.0

    def __post_init__(self) -> None:
        checks = [
            (self.quorum >= 1, "quorum must be >= 1"),
            (0.0 <= self.quorum_fraction <= 1.0, "quorum_fraction must be in [0, 1]"),
            (0.0 <= self.gamma <= 1.0, "gamma must be in [0, 1]"),
            (0.0 <= self.tau < math.inf, "tau must be finite and >= 0"),
            (0.0 <= self.grace_cap_s < math.inf, "grace_cap_s must be finite and >= 0"),
            (self.staleness_bound >= 0, "staleness_bound must be >= 0"),
            (0.0 < self.stale_discount <= 1.0, "stale_discount must be in (0, 1]"),
            (self.late_policy in ("carry", "drop"), "late_policy must be 'carry' or 'drop'"),
            (
                self.max_tokens_per_step is None or self.max_tokens_per_step >= 1,
                "max_tokens_per_step must be None or >= 1",
            ),
            (self.max_weight_median_multiple >= 1.0, "max_weight_median_multiple must be >= 1"),
            (0.0 < self.ema_alpha <= 1.0, "ema_alpha must be in (0, 1]"),
            (self.step_time_rounds >= 1, "step_time_rounds must be >= 1"),
            (0.0 <= self.retry_s < math.inf, "retry_s must be finite and >= 0"),
            (0.0 <= self.last_wait_s < math.inf, "last_wait_s must be finite and >= 0"),
            (self.clip_multiple >= 1.0, "clip_multiple must be >= 1 (math.inf: no clipping)"),
            (self.norm_history >= 0, "norm_history must be >= 0"),
            (0.0 <= self.min_step_time_s < math.inf, "min_step_time_s must be finite and >= 0"),
            (
                self.max_work_steps is None or self.max_work_steps >= 1,
                "max_work_steps must be None or >= 1",
            ),
            (
                self.max_claimed_steps is None or self.max_claimed_steps >= 1,
                "max_claimed_steps must be None or >= 1",
            ),
            (self.reference_min_steps >= 0, "reference_min_steps must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalProtocolError(f"MergeConfig: {message}: {self!r}")
