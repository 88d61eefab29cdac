"""What a request and its reply put on the wire: counted exactly, and no header nobody reads.

A relay between client and server keeps every byte each way (``bench.request_bytes.Relay``);
the transports' own counts (``bytes_sent``) must equal them, heads included."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from bench.request_bytes import Relay, parts
from node.wire.transport import Transport

pytestmark = pytest.mark.timeout(20)


async def _served() -> Transport:
    server = Transport()

    async def echo(request: web.Request) -> web.Response:
        buf, used = await server.read_request(request)
        try:
            return web.Response(body=bytes(memoryview(buf)[:used]))
        finally:
            server.pool.give(buf)

    async def nothing(_request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def json(_request: web.Request) -> web.Response:
        return web.json_response({"a": 1}, headers={"Atoll-Version": "7"})

    server.app.router.add_post("/echo", echo)
    server.app.router.add_get("/nothing", nothing)
    server.app.router.add_get("/json", json)
    await server.start()
    return server


async def test_counted_bytes_are_the_bytes_on_the_wire_and_no_unread_header_goes() -> None:
    server, client = await _served(), Transport()
    await client.start()
    relay = Relay(server.port)
    base = f"http://127.0.0.1:{await relay.start()}"
    try:
        for method, path, body in (
            ("POST", "/echo", b"x" * 300),
            ("GET", "/nothing", b""),
            ("GET", "/json", b""),
        ):
            sent_before, served_before = client.bytes_sent, server.bytes_sent
            async with client.reply(
                method, base + path, chunks=[body] if body else (), size=len(body) or None
            ) as r:
                assert r.status in (200, 204)
            for _ in range(100):  # the relay passes the reply on before it has copied it all
                await asyncio.sleep(0.01)
                if len(relay.down) >= server.bytes_sent - served_before:
                    break
            up, down = relay.take()
            assert client.bytes_sent - sent_before == len(up), (path, up)
            assert server.bytes_sent - served_before == len(down), (path, down)
            names = {k.split(" ", 1)[1].lower() for k in parts(up, sealed=False) if " " in k}
            assert not names & {"user-agent", "accept", "accept-encoding", "content-type"}
            names = {k.split(" ", 1)[1].lower() for k in parts(down, sealed=False) if " " in k}
            assert not names & {"server", "date"}
            # a body of the default type goes without one; any other type is still named
            assert ("content-type" in names) == (path == "/json"), names
    finally:
        await client.close()
        await server.close()
        assert relay.server is not None
        relay.server.close()


async def test_made_up_paths_count_under_one_route() -> None:
    server, client = await _served(), Transport()
    await client.start()
    try:
        for path in ("/nowhere/a1", "/nowhere/b2", "/v1/x?y=1"):
            async with client.reply("GET", server.url + path) as r:
                assert r.status == 404
        assert set(server.bytes_by_route) == {"reply (no route)"}
        assert server.messages_by_route == {"reply (no route)": 3}
    finally:
        await client.close()
        await server.close()
