"""Which learners an owner's rounds wait for, and which finished: the members' records read
against what the owner heard from them (``protocol.diloco.activity``).

Decoupled rounds wait for the live members whose records say "learning", less suspects and less
those the owner finds silent (a record's "learning" is a claim: members that make it and send
nothing must not raise a merge's quorum past what the learners at work can reach, nor hold the
end of a run), and, in a round's count, less those whose work it has not taken within
``RECENT_ROUNDS`` of its own round times. Synchronous modes are not elastic (synchronous DiLoCo,
the paper's baseline): they wait for every provisioned learner but those that finished.

A finished learner (seen learning, its record now says stopped) counts in a decoupled merge's
share as contributing nothing, once the owner merged its work in ``FINISHED_MIN_MERGES`` rounds.
Sans-IO: the caller passes the records, the owner's activity and ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from protocol.diloco.activity import LearnerActivity

__all__ = ["FINISHED_MIN_MERGES", "RECENT_ROUNDS", "Claim", "ExpectedLearners"]

RECENT_ROUNDS = (
    3.0  # a learner's work older than this many of the owner's round times: not waited for
)
FINISHED_MIN_MERGES = 2  # a finished learner counts in a merge's share once in this many merges


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """What a member's record says: whether it is learning, and when the record expires."""

    learning: bool
    expires_at: float


class ExpectedLearners:
    """The learners a round waits for, and those that finished. Keeps every learner seen
    learning and those seen finished (a record that expires leaves a finished learner finished).
    ``mode``: the swarm's mode ("decoupled" or a synchronous one); ``provisioned``: the learners
    a synchronous swarm was started with (``--peers``)."""

    def __init__(self, *, mode: str, provisioned: int) -> None:
        self.decoupled = mode == "decoupled"
        self.provisioned = provisioned
        self.seen_learning: set[bytes] = set()
        self.finished: set[bytes] = set()

    def learning(
        self, claims: Mapping[bytes, Claim], suspects: AbstractSet[bytes], now: float
    ) -> set[bytes]:
        """The members whose live records (unexpired at ``now``) say learning, suspects left out."""
        live = {pid for pid, c in claims.items() if c.learning and c.expires_at > now}
        return live - suspects

    def expected(
        self, claims: Mapping[bytes, Claim], suspects: AbstractSet[bytes], now: float
    ) -> int:
        """How many learners a round waits for. Decoupled: the live learning members.
        Synchronous: every provisioned learner (or as many as were ever seen) but those that
        finished; a learner that died is waited for until it is back."""
        if not self.decoupled:
            for pid, c in claims.items():
                (self.seen_learning if c.learning else self.finished).add(pid)
            return max(self.provisioned, len(self.seen_learning | self.finished)) - len(
                self.finished
            )
        return len(self.learning(claims, suspects, now))

    def silent(
        self,
        learning: AbstractSet[bytes],
        activity: LearnerActivity,
        *,
        contributors: AbstractSet[bytes],
        round_seconds: float | None,
        started_at: float,
        now: float,
        at_end: bool = False,
    ) -> set[bytes]:
        """Of ``learning``, those a round does not wait for: silent past their bound
        (``LearnerActivity.silent``) and, outside ``at_end``, those whose work was not taken
        lately (``not_recent``). A member whose work waits in the open round (``contributors``)
        is never silent: it waits on us. Notes ``learning`` as seen at ``now``."""
        activity.seen(learning, now)
        silent = activity.silent(learning, since=started_at, now=now, at_end=at_end) - contributors
        if not at_end:
            silent |= not_recent(
                activity,
                learning - silent,
                contributors=contributors,
                round_seconds=round_seconds,
                now=now,
            )
        return silent

    def finished_count(self, claims: Mapping[bytes, Claim]) -> int:
        """Decoupled: the learners seen training whose records now say they stopped (a merge
        counts them in its share of the learners as contributing nothing, so that a straggler
        training on after the others finished moves each fragment by its share of a step, not
        by its whole work). 0 in synchronous rounds, which wait for every learner."""
        if not self.decoupled:
            return 0
        learning = {pid for pid, c in claims.items() if c.learning}
        self.seen_learning |= learning
        self.finished |= {pid for pid in claims if pid in self.seen_learning} - learning
        return len(self.finished - learning)

    def finished_heard(
        self, claims: Mapping[bytes, Claim], merges_of: Callable[[bytes], int]
    ) -> int:
        """``finished_count``, counting only those whose work the owner merged in at least
        ``FINISHED_MIN_MERGES`` rounds (``merges_of``): identities that said "learning", sent one
        contribution each and then said "stopped" would otherwise shrink every merge to their
        share (fifty of them and three learners: each merge 2/27 of a step)."""
        if self.finished_count(claims) == 0:
            return 0
        learning = {pid for pid, c in claims.items() if c.learning}
        return sum(1 for pid in self.finished - learning if merges_of(pid) >= FINISHED_MIN_MERGES)


def not_recent(
    activity: LearnerActivity,
    members: AbstractSet[bytes],
    *,
    contributors: AbstractSet[bytes],
    round_seconds: float | None,
    now: float,
) -> set[bytes]:
    """Of ``members`` (learning, not found silent), those whose accepted work the owner has not
    taken within ``RECENT_ROUNDS`` of its own recent round times (``round_seconds``: no sender's
    claim; at least the silence floor), nor holds in the open round (``contributors``). Fifty
    identities sending one cheap contribution each, claiming a step time that made their own
    silence bound 300 s, held every round's quorum at half of 53 for that long. Empty when the
    owner has no pace yet, has heard none of them, or would wait for nobody (a pause of everyone
    is no reason to drop rounds or declare the fragment final)."""
    heard = {pid: activity.last_heard(pid) for pid in members}
    if round_seconds is None or all(at is None for at in heard.values()):
        return set()
    bounds = activity.bounds
    window = min(bounds.cap_s, max(bounds.floor_s, RECENT_ROUNDS * round_seconds))
    old = {pid for pid, at in heard.items() if at is None or now - at > window} - contributors
    return set() if old == set(members) else old
