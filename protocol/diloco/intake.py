"""What an owner refuses before its merger sees a contribution, and the bookkeeping behind it.

An owner's merger (``protocol.diloco.merge``) decides on a contribution's counts and round; before
that the owner screens it against the state it holds (pure, from explicit inputs):

- a final version was handed out under ``FINAL_HOLD_S`` ago (``FinalHold``): learners that ended
  their run took it and left, and merging more would fork them off the rest;
- its norm is far out of bounds (``out_of_bounds``: ``OUT_OF_BOUNDS`` times the merger's norm
  reference, or |Theta| with none);
- it was measured against a state the owner does not hold under that version
  (``base_mismatch``), or the sender's work from that base was merged already
  (``already_merged``: a pseudo-gradient is cumulative since its base, counting it twice would
  count its steps twice). Both are "resync" refusals, which owe the learner a serve of the
  latest version (``ResyncLedger``).

A sender's "last" mark makes its round wait for the others' (bounded); ``LastMarks`` honours it
once per sender. Time is an argument (``now``); nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = [
    "FINAL_HOLD_S",
    "LAST_SENDERS_KEPT",
    "OUT_OF_BOUNDS",
    "OWED_SERVES_PER_VERSION",
    "RESYNCS_OWED_KEPT",
    "FinalHold",
    "LastMarks",
    "ResyncLedger",
    "already_merged",
    "base_mismatch",
    "out_of_bounds",
]

# once a version was handed out as final (a learner ending its run takes it and leaves), work that
# arrives this long after is refused: merging it would leave that learner on another model. An
# idle swarm that someone joins later merges again once the hold lapses
FINAL_HOLD_S = 120.0
OUT_OF_BOUNDS = 1000.0  # a contribution's norm over this many times the reference is refused
LAST_SENDERS_KEPT = 100_000  # senders whose "last" mark was honoured; beyond, the mark is ignored
RESYNCS_OWED_KEPT = 4096  # learners owed a serve (or served one of this version); the oldest go
OWED_SERVES_PER_VERSION = 2  # owed serves of one version to one learner: one more if one is lost


def out_of_bounds(
    norm: float, *, reference: float | None, theta_norm: float, fragment: int
) -> str | None:
    """Why a contribution of norm ``norm`` is refused outright: over ``OUT_OF_BOUNDS`` times the
    merger's norm ``reference`` (its recent senders' merged norms), or with none, times
    ``theta_norm`` (|Theta|). No honest pseudo-gradient comes near (an honest step is a few
    percent of |Theta|), and the merge would only clip it: refused here, it counts against its
    sender. ``theta_norm`` is read only when ``reference`` is None."""
    basis, what = (
        (reference, "the recent merged norms' median")
        if reference is not None
        else (theta_norm, "|Theta|")
    )
    if basis > 0 and norm > OUT_OF_BOUNDS * basis:
        return (
            f"out of bounds: the contribution's norm {norm:.3g} is over {OUT_OF_BOUNDS:g}x {what} "
            f"({basis:.3g}) of fragment {fragment}; not merged"
        )
    return None


def base_mismatch(
    base_version: int,
    base_digest: bytes,
    *,
    digests: Mapping[int, Collection[bytes]],
    version: int,
    keep: int,
    fragment: int,
) -> str | None:
    """Why a contribution measured against ``base_digest`` under ``base_version`` cannot be applied
    by an owner holding ``version`` that knows each of its last ``keep`` versions by ``digests``:
    a "resync" reason (the learner then fetches the owners' states), or None. A base older than
    any kept digest is not refused here: the merger refuses it as stale, with that reason."""
    known = digests.get(base_version)
    if known is None:
        if base_version >= version - keep + 2:
            return (
                f"resync: base version {base_version} of fragment {fragment} is not "
                f"known here (this owner starts at version {min(digests, default=version)})"
            )
        return None
    if base_digest not in known:
        return (
            f"resync: base version {base_version} of fragment {fragment} has state "
            f"{next(iter(known)).hex()[:12]} here, the contribution was measured against "
            f"{base_digest.hex()[:12]}"
        )
    return None


def already_merged(
    base_version: int, merged: int | None, *, version: int, fragment: int
) -> str | None:
    """Why a contribution from ``base_version`` is refused when its sender's work from base
    ``merged`` is in the global fragment already: a second pseudo-gradient from the same base (a
    learner that gave up waiting and sent again) would count the first one's steps twice."""
    if merged is not None and base_version <= merged:
        return (
            f"resync: a contribution of yours based on version {merged} of fragment "
            f"{fragment} was merged already; take version {version} first"
        )
    return None


@dataclass(slots=True)
class FinalHold:
    """When the owner's latest version was last handed out as final; work is refused for
    ``FINAL_HOLD_S`` after (``refusal``)."""

    declared: tuple[int, float] | None = None  # (version, when)

    def declare(self, version: int, now: float) -> bool:
        """Hold ``version`` final from ``now``. Returns whether it was not held final before."""
        newly = not self.holds(version, now)
        self.declared = (version, now)
        return newly

    def holds(self, version: int, now: float) -> bool:
        """Whether ``version`` was handed out as final and the hold has not lapsed."""
        return (
            self.declared is not None
            and self.declared[0] == version
            and now - self.declared[1] < FINAL_HOLD_S
        )

    def refusal(self, now: float, fragment: int) -> str | None:
        """Why a contribution is refused at ``now``: a final version was handed out under
        ``FINAL_HOLD_S`` ago, to learners that took it and left."""
        if self.declared is None:
            return None
        version, at = self.declared
        age = now - at
        if age >= FINAL_HOLD_S:
            return None
        return (
            f"fragment {fragment}: version {version} was handed out as final "
            f"{age:.1f} s ago (the swarm's run ended); contribution not merged, "
            f"take the final version instead"
        )


class ResyncLedger:
    """The learners an owner told to resync, each owed a serve of its latest version.

    Granted by the owner's own refusal, never by a claim: each costs its sender one whole
    contribution first, and at most ``OWED_SERVES_PER_VERSION`` of one version go to one learner,
    so a member sending cheap contributions on a wrong base cannot make the owner upload a full
    version for each. At most ``RESYNCS_OWED_KEPT`` learners are remembered (the oldest go)."""

    def __init__(self) -> None:
        self.owed: dict[bytes, tuple[int, int, bool]] = {}  # (version, serves given, one owed)

    def owe(self, learner: bytes, version: int) -> None:
        """A "resync" refusal at ``version`` owes ``learner`` a serve of it (within the cap)."""
        held, given, _ = self.owed.pop(learner, (version, 0, False))
        if held != version:
            given = 0
        self.owed[learner] = (version, given, given < OWED_SERVES_PER_VERSION)
        while len(self.owed) > RESYNCS_OWED_KEPT:
            self.owed.pop(next(iter(self.owed)))

    def spend(self, asker: bytes | None) -> bool:
        """Whether ``asker`` is owed a serve now; asking spends it."""
        held = self.owed.get(asker) if asker is not None else None
        if asker is None or held is None or not held[2]:
            return False
        self.owed[asker] = (held[0], held[1] + 1, False)
        return True


class LastMarks:
    """A sender's "last" contribution makes its round wait for the others' (bounded): honoured
    once per sender, so a member marking all its work "last" cannot slow every round. A refused
    contribution does not spend the mark (``taken`` is called only for accepted ones)."""

    def __init__(self) -> None:
        self.spent: set[bytes] = set()

    def honoured(self, sender: bytes, last: bool) -> bool:
        """Whether ``sender``'s contribution marked ``last`` counts as its last."""
        return last and sender not in self.spent and len(self.spent) < LAST_SENDERS_KEPT

    def taken(self, sender: bytes) -> None:
        """``sender``'s honoured last contribution was accepted: its mark is spent."""
        self.spent.add(sender)
