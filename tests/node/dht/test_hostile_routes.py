"""/v1/dialback and /v1/members over real HTTP on 127.0.0.1, against a stand-in DHT: a node
dials back only the requester's own address, one at a time and at a bounded rate; member
listings come from a short cache, for a node's own swarm only (a bootstrap node: any swarm, new
ones at a bounded rate)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from node.dht.bootstrap import DialBacks, MemberListings
from node.wire.transport import Transport
from tests.node.fakes import FakeClock

pytestmark = pytest.mark.timeout(20)


@dataclass
class FakeDHT:
    """Answers pings (after ``gate`` opens, if set) and member lookups, counting both."""

    pinged: list[str] = field(default_factory=list)
    lookups: list[bytes] = field(default_factory=list)
    gate: asyncio.Event | None = None
    in_flight: int = 0
    most_in_flight: int = 0

    async def ping(self, address: str) -> Any:
        self.pinged.append(address)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.in_flight -= 1

        @dataclass
        class Contact:
            peer_id: bytes = b"\xab" * 32

        return Contact()

    async def get(self, key: bytes) -> list[Any]:
        self.lookups.append(key)
        if self.gate is not None:
            await self.gate.wait()
        return []


Serve = Callable[[str], Awaitable[tuple[int, dict[str, Any]]]]


def _route(
    handler: DialBacks | MemberListings, dht: FakeDHT
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def route(request: web.Request) -> web.Response:
        return await handler.answer(request, dht)  # type: ignore[arg-type]

    return route


@pytest.fixture
async def routes() -> AsyncIterator[Callable[[Any, FakeDHT], Awaitable[Serve]]]:
    transports: list[Transport] = []
    session = aiohttp.ClientSession()

    async def start(handler: Any, dht: FakeDHT) -> Serve:
        t = Transport()
        t.app.router.add_get("/r", _route(handler, dht))
        await t.start()
        transports.append(t)

        async def get(query: str) -> tuple[int, dict[str, Any]]:
            async with session.get(f"{t.url}/r?{query}") as r:
                return r.status, json.loads(await r.read())

        return get

    yield start
    await session.close()
    for t in transports:
        await t.close()


async def test_a_node_dials_back_only_the_requesters_own_address(routes: Any) -> None:
    dht = FakeDHT()
    get = await routes(DialBacks(), dht)
    for query in (
        "url=http://10.1.2.3:9/",
        "url=http://192.168.0.1:22",
        "url=http://example.invalid:80",
    ):
        status, body = await get(query)
        assert (
            status == 403 and "dials back only the address a request came from" in body["reason"]
        ), query
    for query in (
        "",
        "port=0",
        "port=65536",
        "port=abc",
        "port=" + "9" * 3000,
        "port=%D9%A3",
        "url=ftp://127.0.0.1:21",
        "url=http://127.0.0.1:99999",
        "url=nonsense",
    ):
        status, body = await get(query)
        assert status == 400 and body["reason"], query
    assert dht.pinged == []  # nothing refused was dialled
    assert await get("port=4321") == (
        200,
        {"reachable": True, "address": "http://127.0.0.1:4321", "peer_id": "ab" * 32},
    )
    status, body = await get("url=http://127.0.0.1:5555")  # how node.peer asks
    assert status == 200 and body["reachable"]
    status, body = await get("url=http://localhost:6666/")  # a name that resolves to the requester
    assert status == 200 and body["address"] == "http://127.0.0.1:6666"
    assert dht.pinged == [f"http://127.0.0.1:{p}/v1/dht" for p in (4321, 5555, 6666)]


async def test_one_dial_back_at_a_time_per_address_then_a_bounded_rate(routes: Any) -> None:
    dht, clock = FakeDHT(gate=asyncio.Event()), FakeClock()
    get = await routes(DialBacks(rate=1.0, burst=3, clock=clock), dht)
    asked = [asyncio.create_task(get(f"port={p}")) for p in (1001, 1002, 1003)]
    async with asyncio.timeout(5):
        while not dht.pinged:
            await asyncio.sleep(0.01)
    status, body = await get("port=1004")  # the burst of 3 is spent
    assert status == 429 and "1 a second" in body["reason"]
    assert dht.gate is not None
    dht.gate.set()
    assert [(await a)[0] for a in asked] == [200, 200, 200]
    assert dht.most_in_flight == 1 and len(dht.pinged) == 3
    clock.advance(1.0)
    assert (await get("port=1005"))[0] == 200


async def test_a_peer_lists_its_own_swarm_from_a_short_cache(routes: Any) -> None:
    dht, clock = FakeDHT(gate=asyncio.Event()), FakeClock()
    listings = MemberListings(only="mine", clock=clock)
    get = await routes(listings, dht)
    many = [asyncio.create_task(get("swarm=mine")) for _ in range(20)]
    async with asyncio.timeout(5):
        while not dht.lookups:
            await asyncio.sleep(0.01)
    assert dht.gate is not None
    dht.gate.set()
    assert await asyncio.gather(*many) == [(200, {"swarm": "mine", "members": []})] * 20
    assert (await get(""))[0] == 200  # the default is the peer's own swarm
    for name in ("other", "x" * 100):
        status, body = await get(f"swarm={name}")
        assert status == 404 and "lists only swarm 'mine'" in body["reason"]
    for bad in ("swarm=", "swarm=" + "x" * 129, "swarm=%00"):
        status, body = await get(bad)
        assert status == 400 and body["reason"], bad
    assert len(dht.lookups) == 2  # one listing: the roster and the members key, read once
    clock.advance(2.0)
    assert (await get("swarm=mine"))[0] == 200 and len(dht.lookups) == 4


async def test_a_bootstrap_node_caches_a_bounded_number_of_swarms(routes: Any) -> None:
    dht, clock = FakeDHT(), FakeClock()
    listings = MemberListings(max_swarms=4, clock=clock)
    get = await routes(listings, dht)
    statuses = [(await get(f"swarm=s{i}"))[0] for i in range(12)]
    assert statuses == [200] * 8 + [429] * 4  # a burst of new swarms, then a bounded rate
    # each listing reads two keys (the roster and the members key)
    assert len(dht.lookups) == 2 * 8 and len(listings._cache) == 4
    assert (await get("swarm=s7"))[0] == 200 and len(dht.lookups) == 2 * 8  # cached
    clock.advance(1.0)
    assert (await get("swarm=s100"))[0] == 200


@pytest.mark.parametrize("route", ["dialback", "members"])
async def test_the_default_handler_refusals_are_json(route: str) -> None:
    """A refusal from either route is a 4xx JSON body with an ``error`` and a ``reason``."""
    t = Transport()
    handler = DialBacks() if route == "dialback" else MemberListings(only="s")
    t.app.router.add_get("/r", _route(handler, FakeDHT()))
    await t.start()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{t.url}/r?swarm=no&port=no") as r,
        ):
            body = json.loads(await r.read())
            assert 400 <= r.status < 500 and body["error"] and body["reason"]
    finally:
        await t.close()
