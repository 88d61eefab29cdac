"""The owner's merge round: tables of (events, times) -> (decisions, reasons), and properties."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig, Phase
from protocol.diloco.outer import OuterConfig, merge_update
from protocol.errors import LocalProtocolError

A, B, C, D = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3, 0xD4))
# gamma 0.5 keeps window arithmetic exact in binary floating point
EXACT: dict[str, Any] = {"gamma": 0.5}

Event = tuple[Any, ...]


def c(now: float, peer: bytes, base: int = 0, **kw: Any) -> Event:
    return ("c", now, peer, base, kw)


def apply(m: FragmentMerger, event: Event) -> Decision:
    op, now, *args = event
    if op == "c":
        peer, base, kw = args
        fields = {"tokens": 100, "steps": 10, "step_time": 1.0, "payload": peer} | kw
        return m.on_contribution(peer, base_version=base, now=now, **fields)
    if op == "t":
        return m.on_tick(now)
    if op == "e":
        return m.set_expected(args[0], now=now)
    if op == "p":
        return m.on_published(args[0], sync_time=args[1], now=now)
    assert op == "f"
    return m.on_merge_failed(args[0], now=now, discard=args[1])


SCENARIOS: dict[str, tuple[dict[str, Any], int, list[tuple[Event, tuple[str, ...]]]]] = {
    "quorum, grace window, elapsed": (
        EXACT,
        0,
        [
            # xi_quorum is 0 with K = 1: the window is gamma * tau * xi_step = 0.5 * 2 * 1.0
            (c(0.5, A), ("accept", "quorum 1/1 reached; grace window 1.00 s")),
            (("t", 1.0), ("wait", "grace window open (1 contributions; 0.50 s left)")),
            (
                c(1.25, B, step_time=2.0),
                ("accept", "accepted from b2b2b2b2 for version 0 (2 contributions; 0.25 s left)"),
            ),
            (("t", 1.5), ("merge", "grace window elapsed with 2 contributions")),
            (("t", 1.55), ("wait", "merge for version 0 in progress")),
            (("e", 1.55, 4), ("wait", "expecting 4; merge for version 0 in progress")),
            (
                ("p", 1.75, 1, 0.25),
                (
                    "wait",
                    "round for version 1 open with carried contributions (0/4 contributions; quorum 1)",
                ),
            ),
            (("t", 1.85), ("wait", "waiting for quorum (0/4 contributions; quorum 1)")),
        ],
    ),
    "all expected in during grace": (
        EXACT,
        0,
        [
            (("e", 0.0, 3), ("wait", "expecting 3 (0/3 contributions; quorum 1)")),
            (c(1.0, A), ("accept", "quorum 1/1 reached; grace window 1.00 s")),
            (
                c(1.5, B),
                ("accept", "accepted from b2b2b2b2 for version 0 (2/3 contributions; 0.50 s left)"),
            ),
            (c(1.75, C), ("merge", "all 3/3 expected contributions in")),
        ],
    ),
    "expected already in at quorum": (
        {"quorum": 2} | EXACT,
        0,
        [
            (("e", 0.0, 2), ("wait", "expecting 2 (0/2 contributions; quorum 2)")),
            (
                c(0.1, A),
                ("accept", "accepted from a1a1a1a1 for version 0 (1/2 contributions; quorum 2)"),
            ),
            (c(0.2, B), ("merge", "all 2/2 expected contributions in")),
        ],
    ),
    # fewer learners expected than K: the quorum is lowered to them, never below 1, and such a
    # round always waits out its grace window (the owner's view of membership lags)
    "expected below quorum lowers it, through the grace window": (
        {"quorum": 2} | EXACT,
        0,
        [
            (
                ("e", 0.0, 1),
                (
                    "wait",
                    "expecting 1 (0/1 contributions; quorum 1 (K = 2 lowered to the 1 learners expected))",
                ),
            ),
            (
                c(0.5, A),
                (
                    "accept",
                    "quorum 1/1 (K = 2 lowered to the 1 learners expected) reached; grace window 1.00 s",
                ),
            ),
            (
                c(0.75, B),
                ("accept", "accepted from b2b2b2b2 for version 0 (2/1 contributions; 0.75 s left)"),
            ),
            (("t", 1.5), ("merge", "grace window elapsed with 2/1 contributions")),
        ],
    ),
    "a learner that leaves lowers K after it stalled the round": (
        {"quorum": 3} | EXACT,
        0,
        [
            (("e", 0.0, 3), ("wait", "expecting 3 (0/3 contributions; quorum 3)")),
            (
                c(0.5, A),
                ("accept", "accepted from a1a1a1a1 for version 0 (1/3 contributions; quorum 3)"),
            ),
            (
                c(0.75, B),
                ("accept", "accepted from b2b2b2b2 for version 0 (2/3 contributions; quorum 3)"),
            ),
            (("t", 0.9), ("wait", "waiting for quorum (2/3 contributions; quorum 3)")),
            # C's record lapsed: xi_quorum is 0.5 s since A, the window 0.5 * (2 * 1.0 - 0.5)
            (
                ("e", 1.0, 2),
                (
                    "wait",
                    "quorum 2/2 (K = 3 lowered to the 2 learners expected) reached; grace window 0.75 s",
                ),
            ),
            (("t", 1.5), ("wait", "grace window open (2/2 contributions; 0.25 s left)")),
            (("t", 1.75), ("merge", "grace window elapsed with 2/2 contributions")),
        ],
    ),
    "a learner back raises the lowered quorum again": (
        {"quorum": 3} | EXACT,
        0,
        [
            (
                ("e", 0.0, 2),
                (
                    "wait",
                    "expecting 2 (0/2 contributions; quorum 2 (K = 3 lowered to the 2 learners expected))",
                ),
            ),
            (
                c(0.5, A),
                (
                    "accept",
                    "accepted from a1a1a1a1 for version 0 (1/2 contributions; quorum 2 (K = 3 lowered to the 2 learners expected))",
                ),
            ),
            (
                c(0.75, B),
                (
                    "accept",
                    "quorum 2/2 (K = 3 lowered to the 2 learners expected) reached; grace window 0.88 s",
                ),
            ),
            (
                ("e", 1.0, 3),
                ("wait", "expecting 3: quorum back to 3, grace window closed (2/3 contributions)"),
            ),
            (("t", 2.0), ("wait", "waiting for quorum (2/3 contributions; quorum 3)")),
            (c(2.5, C), ("merge", "all 3/3 expected contributions in")),
        ],
    ),
    "no learner left while a lowered round is in its window: it closes": (
        {"quorum": 3} | EXACT,
        0,
        [
            (
                ("e", 0.0, 1),
                (
                    "wait",
                    "expecting 1 (0/1 contributions; quorum 1 (K = 3 lowered to the 1 learners expected))",
                ),
            ),
            (
                c(0.5, A),
                (
                    "accept",
                    "quorum 1/1 (K = 3 lowered to the 1 learners expected) reached; grace window 1.00 s",
                ),
            ),
            (("e", 1.0, 0), ("merge", "no learner left: closing with 1/0 contributions")),
        ],
    ),
    # nobody left to reach K: the rest is dropped, never merged below quorum, never stuck
    "no learner left drops a round below quorum": (
        {"quorum": 2} | EXACT,
        0,
        [
            (
                c(0.5, A),
                ("accept", "accepted from a1a1a1a1 for version 0 (1 contributions; quorum 2)"),
            ),
            (("e", 0.6, 0), ("wait", "no learner left to reach quorum 2: 1 contributions dropped")),
            (
                c(0.7, B),
                ("accept", "accepted from b2b2b2b2 for version 0 (1/0 contributions; quorum 2)"),
            ),
        ],
    ),
    "set_expected closes the grace window": (
        EXACT,
        0,
        [
            (c(0.5, A), ("accept", "quorum 1/1 reached; grace window 1.00 s")),
            (
                c(1.0, B),
                ("accept", "accepted from b2b2b2b2 for version 0 (2 contributions; 0.50 s left)"),
            ),
            (("e", 1.25, 2), ("merge", "all 2/2 expected contributions in")),
        ],
    ),
    "window of zero closes at once": (
        EXACT,
        0,
        [
            (
                c(5.0, A, step_time=0.0),
                ("merge", "quorum 1/1 reached; grace window 0.00 s; closing with 1 contributions"),
            ),
            (c(5.1, B), ("refuse", "merge for version 0 closed; resync", "closed")),
        ],
    ),
    "window capped": (
        {"grace_cap_s": 10.0} | EXACT,
        0,
        [
            (c(0.5, A, step_time=100.0), ("accept", "quorum 1/1 reached; grace window 10.00 s")),
            (("t", 10.25), ("wait", "grace window open (1 contributions; 0.25 s left)")),
            (("t", 10.5), ("merge", "grace window elapsed with 1 contributions")),
        ],
    ),
    "refusals under drop": (
        {"quorum": 3},
        5,
        [
            (
                c(0.1, A, 5, steps=0),
                ("refuse", "steps must be >= 1 and tokens >= 0, got 0 and 100", "invalid"),
            ),
            (
                c(0.1, A, 5, tokens=-1),
                ("refuse", "steps must be >= 1 and tokens >= 0, got 10 and -1", "invalid"),
            ),
            (
                c(0.1, A, 5, step_time=math.nan),
                ("refuse", "step_time must be finite and >= 0, got nan", "invalid"),
            ),
            (
                c(0.1, A, 5, step_time=-1.0),
                ("refuse", "step_time must be finite and >= 0, got -1.0", "invalid"),
            ),
            (
                c(0.1, A, 5, step_time=math.inf),
                ("refuse", "step_time must be finite and >= 0, got inf", "invalid"),
            ),
            (c(0.1, A, 6), ("refuse", "base version 6 is ahead of version 5", "future")),
            (c(0.1, A, 2), ("refuse", "stale by 3 versions (bound 2); resync", "stale")),
            (c(0.1, A, 4), ("refuse", "merge for version 4 closed; resync", "closed")),
            (
                c(0.2, A, 5),
                ("accept", "accepted from a1a1a1a1 for version 5 (1 contributions; quorum 3)"),
            ),
            (
                c(0.3, A, 5),
                ("refuse", "duplicate contribution from a1a1a1a1 for version 5", "duplicate"),
            ),
        ],
    ),
    "carry late and stale contributions": (
        {"late_policy": "carry"} | EXACT,
        5,
        [
            (c(0.5, A, 4), ("accept", "quorum 1/1 reached; grace window 1.00 s")),
            (
                c(1.0, B, 5),
                ("accept", "accepted from b2b2b2b2 for version 5 (2 contributions; 0.50 s left)"),
            ),
            (c(1.25, C, 2), ("refuse", "stale by 3 versions (bound 2); resync", "stale")),
            (("t", 1.5), ("merge", "grace window elapsed with 2 contributions")),
            (
                c(1.55, C, 5),
                ("accept", "carried into round for version 6 (staleness 1; 1 carried)"),
            ),
            (
                c(1.55, C, 5),
                ("refuse", "duplicate contribution from c3c3c3c3 for version 6", "duplicate"),
            ),
            (c(1.55, D, 3), ("refuse", "stale by 3 versions (bound 2); resync", "stale")),
            (c(1.55, D, 6), ("refuse", "base version 6 is ahead of version 5", "future")),
            (c(1.6, D, 4), ("accept", "carried into round for version 6 (staleness 2; 2 carried)")),
            # carried contributions count as arriving when the round opens: xi_quorum 0, xi_sync 0.5
            (("p", 1.75, 6, 0.5), ("wait", "quorum 2/1 reached; grace window 0.75 s")),
            (("t", 2.5), ("merge", "grace window elapsed with 2 contributions")),
        ],
    ),
    "merge failure, retry, discard": (
        {"quorum": 2} | EXACT,
        0,
        [
            # xi_quorum: 0.5 s from the first contribution to the second
            (
                c(0.25, A),
                ("accept", "accepted from a1a1a1a1 for version 0 (1 contributions; quorum 2)"),
            ),
            (c(0.75, B), ("accept", "quorum 2/2 reached; grace window 0.75 s")),
            (("t", 1.5), ("merge", "grace window elapsed with 2 contributions")),
            (
                ("f", 2.0, "replica down", ()),
                (
                    "wait",
                    "merge for version 0 failed (replica down); 0 discarded, 2 contributions kept; retry in 1.00 s",
                ),
            ),
            (("t", 2.5), ("wait", "grace window open (2 contributions; 0.50 s left)")),
            (("t", 3.0), ("merge", "grace window elapsed with 2 contributions")),
            (
                ("f", 3.5, "bad shape", (A,)),
                (
                    "wait",
                    "merge for version 0 failed (bad shape); 1 discarded, 1 contributions kept; waiting for quorum 2",
                ),
            ),
            (
                c(3.75, A),
                ("merge", "quorum 2/2 reached; grace window 0.00 s; closing with 2 contributions"),
            ),
            (
                ("p", 4.0, 1, 0.0),
                (
                    "wait",
                    "round for version 1 open with carried contributions (0 contributions; quorum 2)",
                ),
            ),
        ],
    ),
    "immediate retry": (
        {"retry_s": 0.0} | EXACT,
        0,
        [
            (
                c(5.0, A, step_time=0.0),
                ("merge", "quorum 1/1 reached; grace window 0.00 s; closing with 1 contributions"),
            ),
            (
                ("f", 5.5, "oops", ()),
                (
                    "merge",
                    "merge for version 0 failed (oops); 0 discarded, 1 contributions kept; retrying now",
                ),
            ),
        ],
    ),
    "events after the deadline close the window": (
        EXACT,
        0,
        [
            (c(0.5, A), ("accept", "quorum 1/1 reached; grace window 1.00 s")),
            (
                c(2.0, A),
                (
                    "merge",
                    "duplicate contribution from a1a1a1a1 for version 0; grace window elapsed with 1 contributions",
                    "duplicate",
                ),
            ),
        ],
    ),
    "late accepted contribution joins the closing merge": (
        EXACT,
        0,
        [
            (c(0.5, A), ("accept", "quorum 1/1 reached; grace window 1.00 s")),
            (c(2.0, B), ("merge", "grace window elapsed with 2 contributions")),
        ],
    ),
    "set_expected after the deadline closes": (
        EXACT,
        0,
        [
            (c(0.5, A), ("accept", "quorum 1/1 reached; grace window 1.00 s")),
            (("e", 2.0, 5), ("merge", "grace window elapsed with 1/5 contributions")),
        ],
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name: str) -> None:
    cfg, version, steps = SCENARIOS[name]
    m = FragmentMerger(3, MergeConfig(**cfg), version=version, now=0.0)
    for event, want in steps:
        got = apply(m, event)
        assert (got.kind, got.reason) == want[:2], event
        assert got.refusal == (want[2] if len(want) > 2 else None), event
        assert got.accepted == (event[0] == "c" and got.refusal is None), event
        if got.kind == "merge":
            assert m.phase is Phase.MERGING and m.deadline() is None


def test_a_quorum_fraction_waits_for_that_share_of_the_learners_expected() -> None:
    m = FragmentMerger(0, MergeConfig(quorum=1, quorum_fraction=0.5, **EXACT), now=0.0)
    assert m.quorum == 1  # learners not known yet: K alone
    m.set_expected(5, now=0.0)
    assert m.quorum == 3  # half of 5, rounded up
    for t, peer in ((0.0, A), (0.1, B)):
        assert apply(m, c(t, peer)).kind == "accept" and m.phase is Phase.COLLECTING
    d = apply(m, c(0.2, C))
    assert m.phase is Phase.GRACE and "0.5 of the 5 learners" in d.reason
    m.set_expected(2, now=0.3)  # 3 in from the 2 learners left: all expected are in, it merges
    assert m.quorum == 1 and m.phase is Phase.MERGING
    m = FragmentMerger(0, MergeConfig(quorum=4, quorum_fraction=0.5), now=0.0)
    m.set_expected(5, now=0.0)
    assert m.quorum == 4  # never below K


def test_a_round_left_below_its_share_of_the_learners_merges_a_scaled_step() -> None:
    """32 learners at a half make K = 16; full rounds merge a whole step. When the swarm stops,
    K follows the learners out and the round in flight closes on what it holds: 2 of its 16
    make 2/16 of a step (the missing 14 count as zero), not a whole step of two learners' work.
    A round that opens after the swarm shrank has the smaller quorum and merges whole."""
    m = FragmentMerger(0, MergeConfig(quorum=1, quorum_fraction=0.5, **EXACT), now=0.0)
    m.set_expected(32, now=0.0)
    peers = [bytes([i]) * 32 for i in range(16)]
    for i, peer in enumerate(peers):
        d = apply(m, c(0.01 * i, peer))
    d = m.on_tick(10.0)
    assert d.kind == "merge" and len(d.entries) == 16 and d.scale == 1.0
    m.on_published(1, sync_time=0.0, now=10.0)
    apply(m, c(10.1, peers[0], 1))
    apply(m, c(10.2, peers[1], 1))
    for n, t in ((20, 10.3), (4, 10.4), (0, 10.5)):  # learners stop
        d = m.set_expected(n, now=t)
    d = m.on_tick(20.0) if d.kind != "merge" else d
    assert d.kind == "merge" and len(d.entries) == 2 and d.scale == 2 / 16
    assert "scaled to 2/16 of a step" in d.reason
    m.on_published(2, sync_time=0.0, now=20.0)
    m.set_expected(4, now=20.0)  # a swarm of 4 from the start of the round: K = 2, a whole step
    apply(m, c(20.1, peers[0], 2))
    apply(m, c(20.2, peers[1], 2))
    d = m.on_tick(30.0)
    assert d.kind == "merge" and len(d.entries) == 2 and d.scale == 1.0
    m = FragmentMerger(0, MergeConfig(quorum=2, **EXACT), now=0.0)  # no fraction: never scaled
    m.set_expected(8, now=0.0)
    apply(m, c(0.1, A))
    apply(m, c(0.2, B))
    d = m.set_expected(0, now=0.3)  # nobody left: the round in its grace window closes at once
    assert d.kind == "merge" and d.scale == 1.0


def test_learners_that_finished_count_as_zero_in_every_later_round() -> None:
    """Four learners, every one waited for (fraction 1). Three finish; the straggler's rounds
    close as soon as its contribution is in (nobody else is waited for) but merge 1/4 of a step:
    the finished three count as contributing nothing, round after round. Without ``finished``
    each of its rounds would be a whole step of its work alone."""
    m = FragmentMerger(0, MergeConfig(quorum=1, quorum_fraction=1.0, **EXACT), now=0.0)
    m.set_expected(4, now=0.0)
    peers = [bytes([i]) * 32 for i in range(4)]
    for i, peer in enumerate(peers):
        d = apply(m, c(0.1 * (i + 1), peer))
    assert d.kind == "merge" and len(d.entries) == 4 and d.scale == 1.0
    m.on_published(1, sync_time=0.0, now=1.0)
    m.set_expected(1, now=1.0, finished=3)
    for v in (1, 2, 3):
        d = apply(m, c(float(v) + 0.5, peers[0], v))
        assert d.kind == "merge" and len(d.entries) == 1 and d.scale == 0.25, d
        assert "scaled to 1/4 of a step" in d.reason
        m.on_published(v + 1, sync_time=0.0, now=float(v) + 0.6)
    m.set_expected(2, now=5.0, finished=2)  # one of them trains again: 2 of 4 contributions
    apply(m, c(5.1, peers[0], 4))
    d = apply(m, c(5.2, peers[1], 4))
    assert d.kind == "merge" and d.scale == 0.5
    m.set_expected(
        1, now=5.25
    )  # not told of the finished (while merging): the next round merges whole
    m.on_published(5, sync_time=0.0, now=5.3)
    d = apply(m, c(6.1, peers[0], 5))
    assert d.kind == "merge" and d.scale == 1.0
    with pytest.raises(LocalProtocolError, match="finished learners must be >= 0, got -1"):
        m.set_expected(1, now=7.0, finished=-1)


def test_every_learner_waited_for_a_killed_one_is_waited_for_until_the_members_drop_it() -> None:
    """Fraction 1 (the default under outer momentum): a learner killed mid-round holds the round
    open however long it takes (no deadline: a slow or dead learner sets the pace of versions,
    the islands never wait on it). Once the members drop it, the round merges the three it holds
    as 3/4 of a step (under momentum a plain step, ``merge_update``), and the rounds after it,
    opened with three learners, merge whole steps."""
    m = FragmentMerger(0, MergeConfig(quorum=1, quorum_fraction=1.0, **EXACT), now=0.0)
    m.set_expected(4, now=0.0)
    peers = [bytes([i]) * 32 for i in range(4)]
    for i, peer in enumerate(peers[:3]):
        apply(m, c(0.1 * (i + 1), peer))
    assert m.phase is Phase.COLLECTING and m.deadline() is None and m.quorum == 4
    assert m.on_tick(1000.0).kind == "wait"
    d = m.set_expected(3, now=1000.5)  # its member record lapsed
    assert d.kind == "merge" and len(d.entries) == 3 and d.scale == 0.75, d
    m.on_published(1, sync_time=0.0, now=1001.0)
    for i, peer in enumerate(peers[:3]):
        d = apply(m, c(1001.1 + 0.1 * i, peer, 1))
    assert d.kind == "merge" and len(d.entries) == 3 and d.scale == 1.0, d


def test_merge_entries_carry_weights_and_staleness() -> None:
    m = FragmentMerger(0, MergeConfig(late_policy="carry", **EXACT), version=5, now=0.0)
    apply(m, c(0.5, A, 4, tokens=100, steps=10))  # 1000 * 0.5
    apply(m, c(0.6, B, 5, tokens=100, steps=10))  # 1000
    d = m.on_tick(2.0)
    # one of two senders weighs at most as much as the other (``others_multiple``): B capped to A's
    assert [(e.peer, e.weight, e.staleness, e.payload) for e in d.entries] == [
        (A, 500.0, 1, A),
        (B, 500.0, 0, B),
    ]
    assert [e.weight_capped for e in d.entries] == [False, True]
    assert d.version == 5
    apply(m, c(2.1, C, 5, tokens=40, steps=4))  # carried: 400 * 0.5
    d = m.on_published(6, sync_time=0.0, now=2.2)
    assert m.version == 6 and m.count == 1
    d = m.on_tick(10.0)
    assert [(e.peer, e.weight, e.staleness) for e in d.entries] == [(C, 200.0, 1)]
    assert d.version == 6
    assert [e.norm for e in d.entries] == [None]  # none reported, none carried


def test_an_accepted_contribution_names_the_round_it_joined() -> None:
    """``Decision.joined``: the round an accepted contribution waits in, by the version it merges
    on; one carried while the owner merges joins the next round, so its sender's next
    contribution, on the version that merge makes, would be a duplicate there."""
    m = FragmentMerger(0, MergeConfig(late_policy="carry", quorum=2, **EXACT), version=5, now=0.0)
    m.set_expected(2, now=0.0)
    d = apply(m, c(0.5, A, 4))  # stale by one: it joins the round on version 5
    assert (d.kind, d.accepted, d.joined) == ("accept", True, 5)
    d = apply(m, c(0.6, B, 5))  # the last one expected: it closes the round it joined
    assert (d.kind, d.accepted, d.joined) == ("merge", True, 5)
    d = apply(m, c(0.7, A, 5))  # while the round on version 5 merges: carried
    assert d.reason.startswith("carried") and d.joined == 6
    d = apply(m, c(0.8, A, 5))
    assert (d.kind, d.refusal, d.joined) == ("refuse", "duplicate", -1)
    m.on_published(6, sync_time=0.0, now=0.9)
    d = apply(m, c(1.0, A, 6))  # the sender's next work, on version 6: where its carried one waits
    assert (d.refusal, d.joined) == ("duplicate", -1)
    d = apply(m, c(1.1, B, 6))
    assert d.accepted and d.joined == 6


def test_weights_clamped_by_tokens_per_step_and_median() -> None:
    cfg = MergeConfig(quorum=4, max_tokens_per_step=20)
    m = FragmentMerger(0, cfg, now=0.0)
    m.set_expected(4, now=0.0)
    for peer, tokens in [(A, 10), (B, 10), (C, 10)]:
        apply(m, c(0.1, peer, tokens=tokens, steps=1))
    d = apply(m, c(0.1, D, tokens=1000, steps=1))  # clamped to 20 tokens -> 400
    # then at 3 (= 4 senders - 1) x the others' median: one sender holds at most half
    assert d.kind == "merge" and [e.weight for e in d.entries] == [100.0] * 3 + [300.0]
    m = FragmentMerger(0, MergeConfig(quorum=3), now=0.0)
    m.set_expected(3, now=0.0)
    for peer, tokens in [(A, 10), (B, 10)]:
        apply(m, c(0.1, peer, tokens=tokens, steps=1))
    d = apply(
        m, c(0.1, C, tokens=1000, steps=1)
    )  # 1e6 capped at 4 x median 100, then at 2 x the others'
    assert [e.weight for e in d.entries] == [100.0, 100.0, 200.0]


def test_zero_token_reports_fall_back_to_discounts() -> None:
    m = FragmentMerger(0, MergeConfig(quorum=2, late_policy="carry"), version=1, now=0.0)
    m.set_expected(2, now=0.0)
    apply(m, c(0.1, A, 1, tokens=0))
    d = apply(m, c(0.1, B, 0, tokens=0))
    assert [e.weight for e in d.entries] == [1.0, 0.5]


def test_step_and_sync_estimates() -> None:
    cfg = MergeConfig(ema_alpha=0.5, step_time_rounds=2)
    m = FragmentMerger(0, cfg, now=0.0)
    assert m.step_time_estimate() == 0.0 and m.sync_time_estimate() == 0.0
    apply(m, c(10.0, A, 0, step_time=2.0))
    m.on_tick(20.0)  # the window (0.8 * 2 * 2.0 s) has elapsed
    m.on_published(1, sync_time=1.0, now=20.0)
    apply(m, c(20.0, A, 1, step_time=4.0))
    assert m.step_time_estimate() == 3.0  # 0.5 * 4 + 0.5 * 2
    m.on_tick(30.0)
    m.on_published(2, sync_time=0.0, now=30.0)
    assert m.sync_time_estimate() == 0.5
    apply(m, c(30.0, B, 2, step_time=1.0))
    assert m.step_time_estimate() == 3.0  # A seen at version 1, still within 2 rounds
    m.on_tick(40.0)
    m.on_published(3, sync_time=0.0, now=40.0)
    apply(m, c(40.0, B, 3, step_time=1.0))
    assert m.step_time_estimate() == 1.0  # A forgotten
    m.on_tick(50.0)
    m.on_published(4, sync_time=0.0, now=50.0)


def test_grace_window_uses_sync_time_and_default_gamma() -> None:
    m = FragmentMerger(0, MergeConfig(), version=0, now=0.0)
    apply(m, c(0.0, A, step_time=0.5))
    m.on_tick(100.0)
    m.on_published(1, sync_time=0.25, now=100.0)
    d = apply(m, c(100.5, A, 1, step_time=2.0))  # EMA 0.3*2 + 0.7*0.5 = 0.95
    wait = 0.8 * (2 * 0.95 - 0.0 - 0.25)  # xi_quorum 0: quorum K = 1 reached on arrival
    assert d.reason == f"quorum 1/1 reached; grace window {wait:.2f} s"
    assert m.quorum_time == 100.5 and m.deadline() == pytest.approx(100.5 + wait)


# ---------------------------------------------------------------- misuse raises


def test_events_outside_the_table_raise() -> None:
    m = FragmentMerger(0, MergeConfig(**EXACT), now=0.0)
    with pytest.raises(LocalProtocolError, match="Published not allowed while collecting"):
        m.on_published(1, sync_time=0.0, now=0.0)
    with pytest.raises(LocalProtocolError, match="MergeFailed not allowed while collecting"):
        m.on_merge_failed("x", now=0.0)
    apply(m, c(0.5, A))
    assert m.phase is Phase.GRACE
    with pytest.raises(LocalProtocolError, match="not allowed while grace"):
        m.on_published(1, sync_time=0.0, now=0.5)


def test_publish_and_clock_misuse_raise() -> None:
    m = FragmentMerger(0, MergeConfig(), now=10.0)
    with pytest.raises(LocalProtocolError, match="backwards"):
        m.on_tick(9.0)
    with pytest.raises(LocalProtocolError, match="NaN"):
        m.on_tick(math.nan)
    with pytest.raises(LocalProtocolError, match=">= 0"):
        m.set_expected(-1, now=10.0)
    apply(m, c(20.0, A, step_time=0.0))
    assert m.phase is Phase.MERGING
    with pytest.raises(LocalProtocolError, match="expected 1"):
        m.on_published(2, sync_time=0.0, now=20.0)
    with pytest.raises(LocalProtocolError, match="sync_time"):
        m.on_published(1, sync_time=math.nan, now=20.0)
    assert m.on_published(1, sync_time=0.0, now=20.0).kind == "wait"
    with pytest.raises(LocalProtocolError, match="bad merger start"):
        FragmentMerger(-1, MergeConfig(), now=0.0)
    with pytest.raises(LocalProtocolError, match="bad merger start"):
        FragmentMerger(0, MergeConfig(), now=math.inf)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quorum": 0},
        {"quorum_fraction": -0.1},
        {"quorum_fraction": 1.5},
        {"gamma": 1.5},
        {"tau": -1.0},
        {"grace_cap_s": math.inf},
        {"staleness_bound": -1},
        {"stale_discount": 0.0},
        {"late_policy": "keep"},
        {"max_tokens_per_step": 0},
        {"max_weight_median_multiple": 0.5},
        {"ema_alpha": 0.0},
        {"step_time_rounds": 0},
        {"retry_s": -1.0},
        {"last_wait_s": math.inf},
    ],
)
def test_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError, match="MergeConfig"):
        MergeConfig(**kwargs)


# ---------------------------------------------------------------- properties over random orders

PEERS = [bytes([i]) * 32 for i in range(1, 6)]

op_contribution = st.tuples(
    st.just("c"),
    st.integers(0, 4),
    st.sampled_from([0, 0, 0, 0, -1, -2, -3, 1]),
    st.integers(-1, 400),
    st.integers(0, 12),
    st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, math.nan]),
    st.floats(0, 2),
    st.sampled_from([False, False, False, True]),
)
op_tick = st.tuples(st.just("t"), st.booleans(), st.floats(0, 3))
op_expect = st.tuples(st.just("e"), st.one_of(st.none(), st.integers(0, 6)), st.floats(0, 1))
op_named = st.tuples(st.just("n"), st.sets(st.integers(0, 4)), st.floats(0, 1))
op_finish = st.tuples(
    st.just("p"), st.booleans(), st.floats(0, 1), st.sets(st.integers(0, 4), max_size=2)
)
op_hold = st.tuples(st.just("h"), st.booleans(), st.floats(0, 5))
op_drop = st.tuples(st.just("d"))
configs = st.builds(
    MergeConfig,
    quorum=st.integers(1, 3),
    quorum_fraction=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    gamma=st.sampled_from([0.5, 0.8, 1.0]),
    grace_cap_s=st.sampled_from([0.0, 1.0, 30.0]),
    staleness_bound=st.integers(0, 2),
    late_policy=st.sampled_from(["carry", "drop"]),
    max_tokens_per_step=st.sampled_from([None, 20]),
    retry_s=st.sampled_from([0.0, 0.5]),
)


@settings(max_examples=150, deadline=None)
@example(  # a round that reached a quorum lowered to its 1 learner, which then left: it closes with 1
    MergeConfig(quorum=2, gamma=0.5, grace_cap_s=0.0, staleness_bound=0),
    [
        ("n", {0}, 0.0),
        ("h", False, 3.0),
        ("c", 0, 0, 0, 0, 0.0, 2.0, False),
        ("c", 0, 0, 0, 1, 0.0, 0.0, False),
        ("n", set(), 0.0),
        ("c", 0, 0, 0, 0, 0.0, 1.0, False),
    ],
)
@given(
    configs,
    st.lists(
        st.one_of(
            op_contribution, op_tick, op_expect, op_named, op_finish, op_finish, op_hold, op_drop
        ),
        min_size=15,
        max_size=60,
    ),
)
def test_invariants_over_random_event_orders(cfg: MergeConfig, ops: list[tuple[Any, ...]]) -> None:
    now = 0.0
    m = FragmentMerger(0, cfg, now=now)
    published: set[int] = set()
    hold: float | None = None  # no merge before it, unless released
    last_at = -math.inf  # when a last contribution came (the round may wait up to the cap after)
    lowest = m.quorum  # the lowest quorum of the round so far
    for op in ops:
        lowest = min(lowest, m.quorum)
        # once no learner is left (expected 0), the quorum reads as K again, but the round closes
        # on what it holds: held to the lowest quorum it had, not to K
        quorum_before = lowest if m.expected == 0 else m.quorum
        if hold is not None and now >= hold:
            hold = None
        if op[0] == "h":
            _, release, duration = op
            hold = None if release or duration == 0 else now + duration
            d = m.hold_until(now if hold is None else hold, now=now)
        elif op[0] == "d":
            if m.phase is Phase.MERGING:
                continue
            d = m.drop_round("test", now=now)
            assert d.kind == "wait" and m.count == 0 and m.phase is Phase.COLLECTING
        elif op[0] == "c":
            _, who, offset, tokens, steps, step_time, dt, last = op
            now += dt
            d = m.on_contribution(
                PEERS[who],
                base_version=max(0, m.version + offset),
                tokens=tokens,
                steps=steps,
                step_time=step_time,
                payload=who,
                now=now,
                last=last,
            )
            if last:
                last_at = now
        elif op[0] == "t":
            _, at_deadline, dt = op
            deadline = m.deadline()
            now = max(now, deadline) if at_deadline and deadline is not None else now + dt
            in_grace = m.phase is Phase.GRACE
            d = m.on_tick(now)
            if in_grace and deadline is not None and now >= deadline:
                assert d.kind == "merge", d  # never waits past its deadline
        elif op[0] == "e":
            now += op[2]
            d = m.set_expected(op[1], now=now)
        elif op[0] == "n":
            now += op[2]
            d = m.set_expected(len(op[1]), now=now, learners=frozenset(PEERS[i] for i in op[1]))
        else:
            if m.phase is not Phase.MERGING:
                continue
            _, succeed, dt, discard = op
            now += dt
            if succeed:
                published.add(m.version)
                d = m.on_published(m.version + 1, sync_time=dt, now=now)
            else:
                d = m.on_merge_failed("test", now=now, discard=[PEERS[i] for i in discard])
        check_decision(m, cfg, d, published, now, quorum_before, hold, last_at)
        if d.kind == "merge" or op[0] == "d":
            lowest = m.quorum  # the next round starts


def check_decision(
    m: FragmentMerger,
    cfg: MergeConfig,
    d: Decision,
    published: set[int],
    now: float,
    quorum_before: int,
    hold: float | None = None,
    last_at: float = -math.inf,
) -> None:
    assert any(ch.isdigit() for ch in d.reason), d.reason  # reasons carry counts
    assert (d.kind == "refuse") == (d.refusal is not None and not d.entries) or d.kind == "merge"
    if d.kind == "merge":
        assert hold is None or now >= hold, (hold, now)  # a held owner merges nothing before
        assert m.phase is Phase.MERGING
        # never below the effective quorum: K, or the learners expected when fewer (at least 1),
        # as it stood before the event or after it (a lowered round closes when nobody is left)
        assert len(d.entries) >= max(1, min(quorum_before, m.quorum, cfg.quorum))
        assert len(d.entries) >= min(quorum_before, m.quorum)  # a share of the learners included
        if m.expected is not None and m.expected >= cfg.quorum:
            assert len(d.entries) >= cfg.quorum
        assert d.version == m.version and d.version not in published  # no version merged twice
        peers = [e.peer for e in d.entries]
        assert len(set(peers)) == len(peers)
        assert 0 < d.scale <= 1.0 and (
            d.scale == 1.0 or cfg.quorum_fraction > 0
        )  # only a share is scaled
        assert all(0 <= e.staleness <= cfg.staleness_bound for e in d.entries)
        if cfg.late_policy == "drop":
            assert all(e.staleness == 0 for e in d.entries)
        weights = [e.weight for e in d.entries]
        assert sum(weights) > 0
        positive = [w for w in weights if w > 0]
        assert max(weights) <= cfg.max_weight_median_multiple * statistics.median(positive) * (
            1 + 1e-12
        )
    if m.phase is Phase.GRACE:
        deadline, t_q = m.deadline(), m.quorum_time
        assert deadline is not None and t_q is not None
        assert (
            now
            < deadline
            <= max(
                t_q + cfg.grace_cap_s,
                -math.inf if hold is None else hold,
                last_at + min(cfg.last_wait_s, cfg.grace_cap_s),
            )
        )
        # (a round left with no learner closes below K: one held back then waits in GRACE so)
        assert m.count >= m.quorum >= 1 or (m.expected == 0 and m.count >= 1)
    else:
        assert m.deadline() is None
    if m.phase is Phase.COLLECTING:
        assert m.count < m.quorum


def test_rebase_keeps_accepted_contributions() -> None:
    cfg = MergeConfig(quorum=3, staleness_bound=2, late_policy="drop", **EXACT)
    m = FragmentMerger(0, cfg, version=4, now=0.0)
    assert apply(m, c(1.0, A, base=4)).accepted
    assert apply(m, c(2.0, B, base=3)).kind == "refuse"  # "drop": an old base is refused ...
    assert apply(m, c(2.0, B, base=4)).accepted
    d = m.rebase(5, now=3.0)
    assert d.kind == "wait" and "rebased from version 4 to 5; 2 kept, 0 dropped" in d.reason
    assert m.version == 5 and m.count == 2 and m.phase is Phase.COLLECTING
    d = apply(m, c(4.0, C, base=5, step_time=0.0))  # ... and the kept ones merge with the next
    assert d.kind == "merge" and d.version == 5
    assert sorted((e.peer, e.staleness) for e in d.entries) == [(A, 1), (B, 1), (C, 0)]
    by_peer = {e.peer: e.weight for e in d.entries}
    assert by_peer[A] == by_peer[B] == pytest.approx(0.5 * by_peer[C])  # discounted for staleness


def test_rebase_drops_what_falls_beyond_the_staleness_bound_and_reopens_below_quorum() -> None:
    cfg = MergeConfig(quorum=2, staleness_bound=1, tau=10.0, late_policy="carry", **EXACT)
    m = FragmentMerger(0, cfg, version=1, now=0.0)
    apply(m, c(0.0, A, base=1))
    apply(m, c(0.5, B, base=0))
    assert m.phase is Phase.GRACE
    d = m.rebase(2, now=1.0)
    assert "1 kept, 1 dropped as stale beyond 1" in d.reason
    assert m.phase is Phase.COLLECTING and m.deadline() is None  # below quorum: no window
    assert apply(m, c(50.0, B, base=2)).kind in ("accept", "merge")
    with pytest.raises(LocalProtocolError, match="not above the held 2"):
        m.rebase(2, now=50.0)


def test_a_held_round_closes_only_when_the_hold_ends() -> None:
    """A new owner holds its first merge while its predecessor's state may come: a round that
    would close waits in GRACE until the hold's end, then closes at that tick."""
    m = FragmentMerger(0, MergeConfig(quorum=2, **EXACT), version=3, now=0.0)
    assert m.hold_until(6.0, now=0.0).kind == "wait"
    m.set_expected(2, now=0.0)
    assert apply(m, c(1.0, A, base=3)).accepted
    d = apply(m, c(2.0, B, base=3))
    assert d.kind == "accept" and "all 2/2 expected contributions in; held 4.00 s more" in d.reason
    assert m.phase is Phase.GRACE and m.deadline() == 6.0
    assert apply(m, ("t", 5.9)).kind == "wait"
    d = apply(m, ("t", 6.0))
    assert d.kind == "merge" and {e.peer for e in d.entries} == {A, B} and d.version == 3


def test_releasing_a_hold_closes_a_held_round_at_once_and_a_rebase_keeps_its_contributions() -> (
    None
):
    m = FragmentMerger(0, MergeConfig(quorum=1, staleness_bound=2, **EXACT), version=3, now=0.0)
    m.hold_until(6.0, now=0.0)
    assert apply(m, c(1.0, A, base=3, step_time=0.0)).kind == "accept"  # would have merged at once
    assert m.rebase(4, now=1.5).kind == "wait"  # the predecessor's newer version came
    d = m.hold_until(2.0, now=2.0)  # handed over: released
    assert (
        d.kind == "merge"
        and d.version == 4
        and [(e.peer, e.staleness) for e in d.entries] == [(A, 1)]
    )


def test_a_dropped_round_merges_nothing_and_collects_afresh() -> None:
    """The version the round would follow was handed out as final elsewhere: its contributions
    are dropped, not merged."""
    m = FragmentMerger(0, MergeConfig(quorum=2, tau=10.0, **EXACT), version=5, now=0.0)
    m.hold_until(6.0, now=0.0)
    apply(m, c(1.0, A, base=5))
    apply(m, c(1.5, B, base=5))
    assert m.phase is Phase.GRACE
    d = m.drop_round("version 5 was handed out as final", now=2.0)
    assert (
        d.kind == "wait"
        and "2 contributions dropped, not merged: version 5 was handed out as final" in d.reason
    )
    assert m.phase is Phase.COLLECTING and m.count == 0 and m.deadline() is None
    assert m.on_tick(7.0).kind == "wait" and m.version == 5
    with pytest.raises(LocalProtocolError, match="finite"):
        m.hold_until(math.inf, now=7.0)


def test_last_contributions_of_learners_stopping_together_merge_in_one_round() -> None:
    """Learners that stop together flush together. Closing on the quorum merged two of the four
    flushes, and the other two, carried, made a second version: the final model moved by two
    steps of the last work. A round holding a last contribution waits (``last_wait_s``) for
    every expected learner's, and closes at once when they are all in."""
    cfg = MergeConfig(quorum=2, late_policy="carry", last_wait_s=3.0, **EXACT)
    m = FragmentMerger(0, cfg, version=7, now=0.0)
    m.set_expected(4, now=0.0)
    assert apply(m, c(0.0, A, base=7, last=True, step_time=0.0)).kind == "accept"
    d = apply(m, c(0.01, B, base=7, last=True, step_time=0.0))
    assert (
        d.kind == "accept" and m.phase is Phase.GRACE and m.deadline() == 3.01
    )  # not merged on the quorum
    assert apply(m, c(0.02, C, base=7, last=True)).kind == "accept"
    d = apply(m, c(0.05, D, base=7, last=True))
    assert (
        d.kind == "merge"
        and len(d.entries) == 4
        and "all 4/4 expected contributions in" in d.reason
    )
    # without the mark the quorum closes the round on two, as before
    m = FragmentMerger(0, cfg, version=7, now=0.0)
    m.set_expected(4, now=0.0)
    apply(m, c(0.0, A, base=7, step_time=0.0))
    assert apply(m, c(0.01, B, base=7, step_time=0.0)).kind == "merge"
    # and a learner that never flushes holds the round no longer than last_wait_s after the latest
    m = FragmentMerger(0, cfg, version=7, now=0.0)
    m.set_expected(4, now=0.0)
    for t, peer in ((0.0, A), (0.5, B), (1.0, C)):
        apply(m, c(t, peer, base=7, last=True, step_time=0.0))
    assert apply(m, ("t", 3.9)).kind == "wait"
    d = apply(m, ("t", 4.0))
    assert d.kind == "merge" and len(d.entries) == 3


def test_the_last_round_waits_for_each_learner_still_training_not_for_a_count() -> None:
    """Seen in the default job: three learners finishing 1.3 and 2.4 s apart. When the second
    flushed, the owner expected two learners (the first had finished) and held two last
    contributions: "all 2/2 expected contributions in", and the third learner's flush, 2.4 s
    later, was measured from that version and merged alone at half a step. Named, the learners
    still training are each waited for; and each last contribution extends the wait by
    ``last_wait_s``, up to ``grace_cap_s`` from the first."""
    cfg = MergeConfig(
        quorum=1,
        quorum_fraction=0.5,
        late_policy="carry",
        last_wait_s=3.0,
        grace_cap_s=10.0,
        **EXACT,
    )
    m = FragmentMerger(0, cfg, version=15, now=0.0)
    m.set_expected(3, now=0.0, learners=frozenset({A, B, C}))
    assert apply(m, c(1.0, A, base=15, last=True, step_time=0.0)).kind == "accept"
    m.set_expected(2, now=1.2, finished=1, learners=frozenset({B, C}))  # A's record says it stopped
    d = apply(m, c(2.3, B, base=15, last=True, step_time=0.0))
    assert d.kind == "accept" and "held" in d.reason and m.deadline() == pytest.approx(5.3)
    assert apply(m, ("t", 4.0)).kind == "wait"  # past A's 3 s: B's wait runs on
    d = apply(m, c(4.7, C, base=15, last=True))
    assert d.kind == "merge" and {e.peer for e in d.entries} == {A, B, C} and d.scale == 1.0
    # counted only, as before: the two last contributions stand for the two learners expected
    m = FragmentMerger(0, cfg, version=15, now=0.0)
    m.set_expected(3, now=0.0)
    apply(m, c(1.0, A, base=15, last=True, step_time=0.0))
    m.set_expected(2, now=1.2, finished=1)
    assert apply(m, c(2.3, B, base=15, last=True, step_time=0.0)).kind == "merge"
    # learners stopping one after another hold the round at most grace_cap_s from the first
    m = FragmentMerger(0, cfg, version=15, now=0.0)
    peers = PEERS + [A, B, C]
    m.set_expected(len(peers), now=0.0, learners=frozenset(peers))
    for i, peer in enumerate(peers[:5]):
        apply(m, c(2.4 * i, peer, base=15, last=True, step_time=0.0))
    assert m.deadline() == 10.0
    d = apply(m, ("t", 10.0))
    assert d.kind == "merge" and len(d.entries) == 5
    # a learner whose work is already in the round is not waited for again
    m = FragmentMerger(
        0, dataclasses.replace(cfg, quorum=2, quorum_fraction=0.0), version=15, now=0.0
    )
    m.set_expected(2, now=0.0, learners=frozenset({A, B}))
    apply(m, c(0.5, B, base=15, step_time=0.0))
    d = apply(m, c(1.0, A, base=15, last=True, step_time=0.0))
    assert d.kind == "merge" and "all 2/2" in d.reason
    with pytest.raises(LocalProtocolError, match="2 expected learners named for 3"):
        m.set_expected(3, now=2.0, learners=frozenset({A, B}))


def test_an_end_of_run_round_is_the_mean_of_the_islands_not_of_their_works_at_one_norm() -> None:
    """At the end of a run learners flush works of any length: one 190 steps since its last
    contribution, one 10. Token weights and the normed mean (every work scaled to the median
    norm) made the final version lean on the longest and stretch the shortest; seen at the
    defaults as final versions up to 0.7 % worse than one evaluation before. A round holding a
    last contribution weighs each island once and takes the plain mean, so the merge lands on the
    mean of the islands' states; a round of regular contributions is weighed as before."""
    cfg = MergeConfig(quorum=1, quorum_fraction=1.0, late_policy="carry", **EXACT)
    m = FragmentMerger(0, cfg, version=15, now=0.0)
    m.set_expected(3, now=0.0, learners=frozenset({A, B, C}))
    apply(
        m, c(0.0, A, base=15, tokens=20_000, steps=200)
    )  # A's regular work, then B's and C's flushes
    apply(m, c(0.5, B, base=15, tokens=19_000, steps=190, last=True))
    d = apply(m, c(1.0, C, base=15, tokens=1_000, steps=10, last=True))
    assert d.kind == "merge" and d.ends_runs and d.aggregate("normed") == "mean"
    assert [e.weight for e in d.entries] == [1.0, 1.0, 1.0] and d.scale == 1.0

    theta = torch.zeros(64)
    g = torch.Generator().manual_seed(0)
    islands = [
        torch.randn(64, generator=g) * s for s in (1.4, 1.3, 0.2)
    ]  # C trained 10 steps since
    deltas = [theta - x for x in islands]  # pseudo-gradients: global minus local
    outer = OuterConfig(lr=1.0, momentum=0.0, aggregate="normed")
    weights, clips = [e.weight for e in d.entries], [e.clip for e in d.entries]
    end = merge_update(
        theta,
        None,
        deltas,
        weights,
        clips,
        outer,
        embedding=False,
        aggregate=d.aggregate(outer.aggregate),
    ).theta
    assert torch.allclose(end, torch.stack(islands).mean(0), atol=1e-6)
    normed = merge_update(theta, None, deltas, weights, clips, outer, embedding=False).theta
    assert not torch.allclose(
        normed, end, atol=1e-2
    )  # what the configured aggregate would have made

    m = FragmentMerger(0, cfg, version=15, now=0.0)
    m.set_expected(2, now=0.0, learners=frozenset({A, B}))
    apply(m, c(0.0, A, base=15, tokens=20_000, steps=200))
    d = apply(m, c(0.5, B, base=15, tokens=10_000, steps=100))
    assert d.kind == "merge" and not d.ends_runs and d.aggregate("normed") == "normed"
    # by tokens, as ever (one of two weighs at most as much as the other: ``others_multiple``)
    assert d.entries[0].weight == d.entries[1].weight > 1.0 and d.entries[0].weight_capped


def test_rebase_not_allowed_while_merging() -> None:
    m = FragmentMerger(0, MergeConfig(**EXACT), now=0.0)
    assert apply(m, c(0.0, A, step_time=0.0)).kind == "merge"
    with pytest.raises(LocalProtocolError, match="Rebase not allowed while merging"):
        m.rebase(3, now=0.0)


# --- a merge that one liar cannot steer ------------------------------------------------------------


def _merge_of(
    m: FragmentMerger, now: float, contributions: list[tuple[bytes, dict[str, Any]]]
) -> Decision:
    m.set_expected(len(contributions), now=now)
    d: Decision | None = None
    for peer, kw in contributions:
        d = apply(m, c(now, peer, **kw))
    assert d is not None and d.kind == "merge", d
    return d


def test_a_scaled_contribution_is_clipped_to_the_honest_norm() -> None:
    m = FragmentMerger(0, MergeConfig(quorum=1, clip_multiple=2.0), now=0.0)
    d = _merge_of(
        m, 1.0, [(A, {"norm": 1.0}), (B, {"norm": 1.2}), (C, {"norm": 0.9}), (D, {"norm": 1000.0})]
    )
    clips = {e.peer: e.clip for e in d.entries}
    assert clips[A] == clips[B] == clips[C] == 1.0
    assert clips[D] * 1000.0 == pytest.approx(2.0 * 1.0)  # 2 x the lower median of the four norms
    # each entry carries the norm reported with it, before clipping (the owner's merge reuses it)
    assert {e.peer: e.norm for e in d.entries} == {A: 1.0, B: 1.2, C: 0.9, D: 1000.0}


def test_a_lone_attacker_at_quorum_one_cannot_set_its_own_reference() -> None:
    m = FragmentMerger(0, MergeConfig(quorum=1, clip_multiple=2.0, min_step_time_s=0.0), now=0.0)
    for v, peer in enumerate((A, B, C)):  # three honest rounds build the history
        _merge_of(m, float(v), [(peer, {"norm": 1.0, "base": v})])
        m.on_published(v + 1, sync_time=0.0, now=float(v))
    d = _merge_of(m, 5.0, [(D, {"norm": 1e6, "base": 3})])  # alone in its round
    (entry,) = d.entries
    assert entry.clip * 1e6 == pytest.approx(2.0)  # median(1e6, 1, 1, 1) = 1: clipped to 2 x 1


def test_a_liar_about_steps_and_tokens_is_bounded_by_time_and_by_the_others() -> None:
    cfg = MergeConfig(
        quorum=1, max_tokens_per_step=100, min_step_time_s=0.01, max_weight_median_multiple=4.0
    )
    m = FragmentMerger(0, cfg, now=0.0)
    d = _merge_of(
        m,
        1.0,
        [
            (A, {"tokens": 1000, "steps": 10}),  # honest: 10 steps of 100 tokens
            (B, {"tokens": 10**12, "steps": 10**6}),
        ],
    )  # 1 s allows 101 steps at most
    by = {e.peer: e for e in d.entries}
    assert by[B].steps_bounded and by[B].tokens_bounded and by[B].weight_capped
    assert not (by[A].steps_bounded or by[A].tokens_bounded or by[A].weight_capped)
    share = by[B].weight / (by[A].weight + by[B].weight)
    # capped at the other's weight (n - 1 = 1 x the others' median), not 100 %; 4x (80 %) was the hole
    assert share == pytest.approx(0.5)


def test_a_work_cap_scales_a_contribution_beyond_it_and_leaves_norm_clipping_alone() -> None:
    """Under outer momentum (``max_work_steps`` = H = 10) a learner three times as fast as the
    round's pace ships 30 steps a round: its payload counts for 10 of them (clip 1/3, flagged
    ``work_scale``), one of 10 or fewer counts whole, and the whole norms that set later
    rounds' clip reference are as without the cap: the work cap is no evidence of a norm."""
    cfg = MergeConfig(quorum=1, clip_multiple=4.0, min_step_time_s=0.0, max_work_steps=10)
    m = FragmentMerger(0, cfg, now=0.0)
    d = _merge_of(
        m,
        1.0,
        [
            (A, {"steps": 30, "norm": 3.0}),
            (B, {"steps": 10, "norm": 1.0}),
            (C, {"steps": 4, "norm": 0.4}),
        ],
    )
    by = {e.peer: e for e in d.entries}
    assert by[A].work_scale == pytest.approx(1 / 3) and by[A].clip == pytest.approx(1 / 3)
    assert (by[B].work_scale, by[B].clip) == (1.0, 1.0) and (by[C].work_scale, by[C].clip) == (
        1.0,
        1.0,
    )
    m.on_published(1, sync_time=0.0, now=1.0)
    assert m.norms == [(A, 3.0), (B, 1.0), (C, 0.4)]  # unchanged by the cap
    plain = FragmentMerger(
        0, MergeConfig(quorum=1, min_step_time_s=0.0), now=0.0
    )  # no cap: all of it
    d = _merge_of(plain, 1.0, [(A, {"steps": 30, "norm": 3.0}), (B, {"steps": 10, "norm": 1.0})])
    assert [(e.work_scale, e.clip) for e in d.entries] == [(1.0, 1.0), (1.0, 1.0)]
    with pytest.raises(LocalProtocolError, match="max_work_steps must be None or >= 1"):
        MergeConfig(max_work_steps=0)


@settings(max_examples=60, deadline=None)
@given(
    norms=st.lists(st.floats(min_value=0.0, max_value=1e30), min_size=1, max_size=8),
    c_mult=st.sampled_from([1.0, 2.0, 3.0]),
)
@example(
    norms=[0.0, 2.252956018866386e29, 1.4882256214878484e-291], c_mult=1.0
)  # a subnormal scale
def test_no_merged_norm_exceeds_c_times_the_median(norms: list[float], c_mult: float) -> None:
    m = FragmentMerger(0, MergeConfig(quorum=1, clip_multiple=c_mult), now=0.0)
    peers = [bytes([i + 1]) * 32 for i in range(len(norms))]
    d = _merge_of(m, 1.0, [(p, {"norm": n}) for p, n in zip(peers, norms, strict=True)])
    limit = c_mult * statistics.median(norms)
    for e, n in zip(d.entries, norms, strict=True):
        assert 0.0 <= e.clip <= 1.0  # 0 when most norms are 0: the reference is 0
        assert n * e.clip <= limit * (1 + 1e-9) + 1e-300


def test_a_synchronous_quorum_is_every_live_learner() -> None:
    """Synchronous DiLoCo waits for every learner, but only the live ones: when two of four
    have left (``set_expected(2)``), the two contributions in close the round at once instead
    of waiting for a quorum of four that cannot come."""
    cfg = MergeConfig(quorum=4, gamma=0.0, quorum_is_expected=True)
    m = FragmentMerger(0, cfg, version=0, now=0.0)
    m.set_expected(4, now=0.0)
    a = m.on_contribution(
        b"a" * 32, base_version=0, tokens=10, steps=1, step_time=0.1, payload=None, now=1.0
    )
    b = m.on_contribution(
        b"b" * 32, base_version=0, tokens=10, steps=1, step_time=0.1, payload=None, now=1.1
    )
    assert a.kind == b.kind == "accept" and m.phase is Phase.COLLECTING  # 2 of 4: waiting
    assert m.set_expected(2, now=2.0).kind == "merge"  # the others left: every live learner is in
    plain = FragmentMerger(0, MergeConfig(quorum=4, gamma=0.0), version=0, now=0.0)
    for peer in (b"a" * 32, b"b" * 32):
        plain.on_contribution(
            peer, base_version=0, tokens=10, steps=1, step_time=0.1, payload=None, now=1.0
        )
    # decoupled: K = 4 is lowered to the 2 expected, through the grace window (0 s at gamma 0)
    lowered = plain.set_expected(2, now=2.0)
    assert lowered.kind == "merge" and "K = 4 lowered to the 2 learners expected" in lowered.reason
