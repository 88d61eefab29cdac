"""One peer of a swarm: an island (learner) and the owner of some fragments, in one process.

The asyncio node (transport, RPC, owners, the island's network side, heartbeats) runs on its
own thread; the training loop runs on the main thread and never waits on the network. The
launcher (``node.swarm``) talks to the peer with JSON lines on stdin/stdout.

Shutdown: when its steps are done a peer stops contributing and says so in its heartbeats.
An owner whose learners have all finished closes its last round; the fragment's state is then
final. Every peer fetches every fragment's final version, so all hold the same global model,
evaluates it, prints its result, and serves until the launcher says stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from node.config import RunConfig
from node.island import Island
from node.learner import IslandNet
from node.model import GPTConfig
from node.owner import FragmentOwner
from node.rpc import RpcServer
from node.transport import LinkEmulator, LinkProfile, Transport
from protocol.diloco.fragments import FragmentPlan, owners_of
from protocol.diloco.merge import MergeConfig
from protocol.diloco.outer import OuterConfig
from protocol.errors import NotAuthorized, UnknownFragment
from protocol.wire.messages import Ack, Contribution, Hello, PeerInfo
from protocol.wire.signing import Opened, Signer

__all__ = ["Member", "PeerNode", "emit"]

log = logging.getLogger("atoll.peer")

LIVENESS_S = 8.0
HEARTBEAT_S = 1.0


@dataclass
class Member:
    index: int
    peer_id: bytes
    url: str
    last_seen: float = 0.0
    learning: bool = True


def emit(event: str, **fields: Any) -> None:
    """One JSON line to the launcher."""
    print(json.dumps({"event": event, **fields}), flush=True)


class PeerNode:
    """The peer's asyncio side: serves owners and RPC, drives the island's network side."""

    def __init__(self, cfg: RunConfig, index: int, signer: Signer, model: torch.nn.Module,
                 plan: FragmentPlan) -> None:
        self.cfg, self.index, self.signer, self.plan = cfg, index, signer, plan
        self.transport = Transport(link=LinkEmulator(default=LinkProfile.parse(cfg.link)))
        self.rpc = RpcServer(self.transport, signer, authorize=self._is_member)
        self.members: dict[bytes, Member] = {}
        named = dict(model.named_parameters())
        self.shapes = [[tuple(named[n].shape) for n in f.names] for f in plan.fragments]
        self.initial = [torch.cat([named[n].detach().reshape(-1).float() for n in f.names])
                        for f in plan.fragments]
        self.owners: dict[int, FragmentOwner] = {}
        self.net: IslandNet | None = None
        self.learning = True
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._members_set: asyncio.Event | None = None
        self.rpc.route(Contribution, self._on_contribution)
        self.rpc.route(Hello, self._on_hello)
        app = self.transport.app
        app.router.add_get("/v1/fragments/{p}/{kind}", self._on_fetch)
        app.router.add_get("/v1/status", self._on_status)

    # --- membership ----------------------------------------------------------------------------
    def _is_member(self, peer_id: bytes) -> bool:
        return peer_id in self.members

    def set_members(self, members: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        self.members = {bytes.fromhex(m["peer_id"]): Member(m["index"], bytes.fromhex(m["peer_id"]), m["url"], now)
                        for m in members}
        ids = self.owner_candidates()
        for p, fragment in enumerate(self.plan.fragments):
            if owners_of(self.cfg.swarm, p, ids, 1)[0] == self.signer.peer_id:
                self.owners[p] = FragmentOwner(
                    swarm=self.cfg.swarm, fragment=fragment, shapes=self.shapes[p],
                    initial=self.initial[p], merge_cfg=self._merge_cfg(), outer_cfg=self._outer_cfg(),
                    signer=self.signer, download_codec=self.cfg.download_codec,
                )
        assert self._members_set is not None
        self._members_set.set()

    def owner_candidates(self) -> list[bytes]:
        """Members that can be dialled; one without an address is a learner only."""
        return [m.peer_id for m in self.members.values() if m.url]

    def owner_of(self, p: int) -> tuple[bytes, str] | None:
        candidates = self.owner_candidates()
        if not candidates:
            return None
        owner = owners_of(self.cfg.swarm, p, candidates, 1)[0]
        return owner, self.members[owner].url

    def _merge_cfg(self) -> MergeConfig:
        c = self.cfg
        return MergeConfig(quorum=c.quorum, gamma=c.grace_gamma, tau=c.grace_tau, grace_cap_s=c.grace_cap_s,
                           staleness_bound=c.staleness_bound, late_policy=c.late_policy,
                           max_tokens_per_step=c.batch_size * GPTConfig.preset(c.model).block_size)

    def _outer_cfg(self) -> OuterConfig:
        return OuterConfig(lr=self.cfg.outer_lr, momentum=self.cfg.outer_momentum)

    def expected_learners(self) -> int:
        now = time.monotonic()
        return sum(1 for m in self.members.values() if m.learning and now - m.last_seen < LIVENESS_S)

    # --- handlers ------------------------------------------------------------------------------
    async def _on_contribution(self, opened: Opened) -> Ack:
        msg = opened.message
        assert isinstance(msg, Contribution)
        if msg.swarm != self.cfg.swarm:
            raise NotAuthorized(f"contribution for swarm {msg.swarm!r}, this is {self.cfg.swarm!r}")
        owner = self.owners.get(msg.fragment)
        if owner is None:
            raise UnknownFragment(f"fragment {msg.fragment} is not owned here (plan has {len(self.plan.fragments)})")
        self.members[opened.peer_id].last_seen = time.monotonic()
        return await owner.contribute(opened.peer_id, msg)

    async def _on_hello(self, opened: Opened) -> Ack:
        msg = opened.message
        assert isinstance(msg, Hello)
        member = self.members[opened.peer_id]
        member.last_seen = time.monotonic()
        member.learning = "learner" in msg.roles
        return Ack(accepted=True, reason="hello", version=0)

    async def _on_fetch(self, request: web.Request) -> web.StreamResponse:
        try:
            p = int(request.match_info["p"])
            after = int(request.query.get("after", "-1"))
            wait_s = min(float(request.query.get("wait", "0")), 30.0)
        except ValueError:
            return web.json_response({"error": "DecodeError", "reason": "p, after and wait must be numbers"}, status=400)
        owner = self.owners.get(p)
        if owner is None:
            return web.json_response({"error": "UnknownFragment", "reason": f"fragment {p} is not owned here"}, status=404)
        if request.match_info["kind"] == "final":
            sealed = await self._wait_final(owner, wait_s)
        else:
            sealed = await owner.wait_after(after, wait_s)
        if sealed is None:
            return web.Response(status=204)
        return await self.transport.stream_reply(request, sealed.iter_chunks(), sealed.size)

    async def _wait_final(self, owner: FragmentOwner, wait_s: float) -> Any:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.expected_learners() == 0 and owner.idle():
                return owner.latest
            await owner.set_expected(self.expected_learners())
            await asyncio.sleep(0.1)
        return None

    async def _on_status(self, _request: web.Request) -> web.Response:
        return web.json_response(self.status())

    def status(self) -> dict[str, Any]:
        return {
            "peer_id": self.signer.peer_id.hex(), "url": self.transport.url,
            "members": [{"index": m.index, "url": m.url, "learning": m.learning} for m in self.members.values()],
            "owned": {p: o.version for p, o in self.owners.items()},
            "remote_errors": dict(self.rpc.errors),
        }

    # --- lifecycle -----------------------------------------------------------------------------
    async def serve(self, island: Island) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop, self._members_set = asyncio.Event(), asyncio.Event()
        await self.transport.start()
        self.ready.set()
        try:
            await self._members_set.wait()
            self.net = IslandNet(island, self.transport, self.signer, swarm=self.cfg.swarm, shapes=self.shapes,
                                 owner_of=self.owner_of, codec=self.cfg.codec, block_size=self.cfg.block_size)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.net.run()), tg.create_task(self._heartbeat())]
                tasks += [tg.create_task(o.run()) for o in self.owners.values()]
                await self._stop.wait()
                for t in tasks:
                    t.cancel()
        finally:
            await self.transport.close()

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)

    async def _heartbeat(self) -> None:
        me = PeerInfo(peer_id=self.signer.peer_id, address=self.transport.url)
        while True:
            roles = ("learner", "owner") if self.learning else ("owner",)
            hello = Hello(swarm=self.cfg.swarm, peer=me, roles=roles, step=0)
            sealed = self.rpc.seal_reply(hello)
            for m in list(self.members.values()):
                if m.peer_id == self.signer.peer_id:
                    m.last_seen, m.learning = time.monotonic(), self.learning
                    continue
                if not m.url:
                    continue
                with contextlib.suppress(Exception):
                    status, buf, _, _ = await self.transport.request(
                        "POST", f"{m.url}/v1/rpc", chunks=[sealed], size=len(sealed), timeout_s=5)
                    self.transport.pool.give(buf)
            for o in self.owners.values():
                await o.set_expected(self.expected_learners())
            await asyncio.sleep(HEARTBEAT_S)

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the node's loop from the trainer thread and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
