"""A learner fetching versions peer to peer (``IslandNet.fetch`` with pointers, ``Holdings``),
against in-memory peers: what a holder serves counts only when the fragment's owner signed it,
pointers name peer ids (never addresses), and when the holders fail the owner is asked again."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgpack
import pytest
import torch

from node.diloco.fetching import VersionRefused
from node.diloco.island import Island, IslandConfig
from node.diloco.learner import IslandNet, LearnerNetConfig, OwnerLinks, Reach
from node.diloco.spread import (
    POINTER_STATUS,
    VERSION_HEADER,
    Holdings,
    Spreading,
    encode_pointer,
    parse_pointer,
)
from protocol.errors import DecodeError, RemoteProtocolError
from protocol.wire.messages import FragmentState
from protocol.wire.signing import verify_sealed
from tests.node.fakes import (
    SWARM,
    FakeClock,
    MemoryTransport,
    flat_of,
    make_owner,
    sealed_bytes,
    shapes_of,
    signer,
    tiny_model,
    tiny_plan,
)

OWNER, HOLDER, HOLDER2, ME = signer(1), signer(2), signer(3), signer(7)
URLS = {
    OWNER.peer_id: "http://owner.test",
    HOLDER.peer_id: "http://holder.test",
    HOLDER2.peer_id: "http://holder2.test",
}


@dataclasses.dataclass
class FakePeer:
    """Answers GETs for fragment versions: ``next`` from the owner (a pointer unless
    ``fallback=1``), ``held`` from a holder (the bytes it holds, or a pointer)."""

    version: bytes = b""  # what ``next`` (with fallback) or ``held`` serves
    pointed: int | None = None  # the version a pointer names (its Atoll-Version header)
    pointer: list[bytes] | None = None  # answer with a pointer to these ids instead
    raw_pointer: bytes | None = None
    spent: list[bytes] | None = None  # an owner whose budget is spent: fallbacks pointed here
    busy: bool = False  # answer 429
    asked: list[str] = dataclasses.field(default_factory=list)

    async def handle(
        self, method: str, path: str, query: dict[str, str], body: bytes
    ) -> tuple[int, bytes]:
        kind = path.rsplit("/", 1)[-1]
        self.asked.append(kind + ("+fallback" if query.get("fallback") == "1" else ""))
        if self.busy:
            return 429, b'{"error": "Busy"}'
        if self.raw_pointer is not None:
            return POINTER_STATUS, self.raw_pointer
        if self.spent is not None and query.get("fallback") == "1":
            return POINTER_STATUS, encode_pointer(tuple(self.spent))
        if self.pointer is not None and query.get("fallback") != "1":
            return POINTER_STATUS, encode_pointer(tuple(self.pointer))
        return (200, self.version) if self.version else (204, b"")


class HeaderTransport(MemoryTransport):
    """``MemoryTransport`` that also answers a pointer's version header."""

    async def request(
        self, method: str, url: str, **kw: Any
    ) -> tuple[int, bytearray, int, dict[str, str]]:
        status, buf, used, headers = await super().request(method, url, **kw)
        peer = self.peers[url.split("/v1/")[0]]
        if status == POINTER_STATUS and getattr(peer, "pointed", None) is not None:
            headers = {VERSION_HEADER: str(peer.pointed)}
        return status, buf, used, headers


class Rig:
    def __init__(self) -> None:
        model = tiny_model()
        plan = tiny_plan(model)
        self.shapes = shapes_of(model, plan)
        self.owner = make_owner(
            plan, self.shapes, 0, flat_of(model, plan, 0), FakeClock(), who=OWNER
        )
        self.signed = self.owner.latest.tobytes()  # version 0, sealed by the owner
        island = Island(
            model,
            torch.optim.AdamW(model.parameters()),
            plan,
            lambda _o: None,
            IslandConfig(inner_steps=4),
        )
        self.transport = HeaderTransport()
        self.peers = {pid: FakePeer() for pid in URLS}
        for pid, url in URLS.items():
            self.transport.add(url, self.peers[pid])  # type: ignore[arg-type]
        self.holdings = Holdings(len(plan.fragments), self.transport.pool, fanout=2)  # type: ignore[arg-type]
        self.net = IslandNet(
            island,
            LearnerNetConfig(swarm=SWARM, shapes=self.shapes),
            OwnerLinks(
                ME,
                Reach(
                    self.transport,
                    owner_of=lambda p: (OWNER.peer_id, URLS[OWNER.peer_id]),
                    url_of=URLS.get,
                ),
            ),
            spreading=Spreading(holdings=self.holdings),
        )

    def forged(self) -> bytes:
        """The same state, sealed by the holder instead of the owner."""
        state = verify_sealed(memoryview(self.signed), max_size=1 << 24).message
        assert isinstance(state, FragmentState)
        return sealed_bytes(state, HOLDER)


async def test_a_pointed_learner_takes_the_owners_version_from_a_holder_and_keeps_it() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[HOLDER.peer_id].version = rig.signed
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and got[0] == 0
    assert torch.equal(got[1], rig.owner.theta)
    assert rig.net.spread.from_holders == 1 and rig.net.spread.fallbacks_asked == 0
    assert rig.peers[OWNER.peer_id].asked == ["next"] and rig.peers[HOLDER.peer_id].asked == [
        "held"
    ]
    assert rig.holdings.version(0) == 0  # kept, to serve the learners pointed at us


async def test_a_version_a_holder_signed_itself_is_refused_and_the_owner_asked_again() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[OWNER.peer_id].version = rig.signed
    rig.peers[HOLDER.peer_id].version = rig.forged()
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and torch.equal(got[1], rig.owner.theta)
    assert rig.net.spread.bad_from_holders == 1 and rig.net.spread.fallbacks_asked == 1
    assert rig.peers[OWNER.peer_id].asked == ["next", "next+fallback"]


async def test_pointers_are_followed_from_holder_to_holder() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[HOLDER.peer_id].pointer = [
        HOLDER2.peer_id,
        OWNER.peer_id,
    ]  # the owner is never asked as a holder
    rig.peers[HOLDER2.peer_id].version = rig.signed
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and rig.net.spread.from_holders == 1
    assert rig.peers[HOLDER2.peer_id].asked == ["held"] and rig.peers[OWNER.peer_id].asked == [
        "next"
    ]


async def test_ids_the_learner_does_not_know_are_skipped_for_the_owner() -> None:
    rig = Rig()
    stranger = signer(50).peer_id
    rig.peers[OWNER.peer_id].pointer = [stranger]
    rig.peers[OWNER.peer_id].version = rig.signed
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert (
        got is not None and rig.net.spread.fallbacks_asked == 1 and rig.net.spread.from_holders == 0
    )


async def test_a_holder_that_serves_nothing_costs_one_ask_then_the_owner_serves() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[OWNER.peer_id].version = rig.signed
    rig.transport.down.add(URLS[HOLDER.peer_id])
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and rig.net.spread.fallbacks_asked == 1
    assert rig.net.spread.holders_failed == 1 and rig.net.spread.holders_empty == 0
    rig.transport.down.clear()  # up, but holding nothing newer: a 204 within its wait
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and rig.net.spread.fallbacks_asked == 2
    assert rig.net.spread.holders_empty == 1 and rig.net.spread.holders_exhausted == 0
    assert rig.net.spread.holders_ran_out == 2


async def test_the_final_version_comes_from_a_holder_when_the_pointer_names_it() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[OWNER.peer_id].pointed = 0
    rig.peers[HOLDER.peer_id].version = rig.signed
    got = await rig.net.fetch(0, after=-1, wait_s=0.0, final=True)
    assert got is not None and got[0] == 0 and rig.net.spread.from_holders == 1


async def test_past_the_owners_budget_a_fallback_is_asked_of_the_holders_it_names() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[OWNER.peer_id].spent = [HOLDER2.peer_id]
    rig.peers[OWNER.peer_id].version = rig.signed  # what it would serve, were its budget not spent
    rig.transport.down.add(URLS[HOLDER.peer_id])
    rig.peers[HOLDER2.peer_id].version = rig.signed
    got = await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and torch.equal(got[1], rig.owner.theta)
    assert rig.peers[OWNER.peer_id].asked == ["next", "next+fallback"]
    assert rig.peers[HOLDER2.peer_id].asked == ["held+fallback"]
    assert rig.net.spread.from_holders == 1 and rig.net.spread.fallbacks_asked == 1


async def test_past_the_owners_budget_with_no_holder_serving_the_version_is_refused_not_bad() -> (
    None
):
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    rig.peers[OWNER.peer_id].spent = [HOLDER2.peer_id]
    rig.transport.down.add(URLS[HOLDER.peer_id])
    with pytest.raises(VersionRefused, match="spent"):
        await rig.net.fetch(0, after=-1, wait_s=0.0)
    assert rig.peers[HOLDER2.peer_id].asked == ["held+fallback"]
    rig.peers[OWNER.peer_id] = FakePeer(busy=True)
    rig.transport.add(URLS[OWNER.peer_id], rig.peers[OWNER.peer_id])  # type: ignore[arg-type]
    with pytest.raises(VersionRefused, match="429"):
        await rig.net.fetch(0, after=-1, wait_s=0.0)


async def test_a_refused_version_is_waited_out_and_not_counted_as_a_bad_one() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].busy = True
    poll = asyncio.create_task(rig.net._poll_loop(0))
    await asyncio.sleep(0.5)
    poll.cancel()
    with pytest.raises(asyncio.CancelledError):
        await poll
    assert rig.net.spread.refusals >= 2 and rig.net.stats.bad_versions == 0


async def test_a_final_pointer_without_a_version_is_a_remote_error() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].pointer = [HOLDER.peer_id]
    with pytest.raises(RemoteProtocolError, match="names no version"):
        await rig.net.fetch(0, after=-1, wait_s=0.0, final=True)


@pytest.mark.parametrize(
    "body", [b"\x92\xa1x", msgpack.packb([b"short"]), b"\xff" * 400, msgpack.packb([bytes(32)] * 9)]
)
def test_malformed_pointers_are_refused(body: bytes) -> None:
    with pytest.raises(DecodeError):
        parse_pointer(body)


async def test_a_malformed_pointer_from_the_owner_is_a_remote_error() -> None:
    rig = Rig()
    rig.peers[OWNER.peer_id].raw_pointer = b"\xc1garbage"
    with pytest.raises(RemoteProtocolError):
        await rig.net.fetch(0, after=-1, wait_s=0.0)


class CountingPool:
    def __init__(self) -> None:
        self.given: list[bytearray] = []

    def give(self, buf: bytearray) -> None:
        self.given.append(buf)


async def test_a_held_buffer_goes_back_to_the_pool_only_when_replaced_and_no_longer_read() -> None:
    pool = CountingPool()
    held = Holdings(1, pool, fanout=2)  # type: ignore[arg-type]
    first, second, old = bytearray(b"v1"), bytearray(b"v2"), bytearray(b"v0")
    await held.put(0, 1, first, 2, OWNER.peer_id)
    await held.put(0, 0, old, 2, OWNER.peer_id)  # older than held: straight back
    assert pool.given == [old]
    reading = await held.wait_after(0, 0, 0.0)
    assert reading is not None and reading.version == 1
    reading.readers += 1  # a stream of version 1 is under way
    await held.put(0, 2, second, 2, OWNER.peer_id)
    assert pool.given == [old]  # not while it is read
    reading.readers -= 1
    held._release(reading)
    assert pool.given == [old, first]


async def test_waiting_for_a_held_version_returns_when_it_arrives() -> None:
    held = Holdings(1, CountingPool(), fanout=2)  # type: ignore[arg-type]
    waiter = asyncio.create_task(held.wait_after(0, 3, 5.0))
    await asyncio.sleep(0)
    await held.put(0, 4, bytearray(b"x"), 1, OWNER.peer_id)
    got = await waiter
    assert got is not None and got.version == 4
    assert await held.wait_after(0, 4, 0.0) is None


async def test_a_stopping_holder_answers_its_waiting_polls_at_once() -> None:
    """A peer that stops answers the long-polls it holds (204) instead of leaving its server to
    wait them out: a waiter returns None as soon as the holdings close, even with the version it
    waits for held, and a later poll does not wait."""
    held = Holdings(1, CountingPool(), fanout=2)  # type: ignore[arg-type]
    waiter = asyncio.create_task(held.wait_after(0, 3, 30.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    await held.close()
    assert await asyncio.wait_for(waiter, 5.0) is None
    await held.put(0, 4, bytearray(b"x"), 1, OWNER.peer_id)
    assert await asyncio.wait_for(held.wait_after(0, 3, 30.0), 5.0) is None


async def test_a_holder_done_fetching_answers_polls_for_what_it_lacks_at_once() -> None:
    """At a swarm's end a holder that fetched its final versions gets no newer one: a learner
    pointed at it for a version it lacks is answered at once (it then asks the owner), not after
    the holder wait; what it holds is still served."""
    held = Holdings(2, CountingPool(), fanout=2)  # type: ignore[arg-type]
    await held.put(1, 7, bytearray(b"x"), 1, OWNER.peer_id)
    waiter = asyncio.create_task(held.wait_after(0, 3, 30.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    await held.done_fetching()
    assert await asyncio.wait_for(waiter, 5.0) is None
    assert await asyncio.wait_for(held.wait_after(0, 3, 30.0), 5.0) is None
    got = await asyncio.wait_for(held.wait_after(1, 6, 30.0, OWNER.peer_id), 5.0)
    assert got is not None and got.version == 7
    assert await asyncio.wait_for(held.wait_after(1, 7, 30.0), 5.0) is None


async def test_a_holder_serves_only_versions_signed_by_the_owner_the_asker_names() -> None:
    """While ownership moves, views differ: a holder whose newest version is another owner's
    does not serve it to a learner that names its own view of the owner (it would be refused)."""
    held = Holdings(1, CountingPool(), fanout=2)  # type: ignore[arg-type]
    await held.put(0, 5, bytearray(b"x"), 1, HOLDER.peer_id)
    assert await held.wait_after(0, 1, 0.0, OWNER.peer_id) is None
    got = await held.wait_after(0, 1, 0.0, HOLDER.peer_id)
    assert got is not None and got.version == 5


def test_an_owner_counts_each_version_it_publishes_or_serves_once() -> None:
    """The report's ``owner_upload_per_published`` divides by every distinct version an owner
    served, those it took over included, so a successor is not charged for versions it did not merge."""
    from node.diloco.spread import SpreadStats
    from node.run.report import spread_summary

    stats = SpreadStats()
    for fragment, version in [(0, 1), (0, 1), (0, 2), (1, 2), (0, 2)]:
        stats.owned_version(fragment, version, 100)
    stats.owner_bytes = 900
    assert stats.published_bytes == 300 and "_versions" not in stats.as_dict()
    summary = spread_summary(
        [
            {"index": 0, "spread": stats.as_dict(), "replica_bytes": 300},
            {"index": 1, "spread": SpreadStats().as_dict()},
        ]
    )
    assert summary["per_peer"]["0"]["owner_upload_per_published"] == 4.0
    assert summary["per_peer"]["1"]["owner_upload_per_published"] is None
    assert summary["max_owner_upload_per_published"] == 4.0


async def test_a_holder_serves_an_update_only_to_learners_holding_its_base() -> None:
    """A holder that took version 4 as an update over version 3 serves it only to a learner that
    holds version 3 and asks for updates; anyone else gets 409 at once (and asks the owner)."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from node.diloco.spread import UPDATE_NOT_HELD_STATUS, SpreadStats

    class Streams:
        async def stream_reply(self, request: Any, chunks: Any, size: int) -> web.StreamResponse:
            return web.Response(status=200, body=b"".join(bytes(c) for c in chunks))

    held = Holdings(1, CountingPool(), fanout=2)  # type: ignore[arg-type]
    await held.put(0, 4, bytearray(b"update"), 6, OWNER.peer_id, base=3)
    for query, status in (
        ("after=2&update=1", UPDATE_NOT_HELD_STATUS),
        ("after=3", UPDATE_NOT_HELD_STATUS),
        ("after=3&update=1", 200),
    ):
        request = make_mocked_request("GET", f"/v1/fragments/0/held?{query}")
        after = int(request.query["after"])
        resp = await held.serve(request, Streams(), 0, after, 0.0, None, SpreadStats())  # type: ignore[arg-type]
        assert resp.status == status, query


async def test_a_holder_past_its_fanout_serves_a_fallback_once_per_requester() -> None:
    """An owner whose budget is spent names likely holders and the learner asks them for a
    fallback: a holder that points others on serves each such requester once."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from node.diloco.spread import SpreadStats

    class Streams:
        async def stream_reply(self, request: Any, chunks: Any, size: int) -> web.StreamResponse:
            return web.Response(status=200, body=b"".join(bytes(c) for c in chunks))

    held = Holdings(1, CountingPool(), fanout=1)  # type: ignore[arg-type]
    await held.put(0, 4, bytearray(b"version"), 7, OWNER.peer_id)
    first, late = signer(20).peer_id, signer(21).peer_id
    statuses = []
    for who, query in (
        (first, "after=3"),
        (late, "after=3"),
        (late, "after=3&fallback=1"),
        (late, "after=3&fallback=1"),
    ):
        request = make_mocked_request("GET", f"/v1/fragments/0/held?{query}")
        resp = await held.serve(request, Streams(), 0, 3, 0.0, who, SpreadStats())  # type: ignore[arg-type]
        statuses.append(resp.status)
    assert statuses == [200, POINTER_STATUS, 200, 429]


async def test_a_holder_uploads_a_version_at_most_its_budget_however_many_ask() -> None:
    """Issue 52: a holder served every requester it could not point others at (anonymous: its
    bounded view lacked them) while it had served no member, and every member's fallback: twelve
    such requesters cost twelve full uploads of one version. Now each upload counts against the
    holder's budget (its fanout plus ``HOLDER_SPARE_UPLOADS``); past it, the peers it served are
    named, or it answers 429."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from node.diloco.spread import SpreadStats, holder_max_uploads

    class Streams:
        async def stream_reply(self, request: Any, chunks: Any, size: int) -> web.StreamResponse:
            return web.Response(status=200, body=b"".join(bytes(c) for c in chunks))

    budget = int(holder_max_uploads(2))
    for asks in (
        [(None, "after=3")] * 12,  # requesters the view lacks, one after another
        [(signer(30 + n).peer_id, "after=3&fallback=1") for n in range(12)],  # members' fallbacks
    ):
        held, stats = Holdings(1, CountingPool(), fanout=2), SpreadStats()  # type: ignore[arg-type]
        await held.put(0, 4, bytearray(b"version"), 7, OWNER.peer_id)
        statuses = []
        for who, query in asks:
            request = make_mocked_request("GET", f"/v1/fragments/0/held?{query}")
            resp = await held.serve(request, Streams(), 0, 3, 0.0, who, stats)  # type: ignore[arg-type]
            statuses.append(resp.status)
        # past the budget: pointed at the peers served (the members), or refused (anonymous)
        assert statuses[:budget] == [200] * budget, statuses
        assert set(statuses[budget:]) == ({429} if asks[0][0] is None else {POINTER_STATUS})
        assert stats.held_bytes == budget * 7 and stats.held_uploads_max == budget
        assert stats.held_versions_bytes == 7
