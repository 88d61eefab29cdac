"""How many contributions an owner's round waits for, and how long its grace window stays open.

The grace window lasts ``clamp(gamma * (tau * xi_step - xi_quorum - xi_sync), 0, grace_cap_s)``
from ``t_q``: ``xi_step`` is the slowest recent learner's step time (the largest per-peer EMA of
reported step times among peers accepted in the last ``step_time_rounds`` rounds), ``xi_quorum``
is how long the quorum took once the round's first contribution arrived (``t_q`` minus that
arrival; 0 with K = 1), ``xi_sync`` the EMA of the merge-plus-transfer times the node reports in
``on_published`` (0 until the first report). Measuring ``xi_quorum`` from the round's opening
instead would spend the whole budget on the H inner steps between two contributions of a
learner, and the window would always be 0 with staggered fragments. The
window only spends time that a learner already hides behind ``tau`` inner steps.

Effective quorum: ``K`` while the expected learners are unknown or at least ``K``; below that,
``set_expected(n)`` with ``1 <= n < K`` lowers it to ``n`` (a dead or departed learner must not
stall the rest), and the reasons say "K = .. lowered to the n learners expected". In
synchronous DiLoCo (``quorum_is_expected``) the quorum is ``max(1, n)`` whatever K says. With
``quorum_fraction`` it is at least that share of the ``n`` learners expected, rounded up. How
the round reacts when the quorum moves is told in ``protocol.diloco.merge``.

Held rounds (``held_until``): no round closes before a hold's end (a new owner waiting for its
predecessor's handoff, ``FragmentMerger.hold_until``), nor, while some expected learner's
work is not in (each learner's, when the node names them), before the end of the wait the
learners' last contributions started (``MergeConfig.last_wait_s``).
"""

from __future__ import annotations

import math

from protocol.diloco.merge_config import MergeConfig

__all__ = ["effective_quorum", "grace_window", "held_until", "moving_average", "quorum_share"]


def effective_quorum(config: MergeConfig, expected: int | None) -> tuple[int, str]:
    """The quorum with ``expected`` learners (None: unknown), and a note when it is not K."""
    k, n = config.quorum, expected
    if n is None or n == 0:  # unknown, or nobody left (the merger drops a round below K)
        return (1, "") if config.quorum_is_expected and n == 0 else (k, "")
    if config.quorum_is_expected:
        return n, ""
    if n < k:
        return n, f" (K = {k} lowered to the {n} learners expected)"
    share = quorum_share(config, n)
    if share > k:
        return share, f" (K = {share}: {config.quorum_fraction:g} of the {n} learners expected)"
    return k, ""


def quorum_share(config: MergeConfig, learners: int) -> int:
    """``quorum_fraction`` of ``learners``, rounded up."""
    return math.ceil(config.quorum_fraction * learners - 1e-9)


def grace_window(config: MergeConfig, *, xi_step: float, xi_quorum: float, xi_sync: float) -> float:
    """The grace window's length in seconds (see above)."""
    raw = config.gamma * (config.tau * xi_step - xi_quorum - xi_sync)
    return min(raw, config.grace_cap_s) if raw > 0 else 0.0  # (not -0.0 when gamma is 0)


def moving_average(old: float | None, value: float, alpha: float) -> float:
    """The exponential moving average ``old`` updated with ``value`` (``value`` when None)."""
    return value if old is None else alpha * value + (1.0 - alpha) * old


def held_until(
    *, hold: float | None, last_until: float | None, all_in: bool, now: float
) -> float | None:
    """Until when a round may not close at ``now``: a ``hold`` not yet over, and a last
    contribution's wait (``last_until``) not yet over while not ``all_in``; None: it may close."""
    waits = [t for t in (hold, None if all_in else last_until) if t is not None and t > now]
    return max(waits) if waits else None
