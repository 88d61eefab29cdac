"""Validated publication: is a candidate version worse than the one it replaces, and whose work made it so.

Theory of operation. Norm bounds stop a contribution from moving a fragment far; they cannot tell
a well-formed step that hurts (a sign flip or an inner-product manipulation inside the clip, a
colluding "a little is enough" shift) from an honest one. Before an owner publishes a merge it
therefore evaluates the candidate on windows of a validation set every peer holds (the swarm
pins it by hash), next to the version it would replace, on the *same* windows:

1. ``draw_windows``: the windows are drawn from a pool far larger than one check, with a seed the
   owner draws from its own randomness at check time and logs, so no sender can tune its
   contribution to them in advance, and ``atoll replay`` redraws the same ones from the log.
2. ``compare``: per window, the candidate's loss minus the current version's (paired, so the
   windows' own spread cancels). The candidate *hurts* when the mean rise exceeds the noise: ``z``
   standard errors of those paired differences, and never less than ``min_rise`` (relative to the
   current loss), so a deterministic evaluation with no spread still has a floor.
3. ``judge``: a candidate that lowers the loss beyond noise is published. Otherwise each of the
   round's contributions is scored alone (the loss with only it applied, Templar's Gauntlet,
   stage 2), and one that hurts is dropped; the owner merges the rest. Scoring when the candidate
   merely fails to improve, not only when it hurts: colluders who cancel the honest work of their
   round (two sign flips against two honest steps) leave a flat candidate that hides a step
   backwards each. A contribution *hurts* when its losses alone exceed the current version's
   beyond noise and, in a flat round, also the round's typical contribution's (per window, the
   median over the round's contributions alone): a rise every contribution of a flat round
   shares is the state evaluated (the other fragments co-adapted with other work, a point where
   any step raises the validation loss), not evidence against one sender. (Not in a hurtful
   round: there colluders may be most of it, and identical work makes itself typical.) On a
   tiny 8-peer swarm honest work alone rose past the first test in 12 % of flat rounds, and past
   both in 7 %; sign flips in 90 % either way. When none hurts, a flat candidate is published and
   a hurtful one is dropped whole
   (nothing is published for the round): the harm is in their combination, which no per-sender
   test can pin on one of them.

Everything here is pure: losses come in as numbers, randomness as a ``random.Random`` or a seed.
The owner (``node.diloco.owner``) runs the evaluations off its event loop and logs each check.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Comparison",
    "ValidationConfig",
    "Verdict",
    "compare",
    "draw_seed",
    "draw_windows",
    "judge",
]

MIN_POOL_RATIO = 16  # a pool holds at least this many checks' worth of windows


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationConfig:
    """How an owner checks candidates. ``windows``: evaluated per version (each costs one forward
    pass of one window); ``every``: check one merge in this many (1: all); ``z``: the standard
    errors a rise must exceed; ``min_rise``: a rise below this fraction of the current loss never
    counts as hurt, however small the spread; ``rule``: 2 scores each contribution alone when the
    candidate does not lower the loss beyond noise and blames harm beyond the round's typical
    contribution (``judge``); 1, the rule before, only when it raises the loss, and blames any
    harm alone (kept so that ``atoll replay`` recomputes older checks as they were made)."""

    windows: int = 16
    every: int = 1
    z: float = 3.0
    min_rise: float = 0.002
    rule: int = 2

    def __post_init__(self) -> None:
        if self.windows < 2:
            raise ValueError(
                f"validation needs at least 2 windows per check to measure noise, got {self.windows}"
            )
        if self.every < 1:
            raise ValueError(f"validation every must be >= 1 (1: every merge), got {self.every}")
        if self.rule not in (1, 2):
            raise ValueError(f"validation rule must be 1 or 2, got {self.rule}")
        if not (0.0 <= self.z < math.inf and 0.0 <= self.min_rise < math.inf):
            raise ValueError(
                f"validation z and min_rise must be finite and >= 0, got {self.z}, {self.min_rise}"
            )


def draw_seed(rng: random.Random) -> int:
    """A fresh seed for one check's windows, from the owner's own randomness (logged with the check)."""
    return rng.getrandbits(63)


def draw_windows(pool: int, n: int, seed: int) -> tuple[int, ...]:
    """``n`` distinct window indices in ``range(pool)``, drawn by ``seed`` (the same seed draws
    the same windows on any machine). Raises ``ValueError`` when the pool is not at least
    ``MIN_POOL_RATIO`` checks' worth of windows: a small pool lets a sender fit them all."""
    if n < 1 or pool < MIN_POOL_RATIO * n:
        raise ValueError(
            f"a validation pool of {pool} windows is too small for checks of {n}: it needs at "
            f"least {MIN_POOL_RATIO * n}; use a bigger validation set or fewer windows per check"
        )
    return tuple(random.Random(seed).sample(range(pool), n))


@dataclass(frozen=True, slots=True)
class Comparison:
    """A candidate's losses against the current version's on the same windows: the mean paired
    ``rise`` (candidate minus current), the ``margin`` it must exceed to count, and the verdict."""

    rise: float
    margin: float
    hurts: bool

    def __str__(self) -> str:
        return f"{self.rise:+.4f} (noise {self.margin:.4f})"


def compare(
    before: Sequence[float], after: Sequence[float], config: ValidationConfig
) -> Comparison:
    """Whether ``after`` (the candidate's per-window losses) is worse than ``before`` (the current
    version's, same windows) beyond measured noise. A non-finite candidate loss always hurts.
    Raises ``ValueError`` for sequences of different lengths or fewer than two windows."""
    if len(before) != len(after) or len(before) < 2:
        raise ValueError(
            f"compare needs two equal sequences of >= 2 window losses, got {len(before)} and {len(after)}"
        )
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    if not all(math.isfinite(d) for d in diffs):
        return Comparison(math.inf, 0.0, True)
    n = len(diffs)
    mean = math.fsum(diffs) / n
    var = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
    base = abs(math.fsum(before) / n)
    margin = max(config.z * math.sqrt(var / n), config.min_rise * base)
    return Comparison(mean, margin, mean > margin)


def _severity(c: Comparison) -> float:
    """How far beyond noise a rise is, in margins (1: just past it)."""
    return c.rise / c.margin if c.margin > 0 and math.isfinite(c.rise) else 1.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a candidate: ``publish`` it, or not and ``drop`` these senders'
    contributions (all of them: drop the round); ``helped``: the senders whose work, scored alone,
    lowered the loss beyond noise (of a published candidate too, when it was scored); ``reason``:
    one line with the numbers; ``whole``: the round is dropped because the harm is in the
    combination (no single contribution hurt alone); ``severity``: per sender dropped for
    hurting alone, its rise over the noise margin (>= 1; a false positive sits near 1)."""

    publish: bool
    drop: frozenset[bytes]
    helped: frozenset[bytes]
    reason: str
    whole: bool = False
    severity: Mapping[bytes, float] = field(default_factory=dict)


def judge(
    before: Sequence[float],
    candidate: Sequence[float],
    alone: Mapping[bytes, Sequence[float]] | None,
    config: ValidationConfig,
) -> Verdict:
    """Decide on a candidate (see the module docstring). ``alone``: per sender, the losses with
    only its contribution applied (None: not scored yet; then a candidate that hurts is returned
    with an empty ``drop`` and the owner scores them and asks again). Raises ``ValueError`` as
    ``compare`` does."""
    overall = compare(before, candidate, config)
    improves = overall.rise < -overall.margin
    if not overall.hurts and (improves or config.rule == 1):
        return Verdict(True, frozenset(), frozenset(), f"validated: loss {overall}")
    what = "raises the loss" if overall.hurts else "does not lower the loss beyond noise"
    if alone is None:
        return Verdict(
            False,
            frozenset(),
            frozenset(),
            f"the candidate {what} {overall}; scoring each contribution",
        )
    scores = {peer: compare(before, losses, config) for peer, losses in alone.items()}
    hurt = frozenset(p for p, c in scores.items() if c.hurts)
    if (
        config.rule >= 2 and not overall.hurts and len(alone) > 1
    ):  # flat: beyond what the round's typical work does
        typical = [
            statistics.median(losses[w] for losses in alone.values()) for w in range(len(before))
        ]
        hurt = frozenset(p for p in hurt if compare(typical, alone[p], config).hurts)
    helped = frozenset(p for p, c in scores.items() if not c.hurts and c.rise < -c.margin)
    if hurt:
        detail = ", ".join(f"{p.hex()[:8]} {scores[p]}" for p in sorted(hurt))
        return Verdict(
            False,
            hurt,
            helped,
            f"the candidate {what} {overall}; "
            f"{len(hurt)} of {len(scores)} contributions hurt alone: {detail}",
            severity={p: _severity(scores[p]) for p in hurt},
        )
    if (
        not overall.hurts
    ):  # flat, and none of its work hurts alone: an honest round that moved little
        return Verdict(
            True,
            frozenset(),
            helped,
            f"validated: loss {overall}, none of its {len(scores)} contributions hurts alone",
        )
    return Verdict(
        False,
        frozenset(scores),
        helped,
        f"the candidate raises the loss {overall} but none of its {len(scores)} contributions does "
        "alone; the round is dropped",
        whole=True,
    )
