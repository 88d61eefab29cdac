"""Admission and TLS on a real aiohttp server on 127.0.0.1: every request's key and certificate
are checked before its route runs, certified swarms speak HTTPS with pinned keys, and a newer
manifest (a revocation) takes effect on the next request."""

from __future__ import annotations

import json
import os
import time

import aiohttp
import pytest
import tomli_w
from aiohttp import web

from node.dht.swarm import MANIFEST_PATH, SwarmCredentials, manifest_post_headers
from node.wire.admission import request_headers
from node.wire.tls import PinMismatch, server_context
from node.wire.transport import Transport
from protocol.wire.certificates import CERT_HEADER, Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.request_auth import AUTH_HEADER, RequestAuth
from protocol.wire.signing import Signer


def key() -> Signer:
    return Signer.from_seed(os.urandom(32))


class Swarm:
    def __init__(self, admission: str) -> None:
        self.founder, self.lab = key(), key()
        m = SwarmManifest(
            name="t", founder=self.founder.public_key, admission=admission, created=time.time()
        )
        self.manifest = m.with_authority("lab", self.lab.public_key).signed(self.founder)

    def cert(
        self, peer: Signer, *, roles: tuple[str, ...] = ("learner", "owner"), life_s: float = 3600
    ) -> Certificate:
        now = time.time()
        return Certificate.issue(
            self.lab,
            manifest=self.manifest,
            subject=peer.public_key,
            roles=roles,
            not_before=now - 60,
            not_after=now + life_s,
        )


async def serve(swarm: Swarm, who: Signer) -> tuple[Transport, SwarmCredentials]:
    cred = SwarmCredentials(swarm.manifest, who, swarm.cert(who))
    transport = Transport("127.0.0.1", 0, tls=server_context(who) if cred.certified else None)
    cred.install(transport)
    transport.app.router.add_get("/v1/hello", hello)
    await transport.start()
    return transport, cred


async def client(
    swarm: Swarm, who: Signer, cert: Certificate | None, server_id: bytes | None = None
) -> Transport:
    """A client that signs its requests as ``who`` (with ``cert``, which may be anyone's) for the
    node ``server_id`` (None: unknown, as on first contact)."""
    t = Transport("127.0.0.1", 0)
    cert_header = cert.to_header() if cert is not None else ""
    t.authenticate = lambda method, url, to: request_headers(
        who,
        cert_header,
        swarm=swarm.manifest.swarm_id,
        method=method,
        url=url,
        now=time.time(),
        recipient=to,
    )
    t.recipient_of = lambda _url: server_id
    await t.start()
    return t


async def hello(_request: web.Request) -> web.Response:
    return web.Response(text="model bytes")


async def get(t: Transport, url: str) -> tuple[int, str]:
    status, buf, used, _ = await t.request("GET", url, timeout_s=10)
    return status, bytes(buf[:used]).decode()


async def test_certified_swarm_admits_members_and_refuses_everyone_else_with_the_reason() -> None:
    swarm = Swarm("certified")
    server, cred = await serve(swarm, key())
    url = server.url + "/v1/hello"
    assert url.startswith("https://")
    member, stranger = key(), key()
    ok = await client(swarm, member, swarm.cert(member), cred.signer.peer_id)
    anon = Transport("127.0.0.1", 0)
    await anon.start()
    uncertified = await client(swarm, stranger, None, cred.signer.peer_id)
    other = Swarm("certified")  # a certificate from another swarm's authority
    foreign = await client(swarm, stranger, other.cert(stranger), cred.signer.peer_id)
    try:
        assert await get(ok, url) == (200, "model bytes")
        status, body = await get(anon, url)
        assert status == 403 and "certified peers only" in body
        status, body = await get(uncertified, url)
        assert status == 403 and "certified peers only" in body
        status, body = await get(foreign, url)
        assert status == 403 and "for swarm" in body
        # a header copied onto another route, or a stale one, is worth nothing
        async with anon.session.get(
            url.replace("hello", "status"),
            ssl=False,
            headers=ok.authenticate("GET", url, cred.signer.peer_id),
        ) as r:  # type: ignore[misc]
            assert r.status in (401, 404)
        stale = RequestAuth.make(
            member,
            swarm=swarm.manifest.swarm_id,
            method="GET",
            target="/v1/hello",
            now=time.time() - 600,
            recipient=cred.signer.peer_id,
            nonce=b"s" * 16,
        )
        async with anon.session.get(
            url,
            ssl=False,
            headers={AUTH_HEADER: stale, CERT_HEADER: swarm.cert(member).to_header()},
        ) as r:
            assert r.status == 403 and "clock" in (await r.json())["reason"]
        assert cred.admission.refused and cred.admission.admitted >= 1

        # the founder revokes the member; the manifest arrives by publish (no credentials needed:
        # the founder's signature over the body's hash, in its head)
        revoked = swarm.manifest.with_revoked(member.public_key).signed(swarm.founder)
        text = tomli_w.dumps(revoked.to_toml_data()).encode()
        async with anon.session.post(
            server.url + MANIFEST_PATH,
            data=text,
            ssl=False,
            headers=manifest_post_headers(swarm.founder, revoked, text),
        ) as r:
            assert r.status == 200 and (await r.json())["adopted"] is True
        status, body = await get(ok, url)
        assert status == 403 and "revoked" in body
        # a forged newer manifest is refused and changes nothing
        forged = revoked.with_authority("evil", key().public_key)
        forged = SwarmManifest.from_toml(
            tomli_w.dumps({**forged.to_toml_data(), "signature": {"founder": "00" * 64}})
        )
        async with anon.session.post(
            server.url + MANIFEST_PATH, data=tomli_w.dumps(forged.to_toml_data()), ssl=False
        ) as r:
            assert r.status == 401
        assert cred.manifest.version == revoked.version
    finally:
        for t in (ok, anon, uncertified, foreign, server):
            await t.close()


async def test_plain_http_to_a_certified_peer_is_refused() -> None:
    swarm = Swarm("certified")
    server, _ = await serve(swarm, key())
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.get(server.url.replace("https://", "http://") + "/v1/hello") as r:
                    await r.read()
    finally:
        await server.close()


async def test_a_pinned_key_that_does_not_match_fails_before_the_request_is_sent() -> None:
    swarm = Swarm("certified")
    owner = key()
    server, cred = await serve(swarm, owner)
    member = key()
    c = await client(swarm, member, swarm.cert(member), owner.peer_id)
    try:
        url = server.url + "/v1/hello"
        c.pins[server.url] = swarm.cert(owner).tls_pin  # the right pin
        assert (await get(c, url))[0] == 200
        before = cred.admission.admitted
        c.pins[server.url] = swarm.cert(key()).tls_pin  # an impostor at the member's address
        await c.session.close()  # no reuse of the pinned connection
        c._session = aiohttp.ClientSession()
        with pytest.raises(PinMismatch):
            await get(c, url)
        assert cred.admission.admitted == before  # nothing reached the routes
    finally:
        await c.close()
        await server.close()


async def test_open_swarm_serves_anonymous_learners_and_still_checks_headers_that_are_sent() -> (
    None
):
    swarm = Swarm("open")
    server, cred = await serve(swarm, key())
    anon = Transport("127.0.0.1", 0)
    await anon.start()
    stranger = key()
    expired = await client(swarm, stranger, swarm.cert(stranger, life_s=-30), cred.signer.peer_id)
    try:
        assert server.url.startswith("http://")
        assert await get(anon, server.url + "/v1/hello") == (200, "model bytes")
        status, body = await get(expired, server.url + "/v1/hello")
        assert status == 403 and "expired" in body
        status, body = await get(anon, server.url + MANIFEST_PATH)
        assert status == 200 and SwarmManifest.from_toml(body) == swarm.manifest
        assert json.dumps(cred.status())
    finally:
        for t in (anon, expired, server):
            await t.close()


async def test_a_development_swarm_knows_who_asks_and_refuses_a_bad_or_foreign_signature() -> None:
    """No manifest, no admission: an unsigned request is anonymous, a signed one is served as
    its key (owners tell members apart by it), and another swarm's signature (401) or a stale
    one (403) is refused with the reason, before the route runs."""
    from node.wire.admission import ADMITTED, Identification

    server_key, member, other_swarm = key(), key(), Identification(key(), "another-swarm")
    server = Transport("127.0.0.1", 0)
    identity = Identification(server_key, "dev")
    identity.install(server)

    async def whoami(request: web.Request) -> web.Response:
        admitted = request[ADMITTED]
        return web.Response(text=admitted.public_key.hex() if admitted.public_key else "anonymous")

    server.app.router.add_get("/v1/whoami", whoami)
    await server.start()
    signed, anon, foreign, stale = (Transport("127.0.0.1", 0) for _ in range(4))
    signed.authenticate = Identification(member, "dev").headers
    foreign.authenticate = other_swarm.headers
    stale.authenticate = Identification(member, "dev", clock=lambda: time.time() - 3600).headers
    for t in (signed, anon, foreign, stale):
        t.recipient_of = lambda _url: server_key.peer_id
        await t.start()
    try:
        assert await get(signed, server.url + "/v1/whoami") == (200, member.public_key.hex())
        assert await get(anon, server.url + "/v1/whoami") == (200, "anonymous")
        for bad in (foreign, stale):
            status, body = await get(bad, server.url + "/v1/whoami")
            assert status in (401, 403) and "reason" in body, (status, body)
        assert sum(identity.refused.values()) == 2
    finally:
        for t in (signed, anon, foreign, stale, server):
            await t.close()


def test_open_swarms_send_no_header_on_sealed_routes_and_no_certificate_anywhere() -> None:
    """An open swarm's DHT and RPC requests go without Atoll-Auth (their envelopes sign them)
    and its other requests without Atoll-Certificate (read by no open-swarm server); a certified
    swarm's requests carry both everywhere (its admission refuses a request without them before
    reading its body)."""
    from protocol.wire.certificates import CERT_HEADER
    from protocol.wire.request_auth import AUTH_HEADER

    url = "http://127.0.0.1:9/v1"
    for admission in ("open", "certified"):
        swarm, who = Swarm(admission), key()
        cred = SwarmCredentials(swarm.manifest, who, swarm.cert(who))
        for method, path in (("POST", "/dht"), ("POST", "/dht/3"), ("POST", "/rpc")):
            got = cred.headers(method, url + path, bytes(32))
            assert set(got) == (set() if admission == "open" else {AUTH_HEADER, CERT_HEADER})
        for method, path in (("GET", "/fragments/0/held?after=1"), ("GET", "/fragments/0/next")):
            got = cred.headers(method, url + path, bytes(32))
            assert set(got) == (
                {AUTH_HEADER} if admission == "open" else {AUTH_HEADER, CERT_HEADER}
            )


async def test_an_open_swarm_serves_a_dht_request_sent_without_headers() -> None:
    """The whole path: a client of an open swarm pings a DHT node with no Atoll-Auth (its
    credentials leave it off) and is answered, its envelope verified."""
    from node.dht.kademlia import DHTConfig, DHTNode
    from node.dht.route import DHTRouter

    swarm = Swarm("open")
    server_key, client_key = key(), key()
    server, cred = Transport("127.0.0.1", 0), SwarmCredentials(swarm.manifest, server_key, None)
    cred.install(server)
    router = DHTRouter(server)
    await server.start()
    node = DHTNode(server_key, server, router.url(), DHTConfig(maintenance_period_s=0))
    router.mount(node)
    client = Transport("127.0.0.1", 0)
    SwarmCredentials(swarm.manifest, client_key, swarm.cert(client_key)).install(client)
    await client.start()
    asker = DHTNode(client_key, client, "", DHTConfig(maintenance_period_s=0))
    try:
        await node.start()
        await asker.start()
        assert await asker.ping(router.url()) is not None
        assert cred.admission.admitted >= 1 and not cred.admission.refused
        assert len(cred.admission.replays) == 0  # no Atoll-Auth came: nothing to remember
        assert node.metrics.rpcs_in["Ping"] == 1
    finally:
        await asker.close()
        await node.close()
        await client.close()
        await server.close()
