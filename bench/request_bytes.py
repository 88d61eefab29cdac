"""Bytes of one request and its reply, by part, as they cross the wire (issue 52).

Two peers of an open swarm set up as ``atoll local`` sets them up (a founder's manifest, an
authority, a certificate for each peer), on 127.0.0.1; the client reaches the server through a
relay that records every byte each way, so the figures are what TCP carried, not an estimate.
The client sends one of each: the DHT's FindValue (a bounded view's roster read: 8 records named
for renewal), Refresh (one record), Store (one member record of ``--value-bytes``), FindNode and
Ping, and the spread's ``held`` long-poll (answered by a pointer to two holders, the production
``answer`` path) and ``next`` long-poll (answered 204: nothing new within its wait).

Each message is split into its request or status line, each header line, and its body; a sealed
body into its length prefix, envelope and message. Run from the repository root::

    python -m bench.request_bytes --json

Human-readable lines go to stderr; the last line of stdout is one JSON object:
``{"requests": [{"kind", "request": {part: bytes}, "reply": {part: bytes}}, ...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from aiohttp import web

from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.route import DHTRouter
from node.dht.swarm import SwarmCredentials
from node.diloco.spread import SpreadStats, answer
from node.wire.transport import Transport
from protocol.dht.delta_reads import content_tag
from protocol.dht.messages import FindNode, FindValue, Ping, Refresh, Store
from protocol.dht.signed_record import RecordRefresh, sign_record
from protocol.diloco.spread import PointTo
from protocol.ids import key_id
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.sealing import LENGTH_PREFIX
from protocol.wire.signing import Signer

_SEP = b"\r\n\r\n"


class Relay:
    """A TCP relay to ``port`` that keeps every byte each way, per connection."""

    def __init__(self, port: int) -> None:
        self.port, self.up, self.down = port, bytearray(), bytearray()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._pair, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _pair(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        r2, w2 = await asyncio.open_connection("127.0.0.1", self.port)
        await asyncio.gather(self._pipe(reader, w2, self.up), self._pipe(r2, writer, self.down))

    @staticmethod
    async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, into: bytearray) -> None:
        try:
            while data := await r.read(1 << 16):
                into += data
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    def take(self) -> tuple[bytes, bytes]:
        up, down = bytes(self.up), bytes(self.down)
        self.up.clear()
        self.down.clear()
        return up, down


def parts(message: bytes, *, sealed: bool) -> dict[str, int]:
    """One HTTP/1.1 message's bytes by part (its head's lines with their CRLF, the body)."""
    head, _, body = message.partition(_SEP)
    lines = head.split(b"\r\n")
    out = {"first line": len(lines[0]) + 2}
    for line in lines[1:]:
        name = line.split(b":", 1)[0].decode()
        out[f"header {name}"] = len(line) + 2
    out["blank line"] = 2
    if sealed and len(body) > LENGTH_PREFIX.size:
        n = LENGTH_PREFIX.unpack_from(body)[0]
        out["body: length prefix"] = LENGTH_PREFIX.size
        out["body: envelope"] = n
        out["body: message"] = len(body) - LENGTH_PREFIX.size - n
    else:
        out["body"] = len(body)
    out["total"] = len(message)
    return out


def _keys(n: int) -> list[Signer]:
    return [Signer.from_seed(os.urandom(32)) for _ in range(n)]


async def _held(request: web.Request) -> web.StreamResponse:
    holders = (os.urandom(32), os.urandom(32))
    return await answer(
        request, _TRANSPORTS[0], PointTo(holders, "spent"), iter, 0, SpreadStats(), version=12
    )


async def _next(_request: web.Request) -> web.StreamResponse:
    return web.Response(status=204)


_TRANSPORTS: list[Transport] = []


async def measure(value_bytes: int) -> list[dict[str, Any]]:
    founder, authority, a_key, b_key = _keys(4)
    now = time.time()
    manifest = (
        SwarmManifest(name="bytes", founder=founder.public_key, admission="open", created=now)
        .with_authority("local", authority.public_key)
        .signed(founder)
    )

    def creds(key: Signer) -> SwarmCredentials:
        cert = Certificate.issue(
            authority,
            manifest=manifest,
            subject=key.public_key,
            roles=("learner", "owner"),
            not_before=now - 60,
            not_after=now + 86400,
        )
        return SwarmCredentials(manifest, key, cert)

    server, client = Transport(), Transport()
    _TRANSPORTS[:] = [server]
    creds(a_key).install(server)
    creds(b_key).install(client)
    router = DHTRouter(server)
    server.app.router.add_get("/v1/fragments/{p}/held", _held)
    server.app.router.add_get("/v1/fragments/{p}/next", _next)
    await server.start()
    await client.start()
    relay = Relay(server.port)
    port = await relay.start()
    base = f"http://127.0.0.1:{port}"
    client.recipient_of = lambda _url: a_key.peer_id  # as MemberAddresses names a member
    cfg = DHTConfig(maintenance_period_s=0)
    a = DHTNode(a_key, server, router.url(), cfg)
    router.mount(a)
    b = DHTNode(b_key, client, "", cfg)
    await a.start()
    await b.start()
    key = key_id("atoll/bytes/roster")
    rec = sign_record(b_key, key, os.urandom(value_bytes), now + 20)
    later = sign_record(b_key, key, rec.value, now + 40)
    refresh = RecordRefresh(
        subkey=later.subkey, expires_at=later.expires_at, signature=later.signature
    )
    roster = [sign_record(k, key, os.urandom(value_bytes), now + 20) for k in _keys(8)]
    me = b.me
    calls = {
        "Ping": Ping(sender=me),
        "FindNode": FindNode(sender=me, target=os.urandom(32)),
        "Store": Store(sender=me, records=(rec,)),
        "Refresh": Refresh(sender=me, key=key, refreshes=(refresh,)),
        "FindValue": FindValue(sender=me, key=key, renew=tuple(content_tag(r) for r in roster)),
    }
    out: list[dict[str, Any]] = []
    dht = base + "/v1/dht"
    for kind, msg in calls.items():
        got = await b.caller.call(dht, msg, a_key.peer_id)
        if not hasattr(got, "message"):
            raise RuntimeError(f"{kind} failed: {got}")
        await asyncio.sleep(0.05)
        up, down = relay.take()
        out.append(
            {"kind": kind, "request": parts(up, sealed=True), "reply": parts(down, sealed=True)}
        )
    for kind, query in (("held", "?after=11&wait=15.0"), ("next", "?after=11&wait=30.0")):
        url = f"{base}/v1/fragments/2/{kind}{query}"
        async with client.reply("GET", url, kind="") as r:
            status = r.status
        await asyncio.sleep(0.05)
        up, down = relay.take()
        out.append(
            {
                "kind": f"{kind} ({status})",
                "request": parts(up, sealed=False),
                "reply": parts(down, sealed=False),
            }
        )
    await b.close()
    await a.close()
    await client.close()
    await server.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--value-bytes", type=int, default=330, help="a member record's value")
    ap.add_argument("--json", action="store_true", help="print the JSON object last")
    args = ap.parse_args(argv)
    rows = asyncio.run(measure(args.value_bytes))
    for row in rows:
        for side in ("request", "reply"):
            print(f"{row['kind']:>12} {side:>7}: {row[side]}", file=sys.stderr)
    if args.json:
        print(json.dumps({"requests": rows}))


if __name__ == "__main__":
    main()
