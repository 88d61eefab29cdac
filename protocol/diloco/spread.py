"""Versions spread peer to peer: each holder uploads a version a bounded number of times.

Theory of operation. An owner seals each global version once, and the signature makes the bytes
the owner's whoever re-serves them (``protocol.wire.signing``: the envelope signs the message's
hash). So an owner need not upload every version to every learner. ``Fanout`` is the decision a
holder of a version (its owner, or any learner that fetched it) makes for each request: serve its
first ``fanout`` requesters itself, and point every later one at those, round robin. The peers it
pointed at do the same with the requesters pointed at them, so a version reaches n learners
through a ``fanout``-ary tree of depth about log_fanout(n), and no peer uploads it more than
``fanout`` times, whatever n is (plus the bounded fallbacks below).

A pointer is a hint, never a trust decision: the learner still checks that the owner signed what
a holder serves. A holder that does not serve within the learner's wait (gone, slow or hostile)
costs one wait; the learner then asks the owner again with ``fallback``, which the owner grants
each requester once per version. So a hostile learner that always claims a fallback costs the
owner at most the one upload per learner and version it cost before versions spread; and a
hostile holder can delay a version for the learners pointed at it by one wait, never change it.

Only requesters that can be reached (a member with an address: ``requester`` given) are served
as holders-to-be; an anonymous requester is pointed at holders when there are some, and served
otherwise (it cannot pass the version on), and its fallbacks are served (requesters without an id
cannot be told apart: they cost what every request cost before versions spread).

An upload budget (``max_uploads``) bounds all of that by construction: a holder uploads one
version at most ``max_uploads`` times its size (its full size, as an owner counts it, in whatever
forms it serves it: full, or updates over the version before), whatever the reason (direct serves, repeats, fallbacks, anonymous requesters). Past it, a requester is pointed
at the peers most likely to hold the version by now: those served (directly, then by fallback),
then those pointed at holders that did not come back for a fallback (a requester that falls back is dropped from them); with
none, it is refused, and takes a later version. Only a request that must be served passes the
budget, and is never refused (served where it would have been, past the repeats and fallbacks
allowed): a final version, which every peer has to end on (one per learner and run), and the
version an owner has just told a learner to resync to (one per refusal the owner made: in a round
that waits for every learner, no later version would come for it to take).

A small swarm is served whole (``whole_swarm``): when the learners that may ask an owner for a
version number at most ``whole_swarm``, the owner serves each of them itself instead of pointing
any at a holder, since there a pointer only adds one more transfer, after a holder has checked
its copy, to the end of every round (at 4 peers of 124M parameters, a tenth of a round's time).
It is bounded like every other serve: ``whole_swarm`` may not exceed ``max_uploads``, and the
budget still counts every upload, so an owner uploads a version at most ``max_uploads`` times
its size either way; a swarm larger than ``whole_swarm`` spreads as above.

Pure logic: versions are ints, peers are ids; the node maps ids to addresses and serves bytes.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["Fanout", "PointTo", "Refuse", "Serve", "SpreadDecision"]

MAX_POINTERS = 4  # holders named in one pointer (the learner tries them in order)
REPEATS_ALLOWED = (
    1  # direct serves of one version a requester may ask for again (a broken download)
)
MAX_LIKELY = 1024  # requesters remembered per version as likely holders (pointed, not fallen back)


@dataclass(frozen=True, slots=True)
class Serve:
    """Upload the version to this requester."""

    reason: str


@dataclass(frozen=True, slots=True)
class PointTo:
    """Tell the requester to fetch the version from these holders, in this order."""

    holders: tuple[bytes, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """Neither serve nor point: the requester had its share of this version (a 429)."""

    reason: str


SpreadDecision = Serve | PointTo | Refuse


@dataclass
class _Version:
    served: list[bytes] = field(default_factory=list)  # holders-to-be served directly, in order
    asked: collections.Counter[bytes] = field(
        default_factory=collections.Counter
    )  # direct serves per requester
    fallbacks: dict[bytes, None] = field(
        default_factory=dict
    )  # requesters served a fallback, in order
    pointed: int = 0
    anonymous: int = 0
    uploaded: int = 0  # bytes uploaded (the sizes given to ``decide``)
    unit: int = (
        0  # the size the budget is counted in (the version's full size, or its first upload's)
    )
    likely: dict[bytes, None] = field(default_factory=dict)  # pointed and not fallen back, in order


class Fanout:
    """Serve-or-point decisions of one holder for one fragment's versions.

    ``fanout`` >= 1: direct uploads per version to reachable requesters before pointing; 0 turns
    spreading off (every request is served, as an owner did before). ``versions_kept``: how many
    recent versions' bookkeeping is kept (older ones start afresh, which only allows more serves).
    ``max_uploads`` >= 1: the upload budget per version, in multiples of its size (the ``unit``
    given to ``decide``, else its first upload's size; 0: none; with spreading on only).
    ``whole_swarm`` >= 0: with at most this many learners asking (``decide``'s ``learners``), every
    one is served directly (0: never; at most ``max_uploads`` when there is a budget).
    """

    def __init__(
        self,
        fanout: int,
        *,
        versions_kept: int = 4,
        max_uploads: float = 0.0,
        whole_swarm: int = 0,
    ) -> None:
        if fanout < 0:
            raise ValueError(f"fanout must be >= 0 (0 turns spreading off), got {fanout}")
        if versions_kept < 1:
            raise ValueError(f"versions_kept must be >= 1, got {versions_kept}")
        if max_uploads != 0 and not max_uploads >= max(fanout, 1):
            raise ValueError(
                f"max_uploads must be 0 (no budget) or at least the fanout ({max(fanout, 1)}), "
                f"got {max_uploads}"
            )
        if whole_swarm < 0 or (max_uploads != 0 and whole_swarm > max_uploads):
            raise ValueError(
                f"whole_swarm must be >= 0 and at most max_uploads ({max_uploads:g}) when there "
                f"is a budget, got {whole_swarm}"
            )
        self.fanout, self.versions_kept, self.max_uploads = fanout, versions_kept, max_uploads
        self.whole_swarm = whole_swarm
        self._versions: collections.OrderedDict[int, _Version] = collections.OrderedDict()
        self.served = 0  # direct uploads decided, all versions
        self.pointed = 0  # pointers given, all versions
        self.over_budget = 0  # requests a spent budget pointed elsewhere or refused, all versions

    def decide(
        self,
        version: int,
        requester: bytes | None,
        *,
        fallback: bool = False,
        size: int = 1,
        unit: int = 0,
        must: bool = False,
        direct: bool = False,
        learners: int = 0,
    ) -> SpreadDecision:
        """What to do with a request for ``version``. ``requester``: the id of a reachable
        member (None for one that cannot serve others); ``fallback``: the requester says the
        holders it was pointed at failed it; ``size``: the bytes a serve would upload (what the
        budget counts); ``unit``: the size the budget is counted in (an owner's full version,
        whichever form it serves; 0: the version's first upload); ``must``: serve it even past
        the budget, and never refuse it (a final version); ``direct``: serve it from here past the
        budget, never point it at holders either (a version owed to a resync: the learner's round
        waits on it, and the holders it would be pointed at may be stuck in the same round,
        waiting for it too); ``learners``: how many learners may ask for it (0: unknown), which
        decides whether the swarm is served whole (``fanout_for``)."""
        if self.fanout == 0:
            return self._serve("spreading is off: every learner is served")
        state = self._state(version)
        if fallback and requester is not None:
            state.likely.pop(requester, None)  # it did not get the version where it was pointed
        state.unit = state.unit or unit
        spent = (
            not must
            and self.max_uploads > 0
            and state.unit > 0
            and state.uploaded + size > self.max_uploads * state.unit
        )
        if direct:
            decision: SpreadDecision = self._serve(f"version {version}: owed, served from here")
        else:
            decision = self._decide(
                state, version, requester, fallback, spent, self.fanout_for(learners)
            )
        if must and isinstance(decision, Refuse):
            decision = self._serve(f"{decision.reason}; served all the same (it must be)")
        if isinstance(decision, Serve):
            state.unit = state.unit or size
            state.uploaded += size
        return decision

    def fanout_for(self, learners: int) -> int:
        """Direct serves of a version with ``learners`` learners that may ask for it (0: unknown):
        all of them in a swarm of at most ``whole_swarm``, else ``fanout``."""
        if self.fanout and 0 < learners <= self.whole_swarm:
            return max(self.fanout, learners)
        return self.fanout

    def _decide(
        self,
        state: _Version,
        version: int,
        requester: bytes | None,
        fallback: bool,
        spent: bool,
        fanout: int,
    ) -> SpreadDecision:
        """The decision, state updated for a serve; ``spent``: a serve would pass the budget;
        ``fanout``: the direct serves this version gets."""
        if (
            requester is None and fallback
        ):  # cannot be told apart: served, as before versions spread
            return (
                self._spent(state, version, requester)
                if spent
                else self._serve(f"version {version}: fallback for a requester that cannot hold it")
            )
        if requester is not None and fallback:
            if requester in state.fallbacks:
                return Refuse(
                    f"version {version}: a fallback was served to this peer already; "
                    "wait for the next version"
                )
            if spent:
                return self._spent(state, version, requester)
            state.fallbacks[requester] = None
            return self._serve(
                f"version {version}: fallback {len(state.fallbacks)} (pointed holders failed)"
            )
        if requester is not None and requester in state.asked:
            if state.asked[requester] > REPEATS_ALLOWED:
                return self._point(state, version, requester, "asked again past its repeats")
            if spent:
                return self._spent(state, version, requester)
            state.asked[requester] += 1
            return self._serve(f"version {version}: served again (a repeat of a direct serve)")
        if requester is not None and len(state.served) < fanout:
            if spent:
                return self._spent(state, version, requester)
            state.served.append(requester)
            state.asked[requester] = 1
            return self._serve(f"version {version}: direct serve {len(state.served)}/{fanout}")
        if not state.served:
            if spent:
                return self._spent(state, version, requester)
            state.anonymous += 1
            return self._serve(
                f"version {version}: no holder yet; anonymous serve {state.anonymous}"
            )
        return self._point(
            state, version, requester, f"{len(state.served)}/{fanout} direct serves done"
        )

    def _spent(self, state: _Version, version: int, requester: bytes | None) -> SpreadDecision:
        """Past the budget: point at the likeliest holders (not the requester), or refuse."""
        self.over_budget += 1
        why = (
            f"version {version}: {state.uploaded} bytes uploaded already "
            f"(budget {self.max_uploads:g}x its size, {state.unit} bytes)"
        )
        likely = [
            h
            for h in dict.fromkeys((*state.served, *state.fallbacks, *state.likely))
            if h != requester
        ]
        if not likely:
            return Refuse(f"{why}; no holder to point at: take a later version")
        start = state.pointed % len(likely)
        state.pointed += 1
        self.pointed += 1
        ordered = tuple((likely[start:] + likely[:start])[:MAX_POINTERS])
        return PointTo(ordered, f"{why}: pointed at {len(ordered)} likely holder(s)")

    def _serve(self, reason: str) -> Serve:
        self.served += 1
        return Serve(reason)

    def _point(
        self, state: _Version, version: int, requester: bytes | None, why: str
    ) -> SpreadDecision:
        holders = [h for h in state.served if h != requester]
        if not holders:
            return Refuse(f"version {version}: no other holder to point at ({why})")
        start = state.pointed % len(holders)
        state.pointed += 1
        self.pointed += 1
        if (
            requester is not None
            and requester not in state.served
            and len(state.likely) < MAX_LIKELY
        ):
            state.likely[requester] = None
        ordered = tuple((holders[start:] + holders[:start])[:MAX_POINTERS])
        return PointTo(ordered, f"version {version}: pointed at {len(ordered)} holder(s) ({why})")

    def _state(self, version: int) -> _Version:
        state = self._versions.get(version)
        if state is None:
            state = self._versions[version] = _Version()
            while len(self._versions) > self.versions_kept:
                self._versions.popitem(last=False)
        return state
