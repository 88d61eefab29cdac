"""The owner's round for one fragment: quorum, adaptive grace window, staleness, late policy.

Theory of operation (arXiv 2604.21428, the synchronizer's minimum quorum and adaptive grace
window, made per-fragment and peer-to-peer as in docs/algorithm.md, "The owner loop"):

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
    COLLECTING / GRACE --a close while held (hold_until)--> GRACE until the hold ends or is released
    COLLECTING / GRACE --drop_round--> COLLECTING with no contributions (the version went final)
    GRACE --set_expected raises the effective quorum above the count--> COLLECTING

The rules it applies live beside it: ``merge_quorum`` (effective quorum, grace window length,
held rounds), ``merge_admission`` (acceptance, carrying into ``v + 1``, bounded counts),
``merge_weights`` (robust weights, norm clips); ``merge_config`` holds the parameters,
``merge_events`` the events, ``merge_results`` the answers.

Effective quorum (``merge_quorum``): a round whose quorum K was lowered to the ``n`` learners
expected never closes on "all expected in": it waits out its grace window, so a learner the
owner's lagging view missed can still join. ``n`` comes from signed membership records, which
a member cannot remove for another, so a lone contribution closes a round only when this
owner sees one learner left, and then after the window (before, it never closed). Raising
``n`` again returns a GRACE round below the new quorum to COLLECTING. With ``set_expected(n)``
for ``n >= K`` it closes as soon as ``n`` contributions are in. When no learner is left
(``set_expected(0)``) a round still collecting below K is dropped, with a reason, so the
fragment's latest version becomes final; one in its grace window closes at once.
With ``quorum_fraction`` a round also remembers the largest share-of-learners quorum it has had,
and a merge that closes below it (learners stopped or left while it was open) scales its
aggregate by ``Decision.scale`` = contributions / that quorum: the missing ones count as zero,
so the few contributions in flight when a swarm stops do not become a whole outer step (a merge
of one learner's work would make the fragment that island's alone). ``set_expected(n,
finished=f)`` counts ``f`` learners that finished training in that share too (the node passes
them in a decoupled swarm): a straggler still training after the others stopped then moves the
fragment by its share of a step, where whole momentum steps of its work alone undid the swarm's.
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
from dataclasses import replace
from typing import Any

from protocol.diloco.merge_admission import ContributionEvent, Pending, bounded_pending, refusal_for
from protocol.diloco.merge_config import LatePolicy, MergeConfig
from protocol.diloco.merge_events import Drop, Expect, Hold, MergeFailed, Published, Rebase, Tick
from protocol.diloco.merge_quorum import (
    effective_quorum,
    grace_window,
    held_until,
    moving_average,
    quorum_share,
)
from protocol.diloco.merge_results import Decision, DecisionKind, Entry, Refusal
from protocol.diloco.merge_weights import NormHistory, weigh
from protocol.diloco.reference import HandedNorm, as_history
from protocol.errors import LocalProtocolError

__all__ = [
    "Decision",
    "DecisionKind",
    "Entry",
    "FragmentMerger",
    "LatePolicy",
    "MergeConfig",
    "NormHistory",
    "Phase",
    "Refusal",
    "latest_per_sender",
]


def latest_per_sender(history: NormHistory, keep: int) -> NormHistory:
    """The last ``keep`` entries of ``history`` with one per sender, its latest (seeded entries,
    sender None, each count as their own): one sender, however many rounds it sends in alone,
    holds one vote in the clip reference."""
    out: NormHistory = []
    seen: set[bytes] = set()
    for peer, norm in reversed(history):
        if len(out) >= keep:
            break
        if peer is None or peer not in seen:
            out.append((peer, norm))
            if peer is not None:
                seen.add(peer)
    return out[::-1]


MERGED_SENDERS_KEPT = (
    4096  # senders whose merged rounds are counted (``merges_of``); the least recent go
)


class Phase(enum.Enum):
    COLLECTING = "collecting"
    GRACE = "grace"
    MERGING = "merging"


class FragmentMerger:
    """The owner's state machine for one fragment; see the module docstring."""

    def __init__(self, fragment: int, config: MergeConfig, *, version: int = 0, now: float) -> None:
        if fragment < 0 or version < 0 or not math.isfinite(now):
            raise LocalProtocolError(
                f"bad merger start: fragment {fragment}, version {version}, now {now}"
            )
        self.fragment, self.config, self.version = fragment, config, version
        self.phase = Phase.COLLECTING
        self.expected: int | None = None
        self.finished = 0  # learners that finished training: in a round's share, never waited for
        self.learners: frozenset[bytes] | None = None  # the expected learners' ids, when known
        self._now = self._opened_at = now
        self._quorum_at: float | None = None
        self._first_at: float | None = None  # arrival of the round's first contribution
        self._deadline: float | None = None
        self._entries: list[Pending] = []
        self._carried: list[Pending] = []  # for round v + 1, only while MERGING
        self._step_ema: dict[bytes, tuple[float, int]] = {}  # peer -> (EMA, version last seen)
        self._sync_ema: float | None = None
        self._published_at: dict[int, float] = {version: now}  # recent versions -> when they opened
        self.norms: NormHistory = []  # (sender, clipped whole norm) of the last senders merged
        self._closing_norms: NormHistory = []  # of the merge in progress, kept on publish
        self._merged_rounds: dict[
            bytes, int
        ] = {}  # sender -> merges its work was in (least recent first)
        self._round_share = 0  # the largest share-of-learners quorum of the round open (0: none)
        self._hold: float | None = None  # no round closes before this (``hold_until``)
        self._grace_due: float | None = None  # when GRACE would close without the hold
        self._last_until: float | None = (
            None  # a last contribution in the round: wait for all till then
        )
        self._last_from: float | None = None  # when the round's first last contribution came

    # -- events ------------------------------------------------------------------------------

    def on_contribution(
        self,
        peer: bytes,
        *,
        base_version: int,
        tokens: int,
        steps: int,
        step_time: float,
        payload: object,
        now: float,
        norm: float | None = None,
        last: bool = False,
    ) -> Decision:
        """A learner's contribution (payload opaque, e.g. the decoded pseudo-gradient; ``norm``
        its L2 norm, measured by the node: without it the contribution is never clipped;
        ``last``: the sender's last of its run, its end-of-run flush: the round then waits up
        to ``last_wait_s`` for every expected learner's)."""
        if norm is not None and not (math.isfinite(norm) and norm >= 0):
            raise LocalProtocolError(f"norm must be finite and >= 0, got {norm}")
        return self._dispatch(
            ContributionEvent(peer, base_version, tokens, steps, step_time, payload, norm, last),
            now,
        )

    def on_tick(self, now: float) -> Decision:
        """Timer event; due at ``deadline()``. Closes an elapsed grace window."""
        return self._dispatch(Tick(), now)

    def set_expected(
        self,
        n: int | None,
        *,
        now: float,
        finished: int = 0,
        learners: frozenset[bytes] | None = None,
    ) -> Decision:
        """Number of live learners expected to contribute (None: unknown), and of those that
        finished training (counted in a round's share of the learners, never waited for); may
        close the round. ``learners``, when the node knows them, are the ``n`` expected: a round
        waiting for last contributions then waits for each of them, not for ``n`` senders
        (the last work of learners that already finished must not stand in for theirs)."""
        if n is not None and n < 0:
            raise LocalProtocolError(f"expected contributions must be >= 0, got {n}")
        if finished < 0:
            raise LocalProtocolError(f"finished learners must be >= 0, got {finished}")
        if learners is not None and len(learners) != n:
            raise LocalProtocolError(f"{len(learners)} expected learners named for {n} expected")
        return self._dispatch(Expect(n, finished, learners), now)

    def on_published(self, new_version: int, *, sync_time: float, now: float) -> Decision:
        """The node applied and published the merge; opens round ``new_version`` (== v + 1)."""
        return self._dispatch(Published(new_version, sync_time), now)

    def on_merge_failed(
        self, reason: str, *, now: float, discard: Collection[bytes] = ()
    ) -> Decision:
        """The merge failed; drop ``discard`` peers' contributions and retry after ``retry_s``."""
        return self._dispatch(MergeFailed(reason, frozenset(discard)), now)

    def rebase(self, version: int, *, now: float) -> Decision:
        """Move the open round to ``version`` (> v), keeping the contributions already accepted.

        A new owner that catches up with its predecessor's newer version calls this: the
        contributions it accepted stay, their staleness now counted against ``version``; those
        that fall beyond ``staleness_bound`` are dropped (the reason counts them).
        """
        if version <= self.version:
            raise LocalProtocolError(
                f"rebase to version {version}, not above the held {self.version}"
            )
        return self._dispatch(Rebase(version), now)

    def hold_until(self, until: float, *, now: float) -> Decision:
        """Close no round before ``until``; ``until <= now`` releases the hold at once.

        A new owner holds its first merge while its predecessor's state may still come (the
        predecessor hands it over as it retires): merging first would make a version the
        predecessor's learners never see. Contributions are accepted meanwhile; a round that
        would close waits in GRACE with the hold's end as its deadline, and closes then (or
        when the hold is released)."""
        if not math.isfinite(until):
            raise LocalProtocolError(f"hold must end at a finite time, got {until}")
        return self._dispatch(Hold(until), now)

    def drop_round(self, reason: str, *, now: float) -> Decision:
        """Drop every contribution of the open round, not merged (``reason`` says why): the
        version it would follow was handed out as final elsewhere, and merging would fork it."""
        return self._dispatch(Drop(reason), now)

    # -- queries -----------------------------------------------------------------------------

    def deadline(self) -> float | None:
        """When the node must next call ``on_tick`` (grace window end); None when no timer."""
        return self._deadline if self.phase is Phase.GRACE else None

    @property
    def count(self) -> int:
        """Contributions in the current round."""
        return len(self._entries)

    @property
    def contributors(self) -> frozenset[bytes]:
        """The senders whose contributions wait in the current round or are carried into the next."""
        return frozenset(e.peer for e in (*self._entries, *self._carried))

    @property
    def quorum(self) -> int:
        """The effective quorum now: K, or fewer while fewer learners are expected (see above)."""
        return self._quorum()[0]

    @property
    def held_until(self) -> float | None:
        """When the hold set by ``hold_until`` ends (None: no hold now)."""
        return self._hold if self._hold is not None and self._hold > self._now else None

    @property
    def quorum_time(self) -> float | None:
        """When the current round reached quorum (None before)."""
        return self._quorum_at

    def norm_reference(self) -> float | None:
        """The lower median of the recent senders' merged norms (``norms``), the history's half of
        the clip reference; None with no history (a fresh owner's, until it is seeded)."""
        return statistics.median_low([n for _, n in self.norms]) if self.norms else None

    def merges_of(self, peer: bytes) -> int:
        """How many of this merger's published merges held ``peer``'s work (0: none, or forgotten:
        the ``MERGED_SENDERS_KEPT`` most recently merged senders are kept)."""
        return self._merged_rounds.get(peer, 0)

    def round_seconds(self) -> float | None:
        """The median time between the recent versions' openings, as this merger saw them (its
        own clock, no sender's claim); None before a second version opened."""
        times = sorted(self._published_at.values())
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return statistics.median(gaps) if gaps else None

    def step_time_estimate(self) -> float:
        """``xi_step``: the slowest recent learner's step-time EMA (0 with no reports)."""
        horizon = self.version - self.config.step_time_rounds + 1
        return max((ema for ema, seen in self._step_ema.values() if seen >= horizon), default=0.0)

    def sync_time_estimate(self) -> float:
        """``xi_sync``: EMA of reported merge-plus-transfer times (0 with no reports)."""
        return 0.0 if self._sync_ema is None else self._sync_ema

    def reference(self) -> tuple[HandedNorm, ...]:
        """The recent accepted norms the clip measures against, oldest first, each with its
        sender (None: seeded anonymously): what a successor owner needs so that its first rounds
        are not judged against nothing, and count each of their senders once (the replica
        handoff and the owner checkpoint carry it; ``seed_reference`` installs it)."""
        return tuple(self.norms)

    def seed_reference(self, norms: Collection[float | HandedNorm]) -> None:
        """Start the clip's history from ``norms`` (a predecessor's ``reference``, or norms the
        node measured; a bare norm is anonymous), keeping the newest ``norm_history``. Raises
        ``LocalProtocolError`` for a norm that is not finite and >= 0 or a sender that is not a
        key id (the node validates what a peer handed first)."""
        pairs = as_history(norms)
        if not all(math.isfinite(x) and x >= 0 for _, x in pairs):
            raise LocalProtocolError("a seeded reference norm must be finite and >= 0")
        if not all(p is None or (type(p) is bytes and p) for p, _ in pairs):
            raise LocalProtocolError("a seeded reference norm's sender must be a key id or None")
        # a sender's latest norm holds its vote; anonymous ones (None) one each (``latest_per_sender``)
        self.norms = latest_per_sender(list(pairs), self.config.norm_history)

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

    def _contribute(self, ev: ContributionEvent) -> Decision:
        refused = self._refusal(ev, self.version, self._entries)
        if refused is None:
            self._admit(ev, self._entries)
            return self._settle(
                True, f"accepted from {ev.peer.hex()[:8]} for version {self.version}"
            )
        if self.phase is Phase.GRACE and self._deadline is not None and self._deadline <= self._now:
            closing = self._settle(False, "")  # the window elapsed: a refusal still closes it
            return replace(
                closing, reason=f"{refused.reason}; {closing.reason}", refusal=refused.refusal
            )
        return refused

    def _carry(self, ev: ContributionEvent) -> Decision:
        refused = self._refusal(ev, self.version + 1, self._carried)
        if refused is not None:
            return refused
        self._admit(ev, self._carried)
        stale = self.version + 1 - ev.base_version
        return self._decide(
            "accept",
            f"carried into round for version {self.version + 1} "
            f"(staleness {stale}; {len(self._carried)} carried)",
            accepted=True,
            joined=self.version + 1,
        )

    def _tick(self, ev: Tick) -> Decision:
        return self._settle(False, "")

    def _tick_merging(self, ev: Tick) -> Decision:
        return self._decide("wait", f"merge for version {self.version} in progress")

    def _expect(self, ev: Expect) -> Decision:
        self.expected, self.finished, self.learners = ev.n, ev.finished, ev.learners
        n = len(self._entries)
        if ev.n == 0 and self.phase is Phase.COLLECTING and 0 < n < self.config.quorum:
            # nobody left to reach K: drop the rest rather than merge below quorum (a lone
            # contribution merged at the end could be an attacker's) or never become final
            dropped, self._entries, self._first_at = n, [], None
            self._last_until = self._last_from = None
            self._reopen(Phase.COLLECTING, opened_at=self._now)
            return self._decide(
                "wait",
                f"no learner left to reach quorum {self.config.quorum}: "
                f"{dropped} contributions dropped",
            )
        if (
            ev.n == 0 and self.phase is Phase.GRACE
        ):  # it reached its (lowered) quorum: nobody to wait for
            return self._close(f"no learner left: closing with {self._tally()}", False)
        k, note = self._quorum()
        if self.phase is Phase.GRACE and n < k:  # a learner is back: the lowered quorum rises again
            self._reopen(Phase.COLLECTING, opened_at=self._opened_at)
            return self._decide(
                "wait",
                f"expecting {ev.n}: quorum back to {k}{note}, grace window "
                f"closed ({self._tally()})",
            )
        return self._settle(False, f"expecting {ev.n}")

    def _expect_merging(self, ev: Expect) -> Decision:
        self.expected, self.finished, self.learners = ev.n, ev.finished, ev.learners
        return self._decide(
            "wait", f"expecting {ev.n}; merge for version {self.version} in progress"
        )

    def _published(self, ev: Published) -> Decision:
        if ev.new_version != self.version + 1:
            raise LocalProtocolError(
                f"published version {ev.new_version}, expected {self.version + 1}"
            )
        if not (math.isfinite(ev.sync_time) and ev.sync_time >= 0):
            raise LocalProtocolError(f"sync_time must be finite and >= 0, got {ev.sync_time}")
        self._sync_ema = moving_average(self._sync_ema, ev.sync_time, self.config.ema_alpha)
        self.version = ev.new_version
        self._opened(ev.new_version)
        self.norms = latest_per_sender(self.norms + self._closing_norms, self.config.norm_history)
        self._closing_norms = []
        for e in self._entries:  # the round just published
            self._merged_rounds[e.peer] = self._merged_rounds.pop(e.peer, 0) + 1
        while len(self._merged_rounds) > MERGED_SENDERS_KEPT:
            del self._merged_rounds[next(iter(self._merged_rounds))]
        self._entries, self._carried = self._carried, []
        self._reopen(Phase.COLLECTING, opened_at=self._now)
        self._first_at = self._now if self._entries else None
        if any(e.last for e in self._entries):
            self._wait_for_last()
        self._round_share = 0
        horizon = self.version - self.config.step_time_rounds + 1
        self._step_ema = {p: v for p, v in self._step_ema.items() if v[1] >= horizon}
        return self._settle(
            False, f"round for version {self.version} open with carried contributions"
        )

    def _merge_failed(self, ev: MergeFailed) -> Decision:
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
        self._grace_due = self._now + min(self.config.retry_s, self.config.grace_cap_s)
        self._deadline = self._held_deadline(self._grace_due)
        if self._deadline <= self._now:
            return self._close(f"{reason}; retrying now", False)
        return self._decide("wait", f"{reason}; retry in {self._deadline - self._now:.2f} s")

    def _rebase(self, ev: Rebase) -> Decision:
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
        return self._settle(
            False,
            f"rebased from version {old} to {ev.version}; {len(kept)} kept, "
            f"{dropped} dropped as stale beyond {bound}",
        )

    def _hold_rounds(self, ev: Hold) -> Decision:
        self._hold = ev.until if ev.until > self._now else None
        if self.phase is Phase.GRACE and self._grace_due is not None:
            self._deadline = self._held_deadline(self._grace_due)
        if self._hold is None:
            return self._settle(False, "hold released")
        return self._settle(False, f"rounds held for {ev.until - self._now:.2f} s")

    def _held_deadline(self, due: float) -> float:
        """A GRACE deadline ``due``, moved to the end of what holds the round back now."""
        until = self._held_until()
        return due if until is None else max(due, until)

    def _held_until(self) -> float | None:
        """Until when the round may not close now (``merge_quorum.held_until``); None: free."""
        return held_until(
            hold=self._hold,
            last_until=self._last_until,
            all_in=self._all_expected_in(),
            now=self._now,
        )

    def _all_expected_in(self) -> bool:
        """Every expected learner has work in the round: each of ``learners`` when known, else
        as many contributions as expected."""
        if self.expected is None:
            return False
        if self.learners is not None:
            return self.learners <= {e.peer for e in self._entries}
        return len(self._entries) >= self.expected

    def _wait_for_last(self) -> None:
        """A last contribution joined the round: wait ``last_wait_s`` from it for the other
        learners' (learners that stop together finish seconds apart, each within that of the
        one before), at most ``grace_cap_s`` from the round's first."""
        if self._last_from is None:
            self._last_from = self._now
        until = min(self._now + self.config.last_wait_s, self._last_from + self.config.grace_cap_s)
        if self._last_until is None or until > self._last_until:
            self._last_until = until
            if self.phase is Phase.GRACE and self._grace_due is not None:
                self._deadline = self._held_deadline(self._grace_due)

    def _hold_merging(self, ev: Hold) -> Decision:
        self._hold = ev.until if ev.until > self._now else None
        return self._decide("wait", f"merge for version {self.version} in progress")

    def _drop(self, ev: Drop) -> Decision:
        dropped = len(self._entries)
        self._entries, self._first_at, self._round_share = [], None, 0
        self._last_until = self._last_from = None
        self._reopen(Phase.COLLECTING, opened_at=self._now)
        return self._decide("wait", f"{dropped} contributions dropped, not merged: {ev.reason}")

    # -- helpers -----------------------------------------------------------------------------

    def _refusal(self, ev: ContributionEvent, target: int, pool: list[Pending]) -> Decision | None:
        """The refusal for ``ev`` joining the round for version ``target``, or None to accept."""
        problem = refusal_for(
            ev, version=self.version, target=target, pool=pool, config=self.config
        )
        if problem is None:
            return None
        return self._decide("refuse", problem[1], refusal=problem[0])

    def _admit(self, ev: ContributionEvent, pool: list[Pending]) -> None:
        pool.append(
            bounded_pending(ev, config=self.config, published_at=self._published_at, now=self._now)
        )
        if pool is self._entries and self._first_at is None:
            self._first_at = self._now
        if pool is self._entries and ev.last:
            self._wait_for_last()
        old = self._step_ema.get(ev.peer)
        ema = moving_average(None if old is None else old[0], ev.step_time, self.config.ema_alpha)
        self._step_ema[ev.peer] = (ema, self.version)

    def _settle(self, accepted: bool, otherwise: str) -> Decision:
        """After a change while COLLECTING/GRACE: close, open the grace window, or keep going."""
        n, expected = len(self._entries), self.expected
        k, note = self._quorum()
        if self.config.quorum_fraction > 0 and not self.config.quorum_is_expected and expected:
            self._round_share = max(
                self._round_share, quorum_share(self.config, expected + self.finished)
            )
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
        return effective_quorum(self.config, self.expected)

    def _open_grace(self) -> float:
        xi_quorum = self._now - (self._opened_at if self._first_at is None else self._first_at)
        wait = grace_window(
            self.config,
            xi_step=self.step_time_estimate(),
            xi_quorum=xi_quorum,
            xi_sync=self.sync_time_estimate(),
        )
        self.phase, self._quorum_at, self._grace_due = Phase.GRACE, self._now, self._now + wait
        self._deadline = self._held_deadline(self._grace_due)
        return wait

    def _close(self, reason: str, accepted: bool) -> Decision:
        until = self._held_until()
        if until is not None:
            self.phase, self._grace_due, self._deadline = Phase.GRACE, self._now, until
            if self._quorum_at is None:
                self._quorum_at = self._now
            why = (
                "the previous owner's state may still come"
                if self._hold is not None and self._hold >= until
                else "a learner's last contribution is in: waiting for the others'"
            )
            return self._decide(
                "accept" if accepted else "wait",
                f"{reason}; held {until - self._now:.2f} s more ({why})",
                accepted=accepted,
            )
        self.phase, self._deadline, self._grace_due = Phase.MERGING, None, None
        self._last_until = self._last_from = None
        n, share = len(self._entries), self._round_share
        scale = n / share if n < share else 1.0
        if scale < 1.0:
            reason += f"; scaled to {n}/{share} of a step (the round's quorum was {share})"
        entries, self._closing_norms = weigh(
            self._entries, version=self.version, history=self.norms, config=self.config
        )
        return self._decide("merge", reason, accepted=accepted, entries=entries, scale=scale)

    def _opened(self, version: int) -> None:
        """Version ``version`` opened now; keep the opening times the staleness bound can reach."""
        self._published_at[version] = self._now
        floor = version - self.config.staleness_bound - 1
        self._published_at = {v: t for v, t in self._published_at.items() if v >= floor}

    def _reopen(self, phase: Phase, *, opened_at: float) -> None:
        self.phase, self._opened_at = phase, opened_at
        self._quorum_at = self._deadline = self._grace_due = None

    def _tally(self) -> str:
        n = len(self._entries)
        return (
            f"{n}/{self.expected} contributions"
            if self.expected is not None
            else f"{n} contributions"
        )

    def _decide(
        self,
        kind: DecisionKind,
        reason: str,
        *,
        accepted: bool = False,
        refusal: Refusal | None = None,
        entries: tuple[Entry, ...] = (),
        scale: float = 1.0,
        joined: int | None = None,
    ) -> Decision:
        return Decision(
            kind=kind,
            reason=reason,
            version=self.version,
            accepted=accepted,
            refusal=refusal,
            entries=entries,
            scale=scale,
            joined=-1 if not accepted else self.version if joined is None else joined,
        )


_C, _G, _M = Phase.COLLECTING, Phase.GRACE, Phase.MERGING
_TABLE: dict[tuple[Phase, type], Callable[[FragmentMerger, Any], Decision]] = {
    (_C, ContributionEvent): FragmentMerger._contribute,
    (_G, ContributionEvent): FragmentMerger._contribute,
    (_M, ContributionEvent): FragmentMerger._carry,
    (_C, Tick): FragmentMerger._tick,
    (_G, Tick): FragmentMerger._tick,
    (_M, Tick): FragmentMerger._tick_merging,
    (_C, Expect): FragmentMerger._expect,
    (_G, Expect): FragmentMerger._expect,
    (_M, Expect): FragmentMerger._expect_merging,
    (_M, Published): FragmentMerger._published,
    (_M, MergeFailed): FragmentMerger._merge_failed,
    (_C, Rebase): FragmentMerger._rebase,
    (_G, Rebase): FragmentMerger._rebase,
    (_C, Hold): FragmentMerger._hold_rounds,
    (_G, Hold): FragmentMerger._hold_rounds,
    (_M, Hold): FragmentMerger._hold_merging,
    (_C, Drop): FragmentMerger._drop,
    (_G, Drop): FragmentMerger._drop,
}
