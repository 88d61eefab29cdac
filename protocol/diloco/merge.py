"""The owner's round for one fragment: quorum, adaptive grace window, staleness, late policy.

Theory of operation (arXiv 2604.21428, the synchronizer's minimum quorum and adaptive grace
window, made per-fragment and peer-to-peer as in docs/algorithm.md, "Owner loop"):

A ``FragmentMerger`` holds fragment ``p`` at version ``v`` (the number of merges applied) and
collects contributions for the round that produces ``v + 1``; a contribution's staleness is
``v - base_version``. Phases::

    COLLECTING --quorum K reached at t_q--> GRACE --window elapsed / all expected in--> MERGING
    COLLECTING --quorum reached and all expected in (or window 0)------------------> MERGING
    MERGING --on_published(v + 1)--> COLLECTING (round v + 1, carried contributions)
    MERGING --on_merge_failed--> COLLECTING / GRACE (less the discarded peers' contributions;
                                  retry after a delay)
    COLLECTING / GRACE --rebase(v')--> same phase at version v' > v (a new owner catching up with
                                  its predecessor's newer version keeps what it already accepted)
    GRACE --set_expected raises the effective quorum above the count--> COLLECTING

The grace window lasts ``clamp(gamma * (tau * xi_step - xi_quorum - xi_sync), 0, grace_cap_s)``
from ``t_q``: ``xi_step`` is the slowest recent learner's step time (the largest per-peer EMA of
reported step times among peers accepted in the last ``step_time_rounds`` rounds), ``xi_quorum``
is how long the quorum took once the round's first contribution arrived (``t_q`` minus that
arrival; 0 with K = 1), ``xi_sync`` the EMA of the merge-plus-transfer times the node reports in
``on_published`` (0 until the first report). Measuring ``xi_quorum`` from the round's opening
instead would spend the whole budget on the H inner steps between two contributions of a
learner, and the window would always be 0 with staggered fragments. The
window only spends time that a learner already hides behind ``tau`` inner steps.

Acceptance: a contribution is refused with a reason (never raised: it is a peer's doing) when
its counts are malformed, its base is ahead of ``v``, it is stale by more than
``staleness_bound``, a contribution from the same peer is already in the round, or, under
``late_policy="drop"``, its base is older than ``v`` (its own round closed; the learner should
resync). Under ``"carry"`` older bases are accepted with weight ``stale_discount ** staleness``,
and contributions arriving while MERGING are kept for round ``v + 1`` (their staleness counted
against ``v + 1``); under ``"drop"`` those are refused too, so every merged contribution has
staleness 0. Weights are ``tokens^2 / steps`` (tokens clamped to ``max_tokens_per_step * steps``)
times the discount, then capped at ``max_weight_median_multiple`` times the median and at the
same multiple of the median of the *other* contributions when the round closes (a liar's own
weight never sets its cap); if every weight is 0 (no peer counted tokens) they fall back to the
discounts.

Self-reported counts are bounded before they count: ``steps`` by the time since the base
version was published divided by ``min_step_time_s`` (a learner resets its count when it adopts
a version), ``tokens`` by ``max_tokens_per_step * steps``. Norm clipping: a contribution reported
with its ``norm`` is scaled down (``Entry.clip``) so that its norm per (bounded) inner step is at
most ``clip_multiple`` times a reference, the median of this round's norms per step and of the
(clipped) ones of the last ``norm_history`` merged contributions, so one attacker, even alone in
a round at K = 1, cannot set its own bound. Per step, because a learner's first contribution of a
fragment covers only the few steps of its staggered offset: whole norms made those tiny and had
every later honest contribution clipped. Every
bound that bit is flagged on the ``Entry`` so the node can count it per peer.

Effective quorum: ``K`` while the expected learners are unknown or at least ``K``; below that,
``set_expected(n)`` with ``1 <= n < K`` lowers it to ``n`` (a dead or departed learner must not
stall the rest), and the reasons say "K = .. lowered to the n learners expected". A lowered
round never closes on "all expected in": it waits out its grace window, so a learner the
owner's lagging view missed can still join. ``n`` comes from signed membership records, which
a member cannot remove for another, so a lone contribution closes a round only when this
owner sees one learner left, and then after the window (before, it never closed). Raising
``n`` again returns a GRACE round below the new quorum to COLLECTING. With ``set_expected(n)``
for ``n >= K`` it closes as soon as ``n`` contributions are in. When no learner is left
(``set_expected(0)``) a round still collecting below K is dropped, with a reason, so the
fragment's latest version becomes final; one in its grace window closes at once.
In synchronous DiLoCo (``quorum_is_expected``) the quorum is ``max(1, n)`` whatever K says.
With ``quorum_fraction`` a round also remembers the largest share-of-learners quorum it has had,
and a merge that closes below it (learners stopped or left while it was open) scales its
aggregate by ``Decision.scale`` = contributions / that quorum: the missing ones count as zero,
so the few contributions in flight when a swarm stops do not become a whole outer step (a merge
of one learner's work would make the fragment that island's alone).
It never merges below the effective quorum, and never waits past its deadline: any event at or after it
in GRACE closes the window (a refused contribution then yields kind "merge" with ``refusal``
set). Contributions carried for ``v + 1`` stay carried across a failed merge. ``_TABLE`` maps
(phase, event) to a handler; an event not in it is our own misuse and raises
``LocalProtocolError``, as do ``now`` going backwards and publishing a version other than v + 1.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, Literal

from protocol.diloco.outer import (
    cap_weights_by_others,
    clamp_weights,
    clip_factors,
    staleness_discount,
    token_weight,
)
from protocol.errors import LocalProtocolError

__all__ = ["Decision", "Entry", "FragmentMerger", "MergeConfig", "Phase"]

LatePolicy = Literal["carry", "drop"]
DecisionKind = Literal["accept", "refuse", "wait", "merge"]
Refusal = Literal["invalid", "future", "stale", "closed", "duplicate"]


class Phase(enum.Enum):
    COLLECTING = "collecting"
    GRACE = "grace"
    MERGING = "merging"


@dataclass(frozen=True, slots=True, kw_only=True)
class MergeConfig:
    """Owner round parameters (see the module docstring); validated on construction."""

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
    # c = 4 over the last 4 merges: with c = 2 or 16 merges of history, honest pseudo-gradients,
    # whose norms grow several-fold through the learning-rate warmup, were clipped and a 3-peer
    # tiny swarm ended at 3.6-4.6 nats/byte instead of 2.46; with these, 2.56
    clip_multiple: float = 4.0
    norm_history: int = 4
    min_step_time_s: float = 1e-3
    # synchronous DiLoCo: the quorum is every live learner (``set_expected``), whatever ``quorum``
    # says, so learners that leave or die stop being waited for once the node knows
    quorum_is_expected: bool = False

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
            (self.max_tokens_per_step is None or self.max_tokens_per_step >= 1,
             "max_tokens_per_step must be None or >= 1"),
            (self.max_weight_median_multiple >= 1.0, "max_weight_median_multiple must be >= 1"),
            (0.0 < self.ema_alpha <= 1.0, "ema_alpha must be in (0, 1]"),
            (self.step_time_rounds >= 1, "step_time_rounds must be >= 1"),
            (0.0 <= self.retry_s < math.inf, "retry_s must be finite and >= 0"),
            (self.clip_multiple >= 1.0, "clip_multiple must be >= 1 (math.inf: no clipping)"),
            (self.norm_history >= 0, "norm_history must be >= 0"),
            (0.0 <= self.min_step_time_s < math.inf, "min_step_time_s must be finite and >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalProtocolError(f"MergeConfig: {message}: {self!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One contribution in a merge: its (clamped, discounted) weight and staleness; ``clip``, the
    scale to apply to its payload (1.0: not clipped); which bounds bit; ``norm``, the payload's
    norm as the node reported it with the contribution (before clipping; None: not reported)."""

    peer: bytes
    payload: object
    weight: float
    staleness: int
    clip: float = 1.0
    norm: float | None = None
    weight_capped: bool = False
    steps_bounded: bool = False
    tokens_bounded: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What the merger decided. ``version``: the version it holds (collecting for, or merging).

    ``kind``: "accept" (contribution stored), "refuse" (see ``refusal``), "wait" (nothing to do
    yet) or "merge" (run the outer step on ``entries``; the contribution that triggered it, if
    any, was accepted: ``accepted``).
    """

    kind: DecisionKind
    reason: str
    version: int
    accepted: bool = False
    refusal: Refusal | None = None
    entries: tuple[Entry, ...] = ()
    scale: float = 1.0  # of the merge's aggregate: its share of the round's quorum (see the module doc)


@dataclass(frozen=True, slots=True)
class _Pending:
    peer: bytes
    base_version: int
    weight: float  # token weight before discount and clamp
    payload: object
    norm: float | None  # as reported with the contribution
    rate: float | None  # its norm per (bounded) inner step; None: not reported, never clipped
    steps_bounded: bool
    tokens_bounded: bool


# Events, one class each: the keys of the transition table (with the phase).
@dataclass(frozen=True, slots=True)
class _Contribution:
    peer: bytes
    base_version: int
    tokens: int
    steps: int
    step_time: float
    payload: object
    norm: float | None


@dataclass(frozen=True, slots=True)
class _Tick:
    pass


@dataclass(frozen=True, slots=True)
class _Expect:
    n: int | None


@dataclass(frozen=True, slots=True)
class _Published:
    new_version: int
    sync_time: float


@dataclass(frozen=True, slots=True)
class _Rebase:
    version: int


@dataclass(frozen=True, slots=True)
class _MergeFailed:
    reason: str
    discard: frozenset[bytes]


class FragmentMerger:
    """The owner's state machine for one fragment; see the module docstring."""

    def __init__(self, fragment: int, config: MergeConfig, *, version: int = 0, now: float) -> None:
        if fragment < 0 or version < 0 or not math.isfinite(now):
            raise LocalProtocolError(f"bad merger start: fragment {fragment}, version {version}, now {now}")
        self.fragment, self.config, self.version = fragment, config, version
        self.phase = Phase.COLLECTING
        self.expected: int | None = None
        self._now = self._opened_at = now
        self._quorum_at: float | None = None
        self._first_at: float | None = None  # arrival of the round's first contribution
        self._deadline: float | None = None
        self._entries: list[_Pending] = []
        self._carried: list[_Pending] = []  # for round v + 1, only while MERGING
        self._step_ema: dict[bytes, tuple[float, int]] = {}  # peer -> (EMA, version last seen)
        self._sync_ema: float | None = None
        self._published_at: dict[int, float] = {version: now}  # recent versions -> when they opened
        self._rates: list[float] = []  # clipped norms per step of recently merged contributions
        self._closing_rates: list[float] = []  # of the merge in progress, kept on publish
        self._round_share = 0  # the largest share-of-learners quorum of the round open (0: none)

    # -- events ------------------------------------------------------------------------------

    def on_contribution(
        self, peer: bytes, *, base_version: int, tokens: int, steps: int, step_time: float,
        payload: object, now: float, norm: float | None = None,
    ) -> Decision:
        """A learner's contribution (payload opaque, e.g. the decoded pseudo-gradient; ``norm``
        its L2 norm, measured by the node: without it the contribution is never clipped)."""
        if norm is not None and not (math.isfinite(norm) and norm >= 0):
            raise LocalProtocolError(f"norm must be finite and >= 0, got {norm}")
        return self._dispatch(_Contribution(peer, base_version, tokens, steps, step_time, payload, norm), now)

    def on_tick(self, now: float) -> Decision:
        """Timer event; due at ``deadline()``. Closes an elapsed grace window."""
        return self._dispatch(_Tick(), now)

    def set_expected(self, n: int | None, *, now: float) -> Decision:
        """Number of live learners expected to contribute (None: unknown); may close the round."""
        if n is not None and n < 0:
            raise LocalProtocolError(f"expected contributions must be >= 0, got {n}")
        return self._dispatch(_Expect(n), now)

    def on_published(self, new_version: int, *, sync_time: float, now: float) -> Decision:
        """The node applied and published the merge; opens round ``new_version`` (== v + 1)."""
        return self._dispatch(_Published(new_version, sync_time), now)

    def on_merge_failed(self, reason: str, *, now: float, discard: Collection[bytes] = ()) -> Decision:
        """The merge failed; drop ``discard`` peers' contributions and retry after ``retry_s``."""
        return self._dispatch(_MergeFailed(reason, frozenset(discard)), now)

    def rebase(self, version: int, *, now: float) -> Decision:
        """Move the open round to ``version`` (> v), keeping the contributions already accepted.

        A new owner that catches up with its predecessor's newer version calls this: the
        contributions it accepted stay, their staleness now counted against ``version``; those
        that fall beyond ``staleness_bound`` are dropped (the reason counts them).
        """
        if version <= self.version:
            raise LocalProtocolError(f"rebase to version {version}, not above the held {self.version}")
        return self._dispatch(_Rebase(version), now)

    # -- queries -----------------------------------------------------------------------------

    def deadline(self) -> float | None:
        """When the node must next call ``on_tick`` (grace window end); None when no timer."""
        return self._deadline if self.phase is Phase.GRACE else None

    @property
    def count(self) -> int:
        """Contributions in the current round."""
        return len(self._entries)

    @property
    def quorum(self) -> int:
        """The effective quorum now: K, or fewer while fewer learners are expected (see above)."""
        return self._quorum()[0]

    @property
    def quorum_time(self) -> float | None:
        """When the current round reached quorum (None before)."""
        return self._quorum_at

    def step_time_estimate(self) -> float:
        """``xi_step``: the slowest recent learner's step-time EMA (0 with no reports)."""
        horizon = self.version - self.config.step_time_rounds + 1
        return max((ema for ema, seen in self._step_ema.values() if seen >= horizon), default=0.0)

    def sync_time_estimate(self) -> float:
        """``xi_sync``: EMA of reported merge-plus-transfer times (0 with no reports)."""
        return 0.0 if self._sync_ema is None else self._sync_ema

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch(self, event: object, now: float) -> Decision:
        if not now >= self._now:  # also catches NaN
            raise LocalProtocolError(f"clock went backwards or is NaN: {now} after {self._now}")
        handler = _TABLE.get((self.phase, type(event)))
        if handler is None:
            raise LocalProtocolError(
                f"{type(event).__name__.strip('_')} not allowed while {self.phase.value} "
                f"for version {self.version} of fragment {self.fragment}"
            )
        self._now = now
        return handler(self, event)

    # -- handlers ----------------------------------------------------------------------------

    def _contribute(self, ev: _Contribution) -> Decision:
        refused = self._refusal(ev, self.version, self._entries)
        if refused is None:
            self._admit(ev, self._entries)
            return self._settle(True, f"accepted from {ev.peer.hex()[:8]} for version {self.version}")
        if self.phase is Phase.GRACE and self._deadline is not None and self._deadline <= self._now:
            closing = self._settle(False, "")  # the window elapsed: a refusal still closes it
            return replace(closing, reason=f"{refused.reason}; {closing.reason}", refusal=refused.refusal)
        return refused

    def _carry(self, ev: _Contribution) -> Decision:
        refused = self._refusal(ev, self.version + 1, self._carried)
        if refused is not None:
            return refused
        self._admit(ev, self._carried)
        stale = self.version + 1 - ev.base_version
        return self._decide("accept", f"carried into round for version {self.version + 1} "
                            f"(staleness {stale}; {len(self._carried)} carried)", accepted=True)

    def _tick(self, ev: _Tick) -> Decision:
        return self._settle(False, "")

    def _tick_merging(self, ev: _Tick) -> Decision:
        return self._decide("wait", f"merge for version {self.version} in progress")

    def _expect(self, ev: _Expect) -> Decision:
        self.expected = ev.n
        n = len(self._entries)
        if ev.n == 0 and self.phase is Phase.COLLECTING and 0 < n < self.config.quorum:
            # nobody left to reach K: drop the rest rather than merge below quorum (a lone
            # contribution merged at the end could be an attacker's) or never become final
            dropped, self._entries, self._first_at = n, [], None
            self._reopen(Phase.COLLECTING, opened_at=self._now)
            return self._decide("wait", f"no learner left to reach quorum {self.config.quorum}: "
                                        f"{dropped} contributions dropped")
        if ev.n == 0 and self.phase is Phase.GRACE:  # it reached its (lowered) quorum: nobody to wait for
            return self._close(f"no learner left: closing with {self._tally()}", False)
        k, note = self._quorum()
        if self.phase is Phase.GRACE and n < k:  # a learner is back: the lowered quorum rises again
            self._reopen(Phase.COLLECTING, opened_at=self._opened_at)
            return self._decide("wait", f"expecting {ev.n}: quorum back to {k}{note}, grace window "
                                        f"closed ({self._tally()})")
        return self._settle(False, f"expecting {ev.n}")

    def _expect_merging(self, ev: _Expect) -> Decision:
        self.expected = ev.n
        return self._decide("wait", f"expecting {ev.n}; merge for version {self.version} in progress")

    def _published(self, ev: _Published) -> Decision:
        if ev.new_version != self.version + 1:
            raise LocalProtocolError(f"published version {ev.new_version}, expected {self.version + 1}")
        if not (math.isfinite(ev.sync_time) and ev.sync_time >= 0):
            raise LocalProtocolError(f"sync_time must be finite and >= 0, got {ev.sync_time}")
        self._sync_ema = _ema(self._sync_ema, ev.sync_time, self.config.ema_alpha)
        self.version = ev.new_version
        self._opened(ev.new_version)
        self._rates = (self._rates + self._closing_rates)[-self.config.norm_history:] if self.config.norm_history else []
        self._closing_rates = []
        self._entries, self._carried = self._carried, []
        self._reopen(Phase.COLLECTING, opened_at=self._now)
        self._first_at = self._now if self._entries else None
        self._round_share = 0
        horizon = self.version - self.config.step_time_rounds + 1
        self._step_ema = {p: v for p, v in self._step_ema.items() if v[1] >= horizon}
        return self._settle(False, f"round for version {self.version} open with carried contributions")

    def _merge_failed(self, ev: _MergeFailed) -> Decision:
        kept = [e for e in self._entries if e.peer not in ev.discard]
        dropped = len(self._entries) - len(kept)
        self._entries = kept
        reason = f"merge for version {self.version} failed ({ev.reason}); {dropped} discarded, {self._tally()} kept"
        k, note = self._quorum()
        if len(kept) < k:
            self._reopen(Phase.COLLECTING, opened_at=self._opened_at)
            return self._decide("wait", f"{reason}; waiting for quorum {k}{note}")
        self._reopen(Phase.GRACE, opened_at=self._opened_at)
        self._quorum_at = self._now
        self._deadline = self._now + min(self.config.retry_s, self.config.grace_cap_s)
        if self._deadline <= self._now:
            return self._close(f"{reason}; retrying now", False)
        return self._decide("wait", f"{reason}; retry in {self._deadline - self._now:.2f} s")

    def _rebase(self, ev: _Rebase) -> Decision:
        bound = self.config.staleness_bound
        kept = [e for e in self._entries if ev.version - e.base_version <= bound]
        dropped = len(self._entries) - len(kept)
        old, self.version, self._entries = self.version, ev.version, kept
        self._opened(ev.version)
        self._round_share = 0
        if len(kept) < self._quorum()[0]:  # never merge below quorum: back to collecting
            self._reopen(Phase.COLLECTING, opened_at=self._opened_at)
        if not kept:
            self._first_at = None
        return self._settle(False, f"rebased from version {old} to {ev.version}; {len(kept)} kept, "
                                   f"{dropped} dropped as stale beyond {bound}")

    # -- helpers -----------------------------------------------------------------------------

    def _refusal(self, ev: _Contribution, target: int, pool: list[_Pending]) -> Decision | None:
        """The refusal for ``ev`` joining the round for version ``target``, or None to accept."""
        cfg, stale = self.config, target - ev.base_version
        problem: tuple[Refusal, str] | None = None
        if ev.steps < 1 or ev.tokens < 0:
            problem = ("invalid", f"steps must be >= 1 and tokens >= 0, got {ev.steps} and {ev.tokens}")
        elif not (math.isfinite(ev.step_time) and ev.step_time >= 0):
            problem = ("invalid", f"step_time must be finite and >= 0, got {ev.step_time}")
        elif ev.base_version > self.version:
            problem = ("future", f"base version {ev.base_version} is ahead of version {self.version}")
        elif stale > cfg.staleness_bound:
            problem = ("stale", f"stale by {stale} versions (bound {cfg.staleness_bound}); resync")
        elif cfg.late_policy == "drop" and stale > 0:
            problem = ("closed", f"merge for version {ev.base_version} closed; resync")
        elif any(e.peer == ev.peer for e in pool):
            problem = ("duplicate", f"duplicate contribution from {ev.peer.hex()[:8]} for version {target}")
        if problem is None:
            return None
        return self._decide("refuse", problem[1], refusal=problem[0])

    def _admit(self, ev: _Contribution, pool: list[_Pending]) -> None:
        cfg, steps = self.config, ev.steps
        if cfg.min_step_time_s > 0:  # no more steps than the time since its base allowed
            opened = self._published_at.get(ev.base_version, min(self._published_at.values()))
            steps = min(steps, 1 + math.floor(max(0.0, self._now - opened) / cfg.min_step_time_s))
        cap = cfg.max_tokens_per_step
        tokens_bounded = cap is not None and ev.tokens > cap * steps
        w = token_weight(ev.tokens, steps, max_tokens_per_step=cap)
        rate = None if ev.norm is None else ev.norm / steps  # per inner step: comparable across
        pool.append(_Pending(ev.peer, ev.base_version, w, ev.payload, ev.norm, rate,  # contributions of
                             steps_bounded=steps < ev.steps, tokens_bounded=tokens_bounded))  # any length
        if pool is self._entries and self._first_at is None:
            self._first_at = self._now
        old = self._step_ema.get(ev.peer)
        ema = _ema(None if old is None else old[0], ev.step_time, self.config.ema_alpha)
        self._step_ema[ev.peer] = (ema, self.version)

    def _settle(self, accepted: bool, otherwise: str) -> Decision:
        """After a change while COLLECTING/GRACE: close, open the grace window, or keep going."""
        n, expected = len(self._entries), self.expected
        k, note = self._quorum()
        if self.config.quorum_fraction > 0 and not self.config.quorum_is_expected and expected:
            self._round_share = max(self._round_share, self._share(expected))
        if n >= k and expected is not None and n >= expected and "lowered" not in note:
            return self._close(f"all {n}/{expected} expected contributions in", accepted)
        if self.phase is Phase.COLLECTING and n >= k:
            wait = self._open_grace()
            reason = f"quorum {n}/{k}{note} reached; grace window {wait:.2f} s"
            if self._deadline is not None and self._deadline <= self._now:
                return self._close(f"{reason}; closing with {self._tally()}", accepted)
            return self._decide("accept" if accepted else "wait", reason, accepted=accepted)
        if self.phase is Phase.GRACE and self._deadline is not None:
            left = self._deadline - self._now
            if left <= 0:
                return self._close(f"grace window elapsed with {self._tally()}", accepted)
            otherwise = f"{otherwise or 'grace window open'} ({self._tally()}; {left:.2f} s left)"
        else:
            otherwise = f"{otherwise or 'waiting for quorum'} ({self._tally()}; quorum {k}{note})"
        return self._decide("accept" if accepted else "wait", otherwise, accepted=accepted)

    def _quorum(self) -> tuple[int, str]:
        """The effective quorum, and a note when it is K lowered to the learners expected."""
        k, n = self.config.quorum, self.expected
        if n is None or n == 0:  # unknown, or nobody left (``_expect`` drops a round below K)
            return (1, "") if self.config.quorum_is_expected and n == 0 else (k, "")
        if self.config.quorum_is_expected:
            return n, ""
        if n < k:
            return n, f" (K = {k} lowered to the {n} learners expected)"
        share = self._share(n)
        if share > k:
            return share, f" (K = {share}: {self.config.quorum_fraction:g} of the {n} learners expected)"
        return k, ""

    def _share(self, learners: int) -> int:
        """``quorum_fraction`` of ``learners``, rounded up."""
        return math.ceil(self.config.quorum_fraction * learners - 1e-9)

    def _open_grace(self) -> float:
        cfg = self.config
        xi_quorum = self._now - (self._opened_at if self._first_at is None else self._first_at)
        raw = cfg.gamma * (cfg.tau * self.step_time_estimate() - xi_quorum - self.sync_time_estimate())
        wait = min(raw, cfg.grace_cap_s) if raw > 0 else 0.0  # (not -0.0 when gamma is 0)
        self.phase, self._quorum_at, self._deadline = Phase.GRACE, self._now, self._now + wait
        return wait

    def _close(self, reason: str, accepted: bool) -> Decision:
        self.phase, self._deadline = Phase.MERGING, None
        n, share = len(self._entries), self._round_share
        scale = n / share if n < share else 1.0
        if scale < 1.0:
            reason += f"; scaled to {n}/{share} of a step (the round's quorum was {share})"
        return self._decide("merge", reason, accepted=accepted, entries=self._weighted(), scale=scale)

    def _weighted(self) -> tuple[Entry, ...]:
        cfg = self.config
        stale = [self.version - e.base_version for e in self._entries]
        discounts = [staleness_discount(s, cfg.stale_discount) for s in stale]
        weights = [e.weight * d for e, d in zip(self._entries, discounts, strict=True)]
        if not any(w > 0 for w in weights):
            weights = discounts
        weights = clamp_weights(weights, max_median_multiple=cfg.max_weight_median_multiple)
        weights, capped = cap_weights_by_others(weights, multiple=cfg.max_weight_median_multiple)
        clips = self._clips()
        self._closing_rates = [e.rate * c for e, c in zip(self._entries, clips, strict=True) if e.rate is not None]
        return tuple(
            Entry(peer=e.peer, payload=e.payload, weight=w, staleness=s, clip=c, norm=e.norm, weight_capped=k,
                  steps_bounded=e.steps_bounded, tokens_bounded=e.tokens_bounded)
            for e, w, s, c, k in zip(self._entries, weights, stale, clips, capped, strict=True)
        )

    def _clips(self) -> list[float]:
        """Scale per entry bringing its rate to ``clip_multiple`` x the reference rate (see above)."""
        known = [e.rate for e in self._entries if e.rate is not None]
        if not known or math.isinf(self.config.clip_multiple):
            return [1.0] * len(self._entries)
        reference = statistics.median(known + self._rates)
        factors = iter(clip_factors(known, reference, self.config.clip_multiple))
        return [1.0 if e.rate is None else next(factors) for e in self._entries]

    def _opened(self, version: int) -> None:
        """Version ``version`` opened now; keep the opening times the staleness bound can reach."""
        self._published_at[version] = self._now
        floor = version - self.config.staleness_bound - 1
        self._published_at = {v: t for v, t in self._published_at.items() if v >= floor}

    def _reopen(self, phase: Phase, *, opened_at: float) -> None:
        self.phase, self._opened_at = phase, opened_at
        self._quorum_at = self._deadline = None

    def _tally(self) -> str:
        n = len(self._entries)
        return f"{n}/{self.expected} contributions" if self.expected is not None else f"{n} contributions"

    def _decide(self, kind: DecisionKind, reason: str, *, accepted: bool = False,
                refusal: Refusal | None = None, entries: tuple[Entry, ...] = (), scale: float = 1.0) -> Decision:
        return Decision(kind=kind, reason=reason, version=self.version, accepted=accepted,
                        refusal=refusal, entries=entries, scale=scale)


def _ema(old: float | None, value: float, alpha: float) -> float:
    return value if old is None else alpha * value + (1.0 - alpha) * old


_C, _G, _M = Phase.COLLECTING, Phase.GRACE, Phase.MERGING
_TABLE: dict[tuple[Phase, type], Callable[[FragmentMerger, Any], Decision]] = {
    (_C, _Contribution): FragmentMerger._contribute,
    (_G, _Contribution): FragmentMerger._contribute,
    (_M, _Contribution): FragmentMerger._carry,
    (_C, _Tick): FragmentMerger._tick,
    (_G, _Tick): FragmentMerger._tick,
    (_M, _Tick): FragmentMerger._tick_merging,
    (_C, _Expect): FragmentMerger._expect,
    (_G, _Expect): FragmentMerger._expect,
    (_M, _Expect): FragmentMerger._expect_merging,
    (_M, _Published): FragmentMerger._published,
    (_M, _MergeFailed): FragmentMerger._merge_failed,
    (_C, _Rebase): FragmentMerger._rebase,
    (_G, _Rebase): FragmentMerger._rebase,
}
