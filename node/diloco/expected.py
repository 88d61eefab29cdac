"""Which learners an owner's rounds wait for, and which finished (mixed into ``PeerNode`` through
``SwarmPresence``): the members' records read against what each owner heard from them
(``protocol.diloco.activity``), told to the owners' mergers (``FragmentOwner.set_expected``)."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.config import RunConfig
    from node.dht.membership import Membership
    from node.diloco.owner import FragmentOwner

log = logging.getLogger("atoll.peer")

RECENT_ROUNDS = (
    3.0  # a learner's accepted work older than this many of the owner's round times: not waited for
)
FINISHED_MIN_MERGES = (
    2  # a finished learner counts in a merge's share once its work was in this many merges
)


class ExpectedLearners:
    """The learners waited for, and those that finished, from the members' records."""

    cfg: RunConfig
    membership: Membership | None
    _seen_learning: set[bytes]
    _finished: set[bytes]

    def suspects(self) -> set[bytes]:
        raise NotImplementedError

    def expected_learners(self) -> int:
        """The learners a round waits for. Decoupled: the live ones. Synchronous modes are not
        elastic (synchronous DiLoCo, the paper's baseline): every provisioned learner
        (``--peers``, or as many as were ever seen) but those that finished training; a learner
        that died is waited for until it is back."""
        if self.membership is None:
            return 0
        if self.cfg.mode != "decoupled":
            for pid, m in self.membership.members.items():
                (self._seen_learning if m.record.learning else self._finished).add(pid)
            return max(self.cfg.peers, len(self._seen_learning | self._finished)) - len(
                self._finished
            )
        return len(self.learning_members())

    def learning_members(self) -> set[bytes]:
        """The members whose live records say they are learning, suspects left out."""
        if self.membership is None:
            return set()
        now = time.time()
        return {
            pid
            for pid, m in self.membership.members.items()
            if m.record.learning and m.expires_at > now
        } - self.suspects()

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
        """Decoupled: the learning members, less those ``owner`` finds silent: a record's
        "learning" is a claim, and members that make it and send nothing must not raise a merge's
        quorum past what the learners at work can reach, nor hold the end of a run
        (``protocol.diloco.activity``). Each member newly found silent is logged once. None in
        synchronous modes, which wait for ``expected_learners``, provisioned ones included."""
        if self.cfg.mode != "decoupled":
            return None
        learning = self.learning_members()
        if not learning:
            return frozenset()
        now = owner.clock()
        activity = owner.activity
        activity.seen(learning, now)
        # a member whose work waits in the open round is not silent: it waits on us (in a round
        # held below its quorum its next contribution would be the same round's, refused)
        silent = (
            activity.silent(learning, since=owner.started_at, now=now, at_end=at_end)
            - owner.merger.contributors
        )
        if not at_end:  # and of the rest, those whose work this owner took lately
            silent |= self._not_recent(owner, learning - silent, now)
        # logged once a silence: until the member is heard from again or stops learning (the
        # end's view and the rounds' view alternate, and neither must log the other's again)
        logged = owner.not_waited_for
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
        return frozenset(learning - silent)

    def _not_recent(self, owner: FragmentOwner, members: set[bytes], now: float) -> set[bytes]:
        """Of ``members`` (learning, not found silent), those whose accepted work this owner has not
        taken within ``RECENT_ROUNDS`` of its own recent round times (``FragmentMerger.round_seconds``,
        no sender's claim; at least the silence floor), nor holds in the open round. A record's
        "learning" and a contribution's step time are claims: fifty identities sending one cheap
        contribution each, with a step time that made their own silence bound 300 s, held every
        round's quorum at half of 53 for that long (a merge rate of 13-56 %). Empty when the owner
        has no pace yet, has heard none of them, or would wait for nobody (a pause of everyone is
        no reason to drop rounds or declare the fragment final: ``set_expected(0)``)."""
        rounds = owner.merger.round_seconds()
        activity = owner.activity
        heard = {pid: activity.last_heard(pid) for pid in members}
        if rounds is None or all(at is None for at in heard.values()):
            return set()
        window = min(activity.bounds.cap_s, max(activity.bounds.floor_s, RECENT_ROUNDS * rounds))
        old = {
            pid for pid, at in heard.items() if at is None or now - at > window
        } - owner.merger.contributors
        return set() if old == members else old

    def finished_learners(self) -> int:
        """Decoupled: the learners seen training whose records now say they stopped. A merge
        counts them in its share of the learners as contributing nothing (``Decision.scale``):
        a straggler training on after the others finished then moves each fragment by its share
        of a step, not by its whole work. Under outer momentum whole momentum steps of its work
        alone took a 4-peer swarm from 1.25 to 1.40 nats/byte in its last 100 steps
        (docs/benchmarks.md, "Decoupled DiLoCo with outer momentum"); with plain averaging a
        lone straggler's merges made each fragment that island's, undoing the swarm's average
        (docs/results.md, "The stragglers' tail under plain averaging"). 0 in synchronous
        rounds, which wait for every learner."""
        if self.membership is None or self.cfg.mode != "decoupled":
            return 0
        learning = {pid for pid, m in self.membership.members.items() if m.record.learning}
        self._seen_learning |= learning
        self._finished |= {
            pid for pid in self.membership.members if pid in self._seen_learning
        } - learning
        return len(self._finished - learning)

    def finished_learners_heard(self, owner: FragmentOwner) -> int:
        """``finished_learners``, counting only those whose work ``owner`` merged in at least
        ``FINISHED_MIN_MERGES`` rounds: a record that said learning and then stopped is a claim
        too, and identities that made it and never contributed, or contributed once, would shrink
        every merge to its share of them (fifty of them and three learners: each merge 2/27 of a
        step)."""
        if self.finished_learners() == 0:
            return 0
        assert self.membership is not None
        learning = {pid for pid, m in self.membership.members.items() if m.record.learning}
        # merged in FINISHED_MIN_MERGES rounds at least: identities that sent one contribution
        # each and then said "stopped" would otherwise shrink every merge to its share of them
        return sum(
            1
            for pid in self._finished - learning
            if owner.merger.merges_of(pid) >= FINISHED_MIN_MERGES
        )
