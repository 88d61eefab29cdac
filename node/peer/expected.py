"""Which learners an owner's rounds wait for, and which finished: the members' records, fed to
``protocol.diloco.expected`` with the owner's activity and the time, and told to the owners'
mergers (``FragmentOwner.set_expected``). Each member newly found silent is logged once."""

from __future__ import annotations

import logging
import math
import time

from node.config import RunConfig
from node.diloco.owner import FragmentOwner
from node.peer.started import Started
from node.peer.view import MemberView
from protocol.diloco.expected import Claim, ExpectedLearners

__all__ = ["LearnerExpectations"]

log = logging.getLogger("atoll.peer")


class LearnerExpectations:
    """The node's side of ``ExpectedLearners``: reads the membership and the clock, logs, tells.
    ``view``: whom this peer routes around (``MemberView.suspects``)."""

    def __init__(self, cfg: RunConfig, started: Started, view: MemberView) -> None:
        self.started, self.view = started, view
        self.decision = ExpectedLearners(mode=cfg.mode, provisioned=cfg.peers)

    def _claims(self) -> dict[bytes, Claim]:
        membership = self.started.membership
        if membership is None:
            return {}
        return {
            pid: Claim(learning=m.record.learning, expires_at=m.expires_at)
            for pid, m in membership.members.items()
        }

    def expected_learners(self) -> int:
        """The learners a round waits for (``ExpectedLearners.expected``); 0 before membership."""
        if self.started.membership is None:
            return 0
        return self.decision.expected(self._claims(), self.view.suspects(), time.time())

    def learning_members(self) -> set[bytes]:
        """The members whose live records say they are learning, suspects left out."""
        if self.started.membership is None:
            return set()
        return self.decision.learning(self._claims(), self.view.suspects(), time.time())

    async def tell_expected(self, owner: FragmentOwner, *, at_end: bool = False) -> int:
        """Give ``owner``'s merger the learners it waits for and the finished ones it heard
        (``FragmentOwner.set_expected``); returns how many it waits for."""
        waiting = self.learner_ids_waited_for(owner, at_end=at_end)
        n = self.expected_learners() if waiting is None else len(waiting)
        await owner.set_expected(n, self.finished_learners_heard(owner), waiting)
        return n

    def learner_ids_waited_for(
        self, owner: FragmentOwner, *, at_end: bool = False
    ) -> frozenset[bytes] | None:
        """Decoupled: the learning members, less those ``owner`` finds silent
        (``ExpectedLearners.silent``); each member newly found silent is logged once. None in
        synchronous modes, which wait for ``expected_learners``, provisioned ones included."""
        if not self.decision.decoupled:
            return None
        learning = self.learning_members()
        if not learning:
            return frozenset()
        now = owner.clock()
        silent = self.decision.silent(
            learning,
            owner.activity,
            contributors=owner.merger.contributors,
            round_seconds=owner.merger.round_seconds(),
            started_at=owner.started_at,
            now=now,
            at_end=at_end,
        )
        self._log_silent(owner, learning, silent, now, at_end=at_end)
        return frozenset(learning - silent)

    @staticmethod
    def _log_silent(
        owner: FragmentOwner, learning: set[bytes], silent: set[bytes], now: float, *, at_end: bool
    ) -> None:
        """Log each member newly found silent, once: until it is heard from again or stops
        learning (the end's view and the rounds' view alternate, and neither logs the other's)."""
        activity, logged = owner.activity, owner.not_waited_for
        for pid in [
            pid
            for pid, at in logged.items()
            if pid not in learning or (activity.last_heard(pid) or -math.inf) > at
        ]:
            del logged[pid]
        for pid in silent - logged.keys():
            heard = activity.last_heard(pid)
            log.warning(
                "fragment %d: not waiting for member %s: its record says learning, but it has sent "
                "nothing for %.0f s (%s)",
                owner.fragment.index,
                pid.hex()[:8],
                activity.bound(pid, at_end=at_end) or 0.0,
                "never heard from" if heard is None else f"last heard {now - heard:.0f} s ago",
            )
            logged[pid] = now

    def finished_learners(self) -> int:
        """Decoupled: the learners seen training whose records now say they stopped
        (``ExpectedLearners.finished_count``); 0 in synchronous rounds or before membership."""
        if self.started.membership is None:
            return 0
        return self.decision.finished_count(self._claims())

    def finished_learners_heard(self, owner: FragmentOwner) -> int:
        """``finished_learners``, counting only those whose work ``owner`` merged in at least
        ``FINISHED_MIN_MERGES`` rounds (``ExpectedLearners.finished_heard``)."""
        if self.started.membership is None:
            return 0
        return self.decision.finished_heard(self._claims(), owner.merger.merges_of)
