"""The DHT's HTTP side: one POST route on a ``Transport`` serving every mounted ``DHTNode``.

Theory of operation. ``DHTRouter`` owns ``{prefix}`` (default ``/v1/dht``) for a process's
default node and ``{prefix}/{name}`` for named ones, so one aiohttp server can host many DHT
nodes (a peer mounts one node at the default path; the scale test mounts 500). A node's address
is the full URL of its path, e.g. ``http://127.0.0.1:8080/v1/dht``. A request is verified over
its exact bytes with the addressed node's replay window (via ``node.wire.rpc.serve_sealed_request``:
it must name the addressed node as recipient, except a Ping, which a node joining through a bare
address sends before it knows who answers; its header must fit ``MAX_REQUEST_HEADER``, where a
Store of ``MAX_STORE_RECORDS`` largest records takes ~80 KiB), then ``DHTNode.handle`` answers it
(see ``node.dht.kademlia``), told the requester's IP (``request.remote``) for its per-IP Store
limits and the record store's fair shares, and the reply is sealed with the node's own key for the
requester. A peer's misbehaviour is a ``RemoteProtocolError``:
4xx, counted in ``errors`` and the node's ``metrics.refusals``. A named path with no node mounted
(never mounted, or killed) answers 404, the default path while its node is down 503; a caller
takes either as an unreachable contact.
"""

from __future__ import annotations

import logging
from collections import Counter

from aiohttp import web

from node.dht.kademlia import DHTNode
from node.wire.rpc import serve_sealed_request
from node.wire.transport import Transport
from protocol.dht.messages import Ping
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.wire.signing import Opened

__all__ = ["DHTRouter"]

log = logging.getLogger(
    "node.dht.kademlia"
)  # the name its records had before the router moved here


class DHTRouter:
    """One POST route on ``transport`` serving every mounted ``DHTNode`` (see module docstring).

    Create it before ``transport.start()`` (aiohttp freezes its routes then); mount nodes after.
    """

    def __init__(self, transport: Transport, *, prefix: str = "/v1/dht") -> None:
        if not prefix.startswith("/") or prefix.endswith("/"):
            raise LocalProtocolError(f"prefix must start and not end with '/', got {prefix!r}")
        self.transport, self.prefix = transport, prefix
        self.nodes: dict[str, DHTNode] = {}
        self.errors: Counter[str] = Counter()
        transport.app.router.add_post(prefix, self._serve)
        transport.app.router.add_post(prefix + "/{name}", self._serve)

    def url(self, name: str = "") -> str:
        """The address of node ``name`` ("" is the default node). Needs a started transport."""
        return self.transport.url + self.prefix + (f"/{name}" if name else "")

    def mount(self, node: DHTNode, name: str = "") -> None:
        """Serve ``node`` at ``url(name)``. Raises LocalProtocolError if the name is taken."""
        if name in self.nodes or not all(c.isalnum() or c in "-_." for c in name):
            raise LocalProtocolError(f"cannot mount a DHT node at {name!r}")
        self.nodes[name] = node

    def unmount(self, name: str = "") -> None:
        """Stop serving ``name``: its path answers 503 from now on."""
        self.nodes.pop(name, None)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info.get("name", "")
        node = self.nodes.get(name)
        if node is None:
            # a name nobody mounted is a wrong address (404); the default node is down (503)
            self.errors["no node" if name else "unavailable"] += 1
            body = {
                "error": "NotFound" if name else "Unavailable",
                "reason": f"no DHT node at {request.path}",
            }
            return web.json_response(body, status=404 if name else 503)

        async def dispatch(opened: Opened) -> bytes:
            return node.seal(node.handle(opened, request.remote or ""), recipient=opened.peer_id)

        def refused(exc: RemoteProtocolError) -> None:
            self.errors[type(exc).__name__] += 1
            node.metrics.refusals[type(exc).__name__] += 1
            log.debug("refused DHT request from %s: %r", request.remote, exc)

        return await serve_sealed_request(
            self.transport,
            request,
            max_size=node.config.max_request,
            replay=node.replay,
            recipient=node.peer_id,
            dispatch=dispatch,
            on_error=refused,
            broadcast=(Ping,),
        )
