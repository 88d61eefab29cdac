"""A pointed holder that a bounded view lacks is looked up at once (``HolderLookup``), not
skipped for the owner: a real ``Membership`` over an in-memory DHT that answers lookups by id
as a responder does (``KeyedDHT``), a learner fetching against in-memory peers (``Rig``). A
holder looks up the requesters its view lacks the same way (``VersionServer``), and a find
shares a lookup of its ids already in flight."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from node.config import RunConfig
from node.dht.membership import Membership, members_key, roster_key
from node.diloco.learner import Reach
from node.diloco.spread import POINTER_STATUS, Holdings, SpreadStats, parse_pointer
from node.peer.holder_lookup import HolderLookup
from node.peer.serving import Askers, Published, ServingConfig, VersionServer
from node.wire.admission import ADMITTED, Admitted
from protocol.dht.records import sign_record
from protocol.wire.signing import Signer
from tests.node.dht.test_membership import KeyedDHT, _record
from tests.node.diloco.test_spread import HOLDER, HOLDER2, OWNER, URLS, CountingPool, Rig
from tests.node.fakes import signer

SWARM = "s"
# member records hold bare origins: the rig's peers answer at these too
ADDR = {pid: f"http://127.0.0.1:{9100 + i}" for i, pid in enumerate(URLS)}


def bounded_view(members: list[Signer]) -> tuple[Membership, KeyedDHT]:
    """A view that reads the roster (the owner) whole and ``members`` (reachable learners, at
    ``ADDR``) only by id, as a peer outside an open swarm's roster does."""
    dht, expiry = KeyedDHT(), time.time() + 20
    dht.by_key[roster_key(SWARM)] = [
        sign_record(OWNER, roster_key(SWARM), _record(url=ADDR[OWNER.peer_id]).encode(), expiry)
    ]
    dht.by_key[members_key(SWARM)] = [
        sign_record(
            s,
            members_key(SWARM),
            _record(url=ADDR[s.peer_id], roles=("learner",)).encode(),
            expiry,
        )
        for s in members
    ]
    view = Membership(dht, SWARM, "m")  # type: ignore[arg-type]
    view.sees_all = False
    return view, dht


def url_in(view: Membership):  # type: ignore[no-untyped-def]
    def url_of(peer_id: bytes) -> str | None:
        member = view.members.get(peer_id)
        return member.record.url if member is not None else None

    return url_of


async def rig_over(view: Membership, lookup: HolderLookup | None) -> Rig:
    await view.refresh()  # the roster: the owner only
    rig = Rig()
    for pid, url in ADDR.items():
        rig.transport.add(url, rig.peers[pid])  # type: ignore[arg-type]
    rig.net.fetcher.reach = Reach(
        rig.transport,
        owner_of=lambda p: (OWNER.peer_id, URLS[OWNER.peer_id]),
        url_of=url_in(view),
        find=lookup.find if lookup is not None else None,
    )
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[OWNER.peer_id].version = rig.signed
    rig.peers[HOLDER.peer_id].version = rig.signed
    return rig


async def test_a_pointed_holder_the_view_lacks_is_looked_up_and_serves_the_version() -> None:
    view, dht = bounded_view([HOLDER, HOLDER2])
    lookup = HolderLookup(lambda: view)
    rig = await rig_over(view, lookup)
    assert HOLDER.peer_id not in view.members
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and got[0] == 0
    spread = rig.net.spread
    assert spread.from_holders == 1 and spread.holders_found == 1
    assert spread.fallbacks_asked == 0 and rig.peers[OWNER.peer_id].asked == ["next"]
    # one lookup, by id, for the holder alone (not the roster, not every member)
    assert lookup.lookups == 1
    assert dht.reads[-1] == (members_key(SWARM), (HOLDER.peer_id[:16],))


async def test_without_the_lookup_the_same_pointer_falls_back_to_the_owner() -> None:
    # what a bounded view did before: the pointed holder skipped, the owner asked again
    view, _ = bounded_view([HOLDER])
    rig = await rig_over(view, None)
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None
    assert rig.net.spread.holders_unknown == 1 and rig.net.spread.fallbacks_asked == 1
    assert rig.peers[OWNER.peer_id].asked == ["next", "next+fallback"]


async def test_every_unknown_holder_of_a_pointer_is_asked_for_in_one_lookup() -> None:
    view, dht = bounded_view([HOLDER, HOLDER2])
    lookup = HolderLookup(lambda: view)
    rig = await rig_over(view, lookup)
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id, HOLDER2.peer_id]
    rig.transport.down.add(ADDR[HOLDER.peer_id])  # found, but gone: the second one serves
    rig.peers[HOLDER2.peer_id].version = rig.signed
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and rig.net.spread.from_holders == 1
    assert lookup.lookups == 1 and rig.net.spread.holders_found == 2
    (only,) = [only for key, only in dht.reads if key == members_key(SWARM)]
    assert set(only) == {HOLDER.peer_id[:16], HOLDER2.peer_id[:16]}


async def test_an_id_that_is_no_member_is_skipped_and_not_asked_for_again_at_once() -> None:
    view, dht = bounded_view([])
    lookup = HolderLookup(lambda: view)
    rig = await rig_over(view, lookup)
    stranger = Signer.from_seed(b"s" * 32).peer_id
    rig.peers[OWNER.peer_id].pointer = [stranger]
    for _ in range(2):
        got = await rig.net.fetch(0, after=-1, wait_s=0.0)
        assert got is not None  # from the owner, as a fallback
    assert rig.net.spread.holders_unknown == 2 and rig.net.spread.holders_found == 0
    # the second fetch found it asked within LOOKUP_RETRY_S: no second request by id
    assert [only for key, only in dht.reads if key == members_key(SWARM)] == [(stranger[:16],)]


async def test_concurrent_finds_share_one_lookup_and_a_whole_view_reads_nothing() -> None:
    view, dht = bounded_view([HOLDER, HOLDER2])
    await view.refresh()
    reads = len(dht.reads)
    lookup = HolderLookup(lambda: view)
    await asyncio.gather(*(lookup.find([HOLDER.peer_id, HOLDER2.peer_id]) for _ in range(4)))
    assert lookup.lookups == 1 and len(dht.reads) == reads + 1
    assert {HOLDER.peer_id, HOLDER2.peer_id} <= set(view.members)
    await lookup.find([HOLDER.peer_id])  # held now: nothing read
    assert len(dht.reads) == reads + 1

    whole, whole_dht = bounded_view([HOLDER])
    whole.sees_all = True
    await HolderLookup(lambda: whole).find([HOLDER2.peer_id])
    assert whole_dht.reads == []  # an id a view of every member lacks is no live member
    await HolderLookup(lambda: None).find([HOLDER.peer_id])  # not serving yet: nothing to do


class Streams:
    """A transport's ``stream_reply``: the body at once."""

    async def stream_reply(self, request: Any, chunks: Any, size: int) -> web.StreamResponse:
        return web.Response(status=200, body=b"".join(bytes(c) for c in chunks))


def held_server(view: Membership, lookup: HolderLookup | None) -> VersionServer:
    """The version routes of a learner holding versions, whose view is ``view``."""
    me = signer(9).peer_id
    return VersionServer(
        ServingConfig(RunConfig(), 1, me),
        Streams(),  # type: ignore[arg-type]
        Published({}, None, {}),  # type: ignore[arg-type]
        Holdings(1, CountingPool(), fanout=2),  # type: ignore[arg-type]
        SpreadStats(),
        Askers(url_in(view), None, find=lookup.find if lookup is not None else None),
    )


def held_request(who: Signer) -> web.Request:
    request = make_mocked_request(
        "GET", "/v1/fragments/0/held?after=3&wait=0", match_info={"p": "0", "kind": "held"}
    ).clone(remote="127.0.0.1")
    request[ADMITTED] = Admitted(who.public_key, None)
    return request


async def test_a_holder_looks_up_requesters_it_lacks_and_points_later_ones_at_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: a learner pointed at a holder is mostly one the holder's bounded view lacks.
    As anonymous it was served (while no member had been) and never pointed at, so all six of
    these learners got a full upload from the holder. Now the holder looks each signer up first:
    the first two (its fanout) are served as members, the later ones pointed at them."""
    learners = [signer(40 + n) for n in range(6)]
    for n, s in enumerate(learners):
        monkeypatch.setitem(ADDR, s.peer_id, f"http://127.0.0.1:{9200 + n}")
    view, _ = bounded_view([HOLDER, *learners])
    await view.refresh()
    lookup = HolderLookup(lambda: view)
    server = held_server(view, lookup)
    await server.holdings.put(0, 4, bytearray(b"version"), 7, OWNER.peer_id)
    replies = [await server.on_fetch(held_request(s)) for s in learners]
    assert [r.status for r in replies] == [200, 200] + [POINTER_STATUS] * 4
    served = {learners[0].peer_id, learners[1].peer_id}
    assert all(set(parse_pointer(r.body)) == served for r in replies[2:])  # type: ignore[arg-type]
    assert server.spread.held_bytes == 2 * 7 and server.spread.requesters_found == 6
    # without the lookup the same six are anonymous: each one got a full upload, or (bounded
    # now) the budget's worth, and no one was pointed at another holder
    view, _ = bounded_view(learners)
    await view.refresh()
    blind = held_server(view, None)
    await blind.holdings.put(0, 4, bytearray(b"version"), 7, OWNER.peer_id)
    statuses = [(await blind.on_fetch(held_request(s))).status for s in learners]
    assert POINTER_STATUS not in statuses and blind.spread.held_uploads_max == 4


class GatedDHT(KeyedDHT):
    """Lookups by id wait for ``gate``: a lookup stays in flight until the test opens it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = 0  # lookups by id in flight

    async def get(self, key: bytes, **kw: Any) -> list:  # type: ignore[override]
        if kw.get("only"):
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return await super().get(key, **kw)


async def _holder_wanted() -> tuple[Membership, GatedDHT]:
    """A bounded view lacking ``HOLDER``, read once over a ``GatedDHT``, that wants it looked up."""
    view, plain = bounded_view([HOLDER])
    dht = GatedDHT()
    dht.by_key = plain.by_key
    view.dht = dht  # type: ignore[assignment]
    await view.refresh()
    view.want(HOLDER.peer_id)
    return view, dht


async def test_a_find_shares_the_lookup_the_membership_loop_has_in_flight() -> None:
    """The membership loop asked for a pointed holder's record a moment ago (its pass looks the
    wanted ids up) and the answer is still on its way: ``MemberLookups`` asks for an id once per
    ``LOOKUP_RETRY_S``, so the fetch's own lookup asked nothing and returned without the holder,
    which was skipped (``holders_unknown``). Now the find waits for that lookup and reads its
    answer: one request by id in all, and the holder known when the find returns."""
    view, dht = await _holder_wanted()
    loop_pass = asyncio.create_task(view.refresh_if_due())  # the membership loop's pass
    await asyncio.sleep(0.01)
    assert dht.waiting == 1  # its lookup by id is in flight
    lookup = HolderLookup(lambda: view)
    find = asyncio.create_task(lookup.find([HOLDER.peer_id]))
    await asyncio.sleep(0.01)
    assert not find.done()  # waiting for the loop's lookup, not back without the holder
    dht.gate.set()
    await asyncio.wait_for(find, 2.0)
    assert HOLDER.peer_id in view.members and lookup.shared == 1
    await loop_pass
    assert [only for key, only in dht.reads if key == members_key(SWARM) and only] == [
        (HOLDER.peer_id[:16],)
    ]


async def test_a_find_waits_for_a_lookup_in_flight_at_most_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup in flight that never answers holds a find no longer than ``SHARED_WAIT_S``."""
    import node.peer.holder_lookup as holder_lookup

    monkeypatch.setattr(holder_lookup, "SHARED_WAIT_S", 0.2)
    view, dht = await _holder_wanted()
    stuck = asyncio.create_task(view.refresh_if_due())
    await asyncio.sleep(0.01)
    lookup = HolderLookup(lambda: view)
    started = time.monotonic()
    await asyncio.wait_for(lookup.find([HOLDER.peer_id]), 2.0)
    assert 0.15 < time.monotonic() - started < 1.5
    assert HOLDER.peer_id not in view.members and lookup.shared == 0
    stuck.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stuck
    started = time.monotonic()  # a cancelled lookup leaves nothing in flight to wait for
    await asyncio.wait_for(lookup.find([HOLDER.peer_id]), 2.0)
    assert time.monotonic() - started < 0.15 and dht.waiting == 0
