"""Iterative Kademlia lookup as a state object the node drives.

Theory of operation (Maymounkov & Mazières, "Kademlia", IPTPS 2002, section 2.3). To find the
``k`` peers nearest a ``target`` id, a peer starts from the nearest contacts it knows and asks
them, ``alpha`` at a time, for the contacts *they* know nearest the target. Every answer adds
contacts to a shortlist ordered by XOR distance; the next queries go to the nearest contacts not
yet asked. The lookup ends when the ``k`` nearest contacts that have not failed have all answered:
nothing nearer can then be learned except through peers farther away, whose own buckets cover
the target's neighbourhood less well. A value lookup (FIND_VALUE) also ends as soon as
``min_values`` peers returned records for the key.

This module does no I/O. The node calls ``next_queries(now)`` and sends a FindNode/FindValue to
each contact returned, then reports each outcome with ``on_response`` or ``on_failure`` (a timeout
is a failure; the node owns the timer). At most ``alpha`` queries are in flight at once; the
paper's "resend to all k nearest unqueried when a round made no progress" falls out of keeping
``alpha`` in flight over the ``k``-nearest window. Answers from peers we did not ask, or asked
already, are a remote's misbehaviour: they are ignored and counted, never raised. Contacts in an
answer are deduplicated and capped at ``k``; ones without an address (undialable) are skipped.
The node verifies records before handing them in.

Hops. A contact from ``initial`` has depth 0; one first learned from the answer of a peer of
depth ``d`` has depth ``d + 1`` (the minimum over all the ways it was learned). Querying a peer
of depth ``d`` is hop ``d + 1``. ``LookupResult.hops`` is the largest hop among the peers that
make up the answer: the ``k`` nearest that answered, or for a value lookup the peers that
returned the value. It is the number of sequential round trips the answer needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from protocol.dht.records import SignedRecord
from protocol.errors import LocalProtocolError
from protocol.ids import ID_BYTES
from protocol.wire.messages import PeerInfo

__all__ = ["Lookup", "LookupResult", "ResponseNote"]


class _State(Enum):
    UNQUERIED = "unqueried"
    IN_FLIGHT = "in flight"
    ANSWERED = "answered"
    FAILED = "failed"


@dataclass(slots=True)
class _Candidate:
    contact: PeerInfo
    distance: int
    depth: int
    state: _State = _State.UNQUERIED


@dataclass(frozen=True, slots=True)
class ResponseNote:
    """What ``on_response`` made of an answer: accepted or not, new contacts, and why."""

    accepted: bool
    new_contacts: int
    reason: str


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The outcome of a lookup.

    ``closest``: up to ``k`` peers that answered, nearest the target first. ``value``: every
    record returned, in arrival order (empty for a node lookup or when none was found).
    ``closest_without_value``: the nearest peer that answered without the value, where a value
    lookup may cache what it found. ``hops``: see the module docstring. ``queried``: queries
    sent. ``failed``: queries that failed. ``ignored``: answers refused as unsolicited.
    ``sources``: peers that answered with the value, counting those that only said the records
    they hold are all known to the asker (a delta read, ``FindValue.known``).
    """

    closest: list[PeerInfo]
    value: tuple[SignedRecord, ...]
    closest_without_value: PeerInfo | None
    hops: int
    queried: int
    failed: int
    ignored: int
    sources: int = 0

    @property
    def found(self) -> bool:
        return bool(self.value) or self.sources > 0


class Lookup:
    """An iterative FIND_NODE (or FIND_VALUE) for ``target``. See the module docstring."""

    def __init__(
        self,
        target: bytes,
        initial: Iterable[PeerInfo],
        *,
        k: int = 20,
        alpha: int = 3,
        find_value: bool = False,
        min_values: int = 1,
        own_id: bytes | None = None,
    ) -> None:
        if len(target) != ID_BYTES:
            raise LocalProtocolError(f"target must be {ID_BYTES} bytes, got {len(target)}")
        if k < 1 or alpha < 1 or min_values < 1:
            raise LocalProtocolError(
                f"need k, alpha, min_values >= 1; got {k}, {alpha}, {min_values}"
            )
        self.target = target
        self.k, self.alpha = k, alpha
        self.find_value, self.min_values = find_value, min_values
        self._t = int.from_bytes(target, "big")
        self._own = own_id
        self._cands: dict[bytes, _Candidate] = {}
        self._order: list[tuple[int, bytes]] = []  # (distance, peer id), nearest first
        self._values: list[SignedRecord] = []
        self._value_sources: list[bytes] = []
        self._queried = self._failed = self._ignored = self._in_flight = 0
        for contact in initial:
            self._learn(contact, depth=0)

    # ── driving ─────────────────────────────────────────────────────────────────────────────

    def next_queries(self, now: float) -> list[PeerInfo]:
        """Contacts to query now, nearest first; marks them in flight. Empty when done."""
        if self.done:
            return []
        room = self.alpha - self.in_flight
        picked: list[PeerInfo] = []
        for cand in self._window():
            if room <= 0:
                break
            if cand.state is _State.UNQUERIED:
                cand.state = _State.IN_FLIGHT
                picked.append(cand.contact)
                room -= 1
        self._queried += len(picked)
        self._in_flight += len(picked)
        return picked

    def on_response(
        self,
        peer_id: bytes,
        contacts: Sequence[PeerInfo],
        now: float,
        value: Sequence[SignedRecord] | None = None,
        omitted: int = 0,
    ) -> ResponseNote:
        """``peer_id`` answered with ``contacts`` (and, for FIND_VALUE, verified ``value`` and
        the number of records it holds that the asker named as known, ``omitted``)."""
        cand = self._cands.get(peer_id)
        if cand is None or cand.state is not _State.IN_FLIGHT:
            self._ignored += 1
            state = "never queried" if cand is None else cand.state.value
            return ResponseNote(False, 0, f"unsolicited answer from {peer_id.hex()[:16]} ({state})")
        cand.state = _State.ANSWERED
        self._in_flight -= 1
        if value or (self.find_value and omitted > 0):
            self._values.extend(value or ())
            self._value_sources.append(peer_id)
        unique = _dedupe(contacts)
        new = sum(self._learn(c, cand.depth + 1) for c in unique[: self.k])
        dropped = max(0, len(unique) - self.k)
        reason = f"{new} new of {len(contacts)} contacts" + (
            f", {dropped} over cap k" if dropped else ""
        )
        return ResponseNote(True, new, reason)

    def on_failure(self, peer_id: bytes, now: float) -> None:
        """The query to ``peer_id`` failed or timed out. Raises if it was not in flight."""
        cand = self._cands.get(peer_id)
        if cand is None or cand.state is not _State.IN_FLIGHT:
            raise LocalProtocolError(f"no query to {peer_id.hex()[:16]} is in flight")
        cand.state = _State.FAILED
        self._in_flight -= 1
        self._failed += 1

    # ── state ───────────────────────────────────────────────────────────────────────────────

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def pending(self) -> list[PeerInfo]:
        """Contacts with a query in flight."""
        return [c.contact for c in self._cands.values() if c.state is _State.IN_FLIGHT]

    @property
    def done(self) -> bool:
        """True once a value was found (FIND_VALUE) or the k nearest live contacts all answered."""
        if self.find_value and len(self._value_sources) >= self.min_values:
            return True
        return all(c.state is _State.ANSWERED for c in self._window())

    def result(self) -> LookupResult:
        """The answer so far (final once ``done``)."""
        answered = [c for c in self._ordered() if c.state is _State.ANSWERED]
        closest = answered[: self.k]
        without = next(
            (c.contact for c in answered if c.contact.peer_id not in self._value_sources), None
        )
        makers = [self._cands[p] for p in self._value_sources] if self._value_sources else closest
        return LookupResult(
            closest=[c.contact for c in closest],
            value=tuple(self._values),
            closest_without_value=without,
            hops=max((c.depth + 1 for c in makers), default=0),
            queried=self._queried,
            failed=self._failed,
            ignored=self._ignored,
            sources=len(self._value_sources),
        )

    # ── internals ───────────────────────────────────────────────────────────────────────────

    def _ordered(self) -> list[_Candidate]:
        return [self._cands[p] for _, p in self._order]

    def _window(self) -> Iterator[_Candidate]:
        """The k nearest candidates that have not failed, nearest first."""
        left = self.k
        for _, p in self._order:
            cand = self._cands[p]
            if cand.state is not _State.FAILED:
                yield cand
                left -= 1
                if left == 0:
                    return

    def _learn(self, contact: PeerInfo, depth: int) -> bool:
        """Add ``contact`` to the shortlist; True if it was new."""
        if contact.peer_id == self._own or not contact.address:
            return False
        known = self._cands.get(contact.peer_id)
        if known is not None:
            known.depth = min(known.depth, depth)
            return False
        d = self._t ^ int.from_bytes(contact.peer_id, "big")
        self._cands[contact.peer_id] = _Candidate(contact, d, depth)
        bisect.insort(self._order, (d, contact.peer_id))
        return True


def _dedupe(contacts: Sequence[PeerInfo]) -> list[PeerInfo]:
    seen: set[bytes] = set()
    out = []
    for c in contacts:
        if c.peer_id not in seen:
            seen.add(c.peer_id)
            out.append(c)
    return out
