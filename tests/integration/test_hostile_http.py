"""One real peer (``PeerNode`` with a tiny model, every route it serves) on 127.0.0.1, fed
garbage, truncated, oversized and wrong-type bodies, bad query strings and bad headers: every
reply is a 4xx with a reason, never a 500 or a hang, nothing is logged as an unhandled error,
and the peer still answers ``/v1/status`` afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import torch

from node.config import RunConfig
from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.membership import MemberRecord, Membership, manifest_hash
from node.diloco.island import Island, IslandConfig
from node.peer import PeerNode
from node.wire.transport import ServeLimits, Transport
from protocol.wire.codec import encode
from protocol.wire.messages import Ack, ReplicaState
from protocol.wire.signing import Signer, seal
from tests.node.fakes import signer, tiny_model, tiny_plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

HUGE = "9" * 5000  # past Python's int-parsing limit of 4300 digits
LONG_POLL_QUERIES = [
    "wait=nan",
    "wait=1e309",
    "wait=-5",
    "wait=inf",
    "wait=" + HUGE,
    "wait=",
    "after=abc",
    "after=" + "9" * 30,
    "after=" + HUGE,
    "after=-2",
    "after=1.5",
]


@pytest.fixture
async def peer() -> AsyncIterator[PeerNode]:
    model = tiny_model()
    plan = tiny_plan(model)
    node = PeerNode(RunConfig(max_tokens_per_step=64, swarm="hostile"), signer(1), model, plan)
    node.transport.limits = ServeLimits(
        body_timeout_s=1.0, body_slack_s_per_mib=0.0, body_idle_s=1.0
    )
    island = Island(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        plan,
        lambda _out: None,
        IslandConfig(inner_steps=5),
    )
    serving = asyncio.create_task(node.serve(island, []))
    async with asyncio.timeout(15):
        while len(node.owners) < len(plan.fragments):  # joined alone: it owns every fragment
            assert not serving.done(), serving
            await asyncio.sleep(0.05)
    yield node
    node.stop()
    async with asyncio.timeout(15):
        await serving


async def raw(port: int, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes; return the reply's status and body (the server closes or answers)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        async with asyncio.timeout(10):
            head = await r.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            body = await r.readexactly(length)
        return int(head.split(b" ")[1]), body
    finally:
        w.close()


def reason_of(body: bytes) -> str:
    """The refusal's reason: the JSON ``reason`` when the body is JSON, else the text."""
    try:
        return str(json.loads(body).get("reason", ""))
    except (ValueError, AttributeError):
        return body.decode(errors="replace").strip()


def sealed_bytes(message: Any) -> bytes:
    return seal(encode(message), signer(7), now=time.time(), nonce=os.urandom(16)).tobytes()


async def test_every_route_refuses_hostile_requests_with_a_4xx_and_a_reason(
    peer: PeerNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = peer.transport.port
    ack = sealed_bytes(Ack(accepted=True, reason="", version=0))  # a reply, never a request
    bodies = {
        "garbage": os.urandom(3000),
        "empty": b"",
        "truncated": ack[: len(ack) // 2],
        "json": b'{"message": "hello"}',
        "sealed, wrong type": ack,
        "appended garbage": ack + b"\0" * 64,
    }
    cases: list[tuple[str, str, dict[str, Any]]] = []  # (method, path, request kwargs)
    for route in ("/v1/rpc", "/v1/dht"):
        cases += [("POST", route, {"data": body}) for body in bodies.values()]
        cases += [("GET", route, {}), ("PUT", route, {"data": b"x"})]
    for name in ("find", "0", "x" * 300, "..", "%00"):  # a DHT node name nobody mounted
        cases += [
            ("POST", f"/v1/dht/{name}", {"data": bodies["garbage"]}),
            ("POST", f"/v1/dht/{name}", {"data": ack}),
        ]
    for kind in ("next", "final", "latest", "latest/manifest", "held"):
        for p in (
            "abc",
            "99",
            HUGE,
            "-1",
            "1e3",
            "%D9%A0",
            "+0",
            "0_0",
        ):  # %D9%A0: an Arabic-Indic 0
            cases.append(("GET", f"/v1/fragments/{p}/{kind}", {}))
        cases.append(("POST", f"/v1/fragments/0/{kind}", {"data": os.urandom(100)}))
    for kind in ("next", "final", "held"):
        cases += [("GET", f"/v1/fragments/0/{kind}?{q}", {}) for q in LONG_POLL_QUERIES]
    cases += [
        ("GET", f"/v1/fragments/0/held?after=0&wait=0&owner={o}", {})
        for o in ("zz", "ab" * 31, "AB" * 32)
    ]
    cases.append(("GET", "/v1/fragments/0/bogus", {}))
    for value in (f"bytes={HUGE}-", f"bytes=-{HUGE}", f"bytes=0-{HUGE}", "bytes=99999999-"):
        cases.append(("GET", "/v1/fragments/0/latest", {"headers": {"Range": value}}))
    for route in ("/v1/status", "/v1/manifest"):
        cases += [("POST", route, {"data": os.urandom(500)}), ("DELETE", route, {})]
    for q in (
        "",
        "port=abc",
        "port=0",
        "port=" + HUGE,
        "url=http://10.1.2.3:9",
        "url=http://example.invalid:1",
        "url=ftp://127.0.0.1:1",
        "url=" + "x" * 4000,
    ):
        cases.append(("GET", f"/v1/dialback?{q}", {}))
    for q in ("swarm=other", "swarm=", "swarm=%00", "swarm=" + "s" * 500):
        cases.append(("GET", f"/v1/members?{q}", {}))

    answers = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for method, path, kw in cases:
            async with session.request(method, peer.transport.url + path, **kw) as resp:
                answers.append((method, path[:60], resp.status, reason_of(await resp.read())))
    raw_cases = [
        b"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: 300000000\r\n\r\nab",  # over the 256 MiB cap
        b"POST /v1/dht HTTP/1.1\r\nHost: x\r\nContent-Length: 300000000\r\n\r\nab",
        b"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n\0\0",  # 408 after 1 s
        b"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nstalled",  # 413: no envelope that long
        b"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20_000 + b"\r\n\r\n",
        b"GET /v1/status?" + b"q" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GARBAGE\r\n\r\n",
        b"GET /v1/fragments/0/latest HTTP/1.1\r\nHost: x\r\nRange: bytes="
        + HUGE.encode()
        + b"-\r\n\r\n",
    ]
    for data in raw_cases:
        status, body = await raw(port, data)
        answers.append(("RAW", data[:60].decode(errors="replace"), status, reason_of(body)))

    bad = [a for a in answers if not (400 <= a[2] < 500 and a[3])]
    assert not bad, bad
    assert {a[2] for a in answers} >= {400, 403, 404, 405, 408, 413, 416}
    async with (
        aiohttp.ClientSession() as session,
        session.get(peer.transport.url + "/v1/status") as resp,
    ):
        status = await resp.json()
        assert resp.status == 200 and status["swarm"] == "hostile"
        assert status["remote_errors"]  # the refused RPCs were counted
    unhandled = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not unhandled, unhandled


async def test_an_rpc_body_larger_than_the_fragment_plan_allows_is_refused_before_it_is_read(
    peer: PeerNode,
) -> None:
    """The tiny model's largest legitimate RPC body is ~1.3 MiB (``max_rpc_body`` of its plan):
    a body declaring 64 MiB is a 413 from its head alone (before, anything up to 256 MiB was
    read, and this one waited for its bytes until the body timeout's 408)."""
    assert peer.rpc.max_message < 4 << 20
    for declared in (peer.rpc.max_message + 1, 64 << 20):
        start = time.perf_counter()
        status, body = await raw(
            peer.transport.port,
            f"POST /v1/rpc HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode(),
        )
        assert status == 413 and "exceeds the cap" in reason_of(body), (status, body[:200])
        assert time.perf_counter() - start < 0.9  # not the fixture's 1 s body timeout
    async with (
        aiohttp.ClientSession() as session,
        session.get(peer.transport.url + "/v1/status") as resp,
    ):
        assert resp.status == 200


@contextlib.asynccontextmanager
async def insider_of(peer: PeerNode) -> AsyncIterator[Signer]:
    """A member of ``peer``'s development swarm (where any member may hand fragments over): a
    fresh key whose member record it stores on ``peer``'s DHT, nothing more."""
    insider = Signer.from_seed(os.urandom(32))
    transport = Transport()
    await transport.start()
    dht = DHTNode(insider, transport, "", DHTConfig(maintenance_period_s=0))
    await dht.start()
    try:
        assert await dht.bootstrap([peer.transport.url + "/v1/dht"]) == 1
        record = MemberRecord(
            url="",
            roles=("learner",),
            reachable=False,
            manifest=manifest_hash(peer.cfg),
            learning=True,
        )
        assert await Membership(dht, peer.cfg.swarm, manifest_hash(peer.cfg)).publish(record) >= 1
        yield insider
    finally:
        await dht.close()
        await transport.close()


async def test_a_members_handoff_of_a_fragment_outside_the_plan_is_a_4xx_not_a_500(
    peer: PeerNode, caplog: pytest.LogCaptureFixture
) -> None:
    """A handoff (``ReplicaState``) naming a fragment index past the plan indexed the learner's
    per-fragment table before anything checked it: an ``IndexError``, a 500 and a traceback for
    one signed RPC from any member. It is refused by its claim (404) before admission."""
    caplog.set_level(logging.INFO)
    n = len(peer.plan.fragments)
    assert peer.net is not None  # the learner's tables are what the index ran past
    async with insider_of(peer) as insider, aiohttp.ClientSession() as session:
        answers = []
        for fragment in (n, 2**62):
            digest = os.urandom(32)
            state = ReplicaState(
                swarm=peer.cfg.swarm,
                fragment=fragment,
                epoch=0,
                version=1,
                digest=digest,
                theta=(),
                momentum=(),
                base_version=1,  # a handoff by reference: no tensors to build
                base_digest=digest,
            )
            body = seal(
                encode(state),
                insider,
                now=time.time(),
                nonce=os.urandom(16),
                recipient=peer.signer.peer_id,
            ).tobytes()
            async with session.post(peer.transport.url + "/v1/rpc", data=body) as resp:
                answers.append((resp.status, reason_of(await resp.read())))
    assert answers == [(404, f"handoff of fragment {f}: the plan has {n}") for f in (n, 2**62)]
    unhandled = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not unhandled, unhandled
