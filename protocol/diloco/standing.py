"""Standing per sender key: what an owner has learnt about each key from the fate of its work.

Theory of operation. Every bound an owner applies to a contribution (the norm clip, the caps on
claimed steps, tokens and weight, the out-of-bounds refusal at intake, the validation of the
candidate version) limits what one contribution can do; none of them remembers. A sender whose
every contribution is clipped keeps a clipped share of every merge for ever. ``Standing`` is that
memory: each outcome the owner sees is an ``Event`` with a fixed effect on the sender's score,

  * bad outcomes (``CLIPPED``, ``REFUSED``, ``HURT``, ``DISSENT``, ``BOUNDED``) subtract at once,
    a ``HURT`` weighted by how far beyond the noise it was (``hurt_scale``: honest false positives
    sit just past it, attacks far beyond), a ``BOUNDED`` (a claim capped to what the owner can
    see) by how far past the bound the claim went (``bounded_scale``: an honest learner after a
    stall claims up to ~2x, a liar 1000x); a ``DISSENT`` (work that agrees with none of its
    round's: ``protocol.diloco.agreement``) costs a fixed amount and earns no credit;
  * good ones (``MERGED`` cleanly, ``HELPED`` the validation loss) add a small credit, at most one
    credit per key and version and never above ``max_credit`` (a key costs nothing, so a fresh one
    starts neutral at 0 and cannot buy standing quickly: Sybil keys that contribute once hold at
    most one credit, far below a long-honest key's);
  * a negative score relaxes towards 0 by ``recovery`` per version (a key that was refused comes
    back slowly, so an attacker spends most versions refused), a positive one does not decay;
  * the score is clamped to ``[floor, max_credit]``, so a record of any length stays bounded, and
    a key is refused while its score is below ``threshold``, with a reason naming the score.

Time is the fragment's version number, an argument (never a clock): standing is replayable from
the owner's decisions, and survives an owner change when ``export``/``restore`` carry it in the
replica handoff and the owner checkpoint as parallel tuples of peer ids and scores. At most
``max_keys`` keys are kept; when full, the least informative key goes first (the score nearest
0, then the least recently seen), so a flood of fresh neutral keys evicts its own kind and not the
record of a refused key.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["Event", "Standing", "StandingConfig", "bounded_scale", "hurt_scale"]


def hurt_scale(severity: float) -> float:
    """A ``HURT``'s weight from its severity in noise margins: half its effect just past the noise
    (an honest false positive's usual size), the whole at 2 margins, at most twice it from 4
    (a sign flip's or an inner-product attack's usual size); 1 for a severity that is not a
    number."""
    if not math.isfinite(severity):
        return 2.0 if severity > 0 else 1.0
    return min(2.0, max(0.5, severity / 2.0))


def bounded_scale(overclaim: float) -> float:
    """A ``BOUNDED``'s weight from how far the claim went past the bound (claimed / counted): half
    its effect up to 1.4x (an honest learner's claim after a stall), log2 of it above, at most 4
    from 16x (``lie-tokens`` claims 1000x); 4 for a ratio that is not a finite number."""
    if not math.isfinite(overclaim):
        return 4.0
    return min(4.0, max(0.5, math.log2(max(overclaim, 1.0))))


class Event(enum.Enum):
    """What became of one contribution (the worst outcome is the one to record)."""

    MERGED = "merged"  # merged with no bound applied
    HELPED = "helped"  # scored alone, it lowered the validation loss
    BOUNDED = "bounded"  # a claim (steps, tokens, weight) was capped to what the owner can see
    DISSENT = "dissent"  # its direction agreed with none of its round's other senders' work
    CLIPPED = "clipped"  # its norm was clipped to the reference
    HURT = "hurt"  # scored alone, it raised the validation loss; dropped
    REFUSED = "refused"  # refused at intake as out of bounds (non-finite, absurd norm or scale)


@dataclass(frozen=True, slots=True)
class StandingConfig:
    """Effects of each event and the bounds of a score. Defaults: a key clipped or found hurtful
    every round is refused after about five rounds, one refused out of bounds three times at
    once. Measured on a 3-peer ``atoll local`` run with validation on, honest learners had about
    one contribution in ten judged hurtful (the per-contribution check is noisy on small models)
    and a few claims capped after stalls: at -1 a hurt and -0.25 a cap, an honest learner fell
    to -2.05 and was refused 35 times; so a hurt costs what ten clean merges earn. A capped claim
    costs by how far past the bound it went (``bounded_scale``): honest learners are bounded 1-2
    times a run, at most ~2x past (-0.05 to -0.1 each); ``lie-tokens`` every time at 500x (-0.4).
    A dissent costs what a hurt does: 8-peer tiny runs judged 1 honest contribution of 205 and
    45-90 % of random, stale and alie work dissenting (docs/security.md)."""

    merged: float = 0.05
    helped: float = 0.1
    bounded: float = -0.1
    dissent: float = -0.5
    clipped: float = -0.5
    hurt: float = -0.5
    refused: float = -1.0
    max_credit: float = 1.0  # 20 clean rounds; a Sybil key's one contribution holds 0.05
    floor: float = -8.0
    threshold: float = -2.0  # refused while the score is below this
    recovery: float = 0.05  # per version, towards 0, for a negative score: -2.5 comes back in 10
    max_keys: int = 4096

    def __post_init__(self) -> None:
        gains, losses = (
            (self.merged, self.helped),
            (self.bounded, self.dissent, self.clipped, self.hurt, self.refused),
        )
        if not all(0 <= g <= self.max_credit for g in gains) or not all(x <= 0 for x in losses):
            raise ValueError("standing gains must lie in 0..max_credit and losses be <= 0")
        if not self.floor < self.threshold < 0 < self.max_credit or not math.isfinite(self.floor):
            raise ValueError(
                f"standing bounds must satisfy floor < threshold < 0 < max_credit, got "
                f"{self.floor}, {self.threshold}, {self.max_credit}"
            )
        if self.recovery < 0 or self.max_keys < 1:
            raise ValueError("standing recovery must be >= 0 and max_keys >= 1")

    def effect(self, event: Event) -> float:
        return float(getattr(self, event.value))


@dataclass(slots=True)
class _Record:
    score: float  # as of ``at``
    at: int  # the version the score was last brought up to date
    credited: int  # the last version that earned a credit (-1: never)


class Standing:
    """Scores per sender key (bytes), from the events an owner records; see the module doc."""

    def __init__(self, config: StandingConfig = StandingConfig()) -> None:
        self.config = config
        self._records: dict[bytes, _Record] = {}  # insertion order: least recently seen first

    def __len__(self) -> int:
        return len(self._records)

    def score(self, peer: bytes, *, version: int) -> float:
        """``peer``'s score at ``version`` (0 for a key never seen or forgotten)."""
        record = self._records.get(peer)
        return 0.0 if record is None else self._current(record, version)

    def record(
        self, peer: bytes, event: Event, *, version: int, severity: float | None = None
    ) -> float:
        """Count ``event`` against (or for) ``peer`` at ``version``; returns its new score.
        ``severity`` scales a loss: a ``HURT`` measured in noise margins (1: just past the noise,
        where validation's false positives on honest work sit), as ``hurt_scale`` maps it; a
        ``BOUNDED`` as claimed / counted, as ``bounded_scale`` maps it; None: the event's whole
        effect."""
        cfg = self.config
        record = self._records.pop(peer, None)
        if record is None:
            self._make_room(version)
            record = _Record(0.0, version, -1)
        score = self._current(record, version)
        effect = cfg.effect(event)
        if event is Event.HURT and severity is not None:
            effect *= hurt_scale(severity)
        elif event is Event.BOUNDED and severity is not None:
            effect *= bounded_scale(severity)
        if effect > 0:
            if version <= record.credited:
                effect = 0.0  # one credit per version: a key cannot farm standing inside a round
            else:
                record.credited = version
        record.score = min(cfg.max_credit, max(cfg.floor, score + effect))
        record.at = max(record.at, version)
        self._records[peer] = record  # now the most recently seen
        return record.score

    def refused(self, peer: bytes, *, version: int) -> str | None:
        """A reason to refuse ``peer``'s work at ``version``, or None when its standing allows it."""
        score = self.score(peer, version=version)
        if score >= self.config.threshold:
            return None
        wait = (
            math.ceil((self.config.threshold - score) / self.config.recovery)
            if self.config.recovery
            else -1
        )
        return (
            f"sender's standing {score:.2f} is below {self.config.threshold:.2f} (clipped, refused, "
            f"hurtful or dissenting work, or claims past the bounds); refused for about {wait} more versions"
            if wait >= 0
            else f"sender's standing {score:.2f} is below {self.config.threshold:.2f}; refused"
        )

    def below(self, *, version: int) -> int:
        """How many known keys are refused at ``version``."""
        return sum(
            1 for r in self._records.values() if self._current(r, version) < self.config.threshold
        )

    def lowest(self, n: int, *, version: int) -> list[tuple[bytes, float]]:
        """The ``n`` lowest scores at ``version``, lowest first."""
        scored = [(peer, self._current(r, version)) for peer, r in self._records.items()]
        return sorted(scored, key=lambda item: (item[1], item[0]))[: max(0, n)]

    def export(self, *, version: int) -> tuple[tuple[bytes, ...], tuple[float, ...]]:
        """Parallel tuples (peer ids, scores at ``version``), least recently seen first: what the
        replica handoff and the owner checkpoint carry. Neutral keys (score 0) are left out."""
        items = [(p, self._current(r, version)) for p, r in self._records.items()]
        items = [(p, s) for p, s in items if s != 0.0]
        return tuple(p for p, _ in items), tuple(s for _, s in items)

    def restore(self, peers: tuple[bytes, ...], scores: tuple[float, ...], *, version: int) -> None:
        """Take the scores a predecessor exported at ``version``. A key this standing already knows
        keeps its own score (what this owner saw itself wins). Raises ValueError, changing nothing,
        when the tuples do not pair up, hold more than ``max_keys`` keys or a score that is not a
        finite number within ``[floor, max_credit]``."""
        cfg = self.config
        if len(peers) != len(scores) or len(peers) > cfg.max_keys:
            raise ValueError(
                f"standing must pair up peers and scores and hold at most {cfg.max_keys} keys, "
                f"got {len(peers)} peers and {len(scores)} scores"
            )
        for score in scores:
            if not (math.isfinite(score) and cfg.floor <= score <= cfg.max_credit):
                raise ValueError(
                    f"a standing score must be finite and lie in {cfg.floor}..{cfg.max_credit}, "
                    f"got {score!r}"
                )
        for peer, score in zip(peers, scores, strict=True):
            if peer in self._records:
                continue
            self._make_room(version)
            # credited at ``version``: a handed key earns no second credit in the same version
            self._records[peer] = _Record(float(score), version, version)

    def _current(self, record: _Record, version: int) -> float:
        if record.score >= 0:
            return record.score
        elapsed = max(0, version - record.at)
        return min(0.0, record.score + self.config.recovery * elapsed)

    def _make_room(self, version: int) -> None:
        if len(self._records) < self.config.max_keys:
            return
        # least informative: nearest 0 now, then least recently seen (dict order)
        order = {peer: i for i, peer in enumerate(self._records)}
        victim = min(
            self._records, key=lambda p: (abs(self._current(self._records[p], version)), order[p])
        )
        del self._records[victim]
