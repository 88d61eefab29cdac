"""``atoll bootstrap``: a DHT-only node, a stable entry point for a swarm.

It trains nothing and owns nothing: it answers the DHT (so joining peers find each other and
the member records), dials joining peers back (``/v1/dialback``) so they learn whether they can
be reached, and lists a swarm's members (``/v1/members?swarm=NAME``) for ``atoll join``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

from aiohttp import web

from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.membership import MemberRecord, members_key
from node.dht.route import DHTRouter
from node.wire.transport import Transport
from protocol.errors import DecodeError
from protocol.wire.signing import Signer

__all__ = ["BootstrapNode", "member_list", "run_bootstrap"]


async def member_list(dht: DHTNode, swarm: str) -> list[dict[str, Any]]:
    """The live member records of ``swarm`` as JSON-ready dicts (records that fail to decode are skipped)."""
    out = []
    for rec in await dht.get(members_key(swarm)):
        with contextlib.suppress(DecodeError):
            m = MemberRecord.decode(rec.value)
            out.append({"peer_id": rec.subkey.hex(), "url": m.url, "roles": list(m.roles),
                        "reachable": m.reachable, "learning": m.learning, "step": m.step,
                        "manifest": m.manifest, "expires_at": rec.expires_at})
    return out


async def dialback(request: web.Request, dht: DHTNode) -> web.Response:
    """Ping the DHT node of the peer at ``?url=``; answer whether it replied, and as whom."""
    url = request.query.get("url", "")
    if not url.startswith(("http://", "https://")):
        return web.json_response({"error": "DecodeError", "reason": "url must be http(s)"}, status=400)
    contact = await dht.ping(url.rstrip("/") + "/v1/dht")
    return web.json_response({"reachable": contact is not None,
                              "peer_id": contact.peer_id.hex() if contact else None})


class BootstrapNode:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, public_address: str | None = None) -> None:
        self.transport = Transport(host, port)
        self.router = DHTRouter(self.transport)
        self.public_address = public_address
        self.signer = Signer.from_seed(os.urandom(32))
        self.dht: DHTNode | None = None
        app = self.transport.app
        app.router.add_get("/v1/members", self._members)
        app.router.add_get("/v1/dialback", self._dialback)
        app.router.add_get("/v1/status", self._status)

    @property
    def url(self) -> str:
        return self.public_address or self.transport.url

    async def start(self, initial_peers: list[str]) -> str:
        await self.transport.start()
        self.dht = DHTNode(self.signer, self.transport, self.url + "/v1/dht", DHTConfig(maintenance_period_s=30.0))
        self.router.mount(self.dht)
        await self.dht.start()
        if initial_peers:
            await self.dht.bootstrap([u.rstrip("/") + "/v1/dht" for u in initial_peers])
        return self.url

    async def close(self) -> None:
        if self.dht is not None:
            await self.dht.close()
        await self.transport.close()

    async def _members(self, request: web.Request) -> web.Response:
        assert self.dht is not None
        swarm = request.query.get("swarm", "atoll-local")
        return web.json_response({"swarm": swarm, "members": await member_list(self.dht, swarm)})

    async def _dialback(self, request: web.Request) -> web.Response:
        assert self.dht is not None
        return await dialback(request, self.dht)

    async def _status(self, _request: web.Request) -> web.Response:
        assert self.dht is not None
        return web.json_response({"role": "bootstrap", "peer_id": self.signer.peer_id.hex(), "url": self.url,
                                  "dht_contacts": len(self.dht.routing), "dht_keys": len(self.dht.records)})


async def run_bootstrap(host: str, port: int, public_address: str | None, initial_peers: list[str]) -> None:
    """Serve until SIGINT or SIGTERM."""
    node = BootstrapNode(host, port, public_address)
    url = await node.start(initial_peers)
    print(f"atoll bootstrap node listening at {url}", flush=True)
    print(f"join with: atoll join --initial-peers {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await node.close()
