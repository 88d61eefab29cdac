"""Atoll-Auth bound to its server, on real aiohttp servers on 127.0.0.1: a header names the peer
id of the node it is for and a nonce, so a captured one is refused by every other member, and by
its own node the second time (issue 48: a header was good at every member for 60 s)."""

from __future__ import annotations

import dataclasses
import time

import aiohttp
import pytest
from aiohttp import web

from node.dht.swarm import SwarmCredentials
from node.wire.admission import MemberAddresses, request_headers
from node.wire.transport import Transport
from protocol.wire.certificates import CERT_HEADER
from protocol.wire.request_auth import AUTH_HEADER
from tests.node.wire.test_admission import Swarm, key

pytestmark = pytest.mark.timeout(60)

ROUTE = "/v1/fragments/0/latest"


async def _member_server(swarm: Swarm) -> tuple[Transport, SwarmCredentials]:
    who = key()
    cred = SwarmCredentials(swarm.manifest, who, swarm.cert(who))
    t = Transport("127.0.0.1", 0)
    cred.install(t)

    async def fragment(_request: web.Request) -> web.Response:
        return web.Response(text="model bytes")

    async def status(_request: web.Request) -> web.Response:
        return web.Response(text="status")

    t.app.router.add_get(ROUTE, fragment)
    t.app.router.add_get("/v1/status", status)
    await t.start()
    return t, cred


async def _send(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, str]:
    async with session.get(url, headers=headers) as r:
        return r.status, await r.text()


async def test_a_captured_header_is_refused_by_other_members_and_by_its_own_node_the_second_time() -> (
    None
):
    swarm = Swarm("open")
    (a, cred_a), (b, cred_b) = await _member_server(swarm), await _member_server(swarm)
    member = key()
    cert = swarm.cert(member).to_header()

    def headers(url: str, to: bytes | None) -> dict[str, str]:
        return request_headers(
            member,
            cert,
            swarm=swarm.manifest.swarm_id,
            method="GET",
            url=url,
            now=time.time(),
            recipient=to,
        )

    try:
        async with aiohttp.ClientSession() as s:
            captured = headers(a.url + ROUTE, cred_a.signer.peer_id)
            assert await _send(s, a.url + ROUTE, captured) == (200, "model bytes")
            status, body = await _send(s, a.url + ROUTE, captured)  # replayed at the node it names
            assert status == 401 and "used before" in body
            status, body = await _send(s, b.url + ROUTE, captured)  # replayed at another member
            assert status == 401 and "not this node" in body
            # a fresh header is a fresh request
            assert (await _send(s, a.url + ROUTE, headers(a.url + ROUTE, cred_a.signer.peer_id)))[
                0
            ] == 200
            # first contact: a header naming nobody reaches the first-contact routes only
            assert (await _send(s, b.url + "/v1/status", headers(b.url + "/v1/status", None)))[
                0
            ] == 200
            status, body = await _send(s, b.url + ROUTE, headers(b.url + ROUTE, None))
            assert status == 401 and "names no recipient" in body
            # an old client's header: a 401 that says why, never taken silently
            old = captured[AUTH_HEADER].split(" ")
            v1 = " ".join(["v1", old[1], old[2], old[5]])
            status, body = await _send(s, b.url + ROUTE, {AUTH_HEADER: v1, CERT_HEADER: cert})
            assert status == 401 and "upgrade atoll" in body
        assert cred_a.admission.status()["auth_replays"] == 1
        assert cred_a.admission.refused and cred_b.admission.refused
    finally:
        for t in (a, b):
            await t.close()


async def test_a_peers_requests_name_the_member_its_address_belongs_to() -> None:
    """The transport asks the member records which peer id answers at a URL (``MemberAddresses``)
    and signs for it: a member's request to another member's fragment route is taken there."""
    swarm = Swarm("open")
    server, cred = await _member_server(swarm)

    @dataclasses.dataclass
    class Record:
        url: str

    @dataclasses.dataclass
    class Member:
        record: Record

    members = {
        cred.signer.peer_id: Member(Record(server.url)),
        key().peer_id: Member(Record("http://10.0.0.1:9")),
    }
    member = key()
    client = Transport("127.0.0.1", 0)
    SwarmCredentials(swarm.manifest, member, swarm.cert(member)).install(client)
    client.recipient_of = MemberAddresses(lambda: members)
    await client.start()
    try:
        assert client.recipient_of(server.url + ROUTE) == cred.signer.peer_id
        assert (
            client.recipient_of("http://127.0.0.1:1/v1/status") is None
        )  # not a member's: first contact
        status, buf, used, _ = await client.request("GET", server.url + ROUTE, timeout_s=10)
        assert status == 200 and bytes(buf[:used]) == b"model bytes"
        members = {}  # a new read that no longer lists it: the index is rebuilt
        assert client.recipient_of(server.url + ROUTE) is None
    finally:
        await client.close()
        await server.close()
