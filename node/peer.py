"""One peer of a swarm: an island (learner) and the owner of some fragments, in one process.

The asyncio node (transport, RPC, DHT, owners, the island's network side, membership) runs on
its own thread; the training loop runs on the main thread and never waits on the network.
``PeerNode`` is the node's state and lifecycle (``serve``, ``stop_learning``, ``fetch_final``,
``stop``, its status); the rest is mixed in by concern: joining and the members' view
(``node.dht.presence``), the fragments it owns (``node.diloco.owning``), handing their versions
to replicas (``node.diloco.handoffs``) and serving them (``node.diloco.serving``).

Joining (``serve``): bind, start the DHT node, join through the initial peers (bootstrap,
dial-back, state sync, then our member record: ``SwarmPresence._join``). Only then may the
rendezvous hash hand us fragments to own; a new owner starts from the version it synced and, for
a few seconds, catches up with the previous owner's latest version (versions are fencing tokens).

Shutdown: when its steps are done a peer stops learning and republishes its record saying so.
An owner whose learners have all finished closes its last round; the fragment's state is then
final (``GET /v1/fragments/p/final``), and every peer ends on the same global model.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from node.config import RunConfig
from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.membership import Membership, manifest_hash
from node.dht.presence import SwarmPresence
from node.dht.route import DHTRouter
from node.dht.swarm import SwarmCredentials
from node.diloco.handoffs import OwnerHandoffs
from node.diloco.island import Island, Outgoing
from node.diloco.learner import IslandNet, LearnerNetConfig, Reach
from node.diloco.owner import FragmentOwner, OwnerCounts
from node.diloco.owning import OwnedFragments
from node.diloco.replica import ReplicaStore
from node.diloco.serving import VersionServing
from node.diloco.spread import Holdings, SpreadStats
from node.diloco.validation import Evaluator
from node.state.owner_checkpoint import OwnerCheckpoints
from node.state.serve import ManifestCache
from node.status import StatusBoard
from node.wire.admission import Identification, MemberAddresses
from node.wire.rpc import RpcServer, max_rpc_body
from node.wire.tls import server_context
from node.wire.transport import LinkEmulator, LinkProfile, Transport
from protocol.diloco.fragments import FragmentPlan
from protocol.diloco.spread import Fanout
from protocol.wire.messages import Contribution, ReplicaState
from protocol.wire.signing import ReplayWindow, Signer

__all__ = ["PeerNode", "emit"]

log = logging.getLogger("atoll.peer")

# once the final versions are in, the members are read again and a fragment whose owner moved is
# fetched again from the new one: up to FINAL_RECHECKS times, FINAL_SETTLE_S apart
FINAL_SETTLE_S = 2.0
FINAL_RECHECKS = 3


_EMIT_LOCK = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """One JSON line to the launcher, whole: the trainer and the node's thread both emit, and
    ``print`` writes a line's text and its newline as two writes, between which another thread's
    line can land (a launcher then cannot parse either, and once missed a peer's "ready")."""
    line = json.dumps({"event": event, **fields}) + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


class PeerNode(SwarmPresence, OwnedFragments, OwnerHandoffs, VersionServing):
    """The peer's asyncio side: serves owners, RPC and the DHT, drives the island's network side."""

    def __init__(
        self,
        cfg: RunConfig,
        signer: Signer,
        model: torch.nn.Module,
        plan: FragmentPlan,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        public_address: str | None = None,
        tamper: Callable[[Outgoing], Outgoing] | None = None,
        credentials: SwarmCredentials | None = None,
        initial_global: list[torch.Tensor] | None = None,
        versions_known_at: float | None = None,
        event_log_dir: Path | None = None,
        owner_checkpoint_dir: Path | None = None,
        evaluator: Evaluator | None = None,
    ) -> None:
        """``initial_global``: every fragment's version 0 (the model's initial weights), when the
        island passed in holds other versions already (resumed from a checkpoint).
        ``versions_known_at``: the wall-clock time the resumed versions were held (the
        checkpoint's), from which the version fence counts the merges the swarm can have made.
        ``event_log_dir``: every owner logs its merger's events and decisions there, one file per
        fragment and ownership (``atoll replay`` re-runs them).
        ``owner_checkpoint_dir``: owners checkpoint their fragments' states there, and the states
        found there at start are taken over like a handoff (``node.state.owner_checkpoint``).
        ``evaluator``: what owners check candidate versions with before publishing them
        (``node.diloco.validation``; None: validated publication is off, which is logged)."""
        if cfg.max_tokens_per_step < 1:
            raise ValueError(
                "the swarm config must set max_tokens_per_step (>= 1): the merge clamps "
                "every learner's self-reported tokens to it"
            )
        self.cfg, self.signer, self.plan = cfg, signer, plan
        self.tamper = tamper  # rewrites our own contributions: attack measurements only
        self.evaluator = evaluator if cfg.validate_windows > 0 else None
        if self.evaluator is None:
            log.info(
                "validated publication is off: %s",
                "no validation set was given" if evaluator is None else "--validate-windows 0",
            )
        else:
            log.info(
                "validated publication: %d windows a check from a pool of %d (validation set %s)",
                cfg.validate_windows,
                self.evaluator.pool,
                self.evaluator.digest[:16],
            )
        self.public_address = public_address
        # Without credentials (a development swarm) any reachable member may own fragments.
        self.credentials = credentials
        self.initial_global, self.event_log_dir = initial_global, event_log_dir
        self.versions_known_at = versions_known_at
        if credentials is not None and credentials.swarm_id != cfg.swarm:
            raise ValueError(
                f"config swarm {cfg.swarm!r} is not the manifest's swarm id {credentials.swarm_id}"
            )
        tls = server_context(signer) if credentials is not None and credentials.certified else None
        self.transport = Transport(
            host, port, link=LinkEmulator(default=LinkProfile.parse(cfg.link)), tls=tls
        )
        if credentials is not None:
            credentials.install(self.transport)
        else:  # a development swarm: no admission, but owners still learn who asks
            Identification(signer, cfg.swarm).install(self.transport)
        # our Atoll-Auth names the member we reach (from the member records): good at that node only
        self.transport.recipient_of = MemberAddresses(
            lambda: self.membership.members if self.membership else {}
        )
        self.model_bytes_served: collections.Counter[str] = (
            collections.Counter()
        )  # key hex -> bytes
        self._long_polls: collections.Counter[str] = (
            collections.Counter()
        )  # poller -> long-polls held
        self.spread = SpreadStats()  # versions spread peer to peer (``node.diloco.spread``)
        self._fanouts: dict[int, Fanout] = {}  # fragment -> this owner's serve-or-point decisions
        self.holdings = Holdings(len(plan.fragments), self.transport.pool, fanout=cfg.spread_fanout)
        # bodies capped by what the plan's largest fragment can need (not a fixed 256 MiB)
        self.rpc = RpcServer(
            self.transport,
            signer,
            authorize=self._authorize,
            max_message=max_rpc_body(f.numel for f in plan.fragments),
        )
        self.router = DHTRouter(self.transport)
        self.dht: DHTNode | None = None
        self.membership: Membership | None = None
        self.manifest = manifest_hash(cfg)
        named = dict(model.named_parameters())
        self.shapes = [[tuple(named[n].shape) for n in f.names] for f in plan.fragments]
        self.owners: dict[int, FragmentOwner] = {}
        self._retired_owners: dict[
            int, list[OwnerCounts]
        ] = {}  # what is kept of the owners this peer retired
        self._suspect_since: dict[bytes, float] = {}  # peer id -> when it failed us (wall clock)
        self._owner_tasks: dict[int, asyncio.Task[None]] = {}
        self.net: IslandNet | None = None
        self.learning = True
        self.awaited_members = 0  # wait_for_members: read members often until this many are seen
        self.record_published_at: float | None = None  # monotonic time our record was last stored
        self.lease_lapses = (
            0  # versions not published: our record may have expired in others' views
        )
        self.reachable = False
        self.step = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()  # bound and listening
        self.joined = threading.Event()  # synced and published: training may start
        self.synced: dict[int, tuple[int, torch.Tensor]] = {}
        self.failure: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._manifests = ManifestCache()
        self._lookup_lock = asyncio.Lock()
        self._last_lookup = -math.inf
        self._unknown: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self.member_lookups = 0
        self.rpc.route(Contribution, self._on_contribution)
        self.rpc.route(ReplicaState, self._on_replica_state)
        numels = [sum(int(torch.Size(s).numel()) for s in shapes) for shapes in self.shapes]
        self.replicas = ReplicaStore(cfg.swarm, numels)
        self.owner_checkpoints = (
            OwnerCheckpoints(owner_checkpoint_dir, cfg.swarm, numels)
            if owner_checkpoint_dir is not None
            else None
        )
        if self.owner_checkpoints is not None:
            for p, state in self.owner_checkpoints.load().items():
                self.replicas.restore(state)
                log.info(
                    "fragment %d: owner checkpoint at version %d (epoch %d) loaded",
                    p,
                    state.version,
                    state.epoch,
                )
        self._replica_replay = ReplayWindow()
        self._fenced_until: dict[int, float] = {}
        self._last_owner: dict[
            int, bytes
        ] = {}  # per fragment, the owner the last ownership pass saw
        self._passed_on: set[tuple[int, bytes, int]] = set()  # (fragment, peer, version) handed on
        self._seen_learning: set[bytes] = set()  # sync modes: every learner seen, and those done
        self._finished: set[bytes] = set()
        self.unreplicated = 0  # versions published with no replica reachable
        self.replica_bytes = (
            0  # tensor bytes handed to replicas (an owner's upload besides versions)
        )
        self.replica_took: dict[
            int, tuple[int, bytes]
        ] = {}  # fragment -> (version, replica that took it)
        self.announce_versions = False  # a launcher counts every published version (and content)
        app = self.transport.app
        app.router.add_get("/v1/fragments/{p}/{kind}", self._on_fetch)
        app.router.add_get("/v1/fragments/{p}/latest/manifest", self._on_manifest)
        app.router.add_get("/v1/status", self._on_status)
        app.router.add_get("/v1/dialback", self._on_dialback)
        app.router.add_get("/v1/members", self._on_members)
        self.board = StatusBoard(self)  # "/", "/metrics" and the JSON the page polls

    def _published(self, fragment: int, version: int, digest: bytes) -> None:
        owner = self.owners.get(fragment)
        if owner is not None:
            self.spread.owned_version(fragment, version, owner.latest.size)
        if owner is not None:  # once retired, this peer refuses another content for this version
            self.replicas.fence(fragment, owner.epoch, version, digest)
            if self.owner_checkpoints is not None:
                self.owner_checkpoints.offer(owner.state())
        if self.announce_versions:
            emit("published", fragment=fragment, version=version, digest=digest.hex()[:32])

    def _handoff_taken(self, fragment: int, version: int, digest: bytes) -> None:
        if self.announce_versions:  # a launcher checks that no forged state was taken
            emit("handoff_taken", fragment=fragment, version=version, digest=digest.hex()[:32])

    status_max_age_s = 1.0  # /v1/status is computed at most this often (as the board is)
    _status_cache: tuple[float, bytes] | None = None  # (when, JSON)

    async def _on_status(self, _request: web.Request) -> web.Response:
        """``status()`` as JSON, computed at most once per ``status_max_age_s`` (it walks the DHT
        store: ~30 ms at 30k records), like the status board."""
        now = time.monotonic()
        cached = self._status_cache
        if cached is None or not 0 <= now - cached[0] < self.status_max_age_s:
            cached = self._status_cache = (now, json.dumps(self.status()).encode())
        return web.Response(body=cached[1], content_type="application/json")

    def penalties(self) -> dict[str, dict[str, int]]:
        """Per sender (peer id hex), what this peer's owners' merge bounds did to its contributions:
        merged, late (merged after its round closed), clipped, weight_capped, steps_bounded, tokens_bounded,
        work_capped (it covered more inner steps than a contribution counts for under outer momentum),
        dropped, refused_<why>."""
        out: dict[str, collections.Counter[str]] = {}
        for owner in self.all_owners():
            for peer, counts in owner.penalties.items():
                out.setdefault(peer.hex(), collections.Counter()).update(counts)
        return {peer: dict(counts) for peer, counts in out.items()}

    def all_owners(self) -> list[OwnerCounts]:
        """The counts of every fragment owner this peer has run, retired ones included."""
        return [
            *(o.counts for o in self.owners.values()),
            *(c for kept in self._retired_owners.values() for c in kept),
        ]

    def status(self) -> dict[str, Any]:
        members = self.membership.members if self.membership else {}
        owners = {}
        for p in range(len(self.plan.fragments)):
            o = self.owner_of(p)
            owners[str(p)] = {"peer_id": o[0].hex(), "url": o[1]} if o else None
        island_versions = self.net.island.versions if self.net else []
        return {
            "swarm": self.cfg.swarm,
            "manifest": self.manifest,
            "peer_id": self.signer.peer_id.hex(),
            "url": self.url,
            "reachable": self.reachable,
            "learning": self.learning,
            "step": self.step,
            "members": [
                {
                    "peer_id": m.peer_id.hex(),
                    "url": m.record.url,
                    "roles": list(m.record.roles),
                    "lab": m.lab,
                    "certified_roles": list(m.cert.roles) if m.cert else [],
                    "reachable": m.record.reachable,
                    "learning": m.record.learning,
                    "step": m.record.step,
                }
                for m in members.values()
            ],
            "refused_members": {
                pid.hex(): why for pid, why in list(self.membership.refused.items())[:256]
            }
            if self.membership
            else {},
            "admission": self.credentials.status() if self.credentials else None,
            "addresses": self.address_status(),  # address disputes, pin mismatches, manifest claims
            "model_bytes_served": dict(self.model_bytes_served),
            "spread": self.spread.as_dict(),
            "dht_records_by_signer": self._records_by_signer(),
            "version_jumps_refused": self.net.stats.version_jumps if self.net else 0,
            "handoff_refusals": dict(self.replicas.refusals),  # handoffs refused here, by reason
            "owners": owners,
            "versions": list(island_versions),
            "owned": {str(p): o.version for p, o in self.owners.items()},
            "owner_epochs": {str(p): o.epoch for p, o in self.owners.items()},
            "replicas": {
                **self.replicas.status(),
                "unreplicated_versions": self.unreplicated,
                "lease_lapses": self.lease_lapses,
            },
            "bytes_sent": self.transport.bytes_sent,
            "bytes_received": self.transport.bytes_received,
            "direct_bodies": self.transport.direct_bodies,
            "connections": self.transport.serve_status(),  # caps, evictions, reply deadlines (issue 48)
            "remote_errors": dict(self.rpc.errors),
            "penalties": self.penalties(),
            # per fragment owned: senders refused for low standing, the lowest scores (issue 47)
            "standing": {str(p): o.standing_status() for p, o in self.owners.items()},
        }

    def standings(self) -> dict[str, float]:
        """Per sender (peer id hex), its lowest standing score at this peer's owners now."""
        out: dict[str, float] = {}
        for owner in self.owners.values():
            peers, scores = owner.standing.export(version=owner.version)
            for peer, score in zip(peers, scores, strict=True):
                key = peer.hex()
                out[key] = min(score, out.get(key, score))
        return out

    def _records_by_signer(self) -> dict[str, int]:
        """How many records this node stores per signing key (bounded listing)."""
        if self.dht is None:
            return {}
        counts: collections.Counter[str] = collections.Counter()
        now = time.time()
        keys = self.dht.records.keys()
        for key in keys:
            for rec in self.dht.records.get(key, now):
                counts[rec.public_key.hex()] += 1
        return dict(counts.most_common(256))

    # --- lifecycle -----------------------------------------------------------------------------
    async def serve(self, island: Island, initial_peers: list[str]) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.transport.start()
        self.dht = DHTNode(
            self.signer,
            self.transport,
            self.url + "/v1/dht",
            DHTConfig(maintenance_period_s=30.0, request_timeout_s=3.0),
        )
        self.router.mount(self.dht)
        await self.dht.start()
        cred = self.credentials
        self.membership = Membership(
            self.dht,
            self.cfg.swarm,
            self.manifest,
            swarm_manifest=(lambda: cred.manifest) if cred is not None else None,
            n_fragments=len(self.plan.fragments),
        )
        self.net = IslandNet(
            island,
            self.signer,
            LearnerNetConfig(
                swarm=self.cfg.swarm,
                shapes=self.shapes,
                codec=self.cfg.codec,
                block_size=self.cfg.block_size,
                created=cred.manifest.created if cred is not None else None,
                tamper=self.tamper,
            ),
            Reach(
                self.transport,
                self.owner_of,
                url_of=self._member_url,
                on_unreachable=self._unreachable,
            ),
            local=self,
            holdings=self.holdings,
            spread=self.spread,
            initial=self.initial_global,
        )
        for p, version in enumerate(island.versions):  # resumed: state sync fetches only newer ones
            if version > 0:
                self.net.remember(p, version, island.global_flat[p])
                if self.versions_known_at is not None and math.isfinite(self.versions_known_at):
                    self.net.received_at[p] = min(self.net.received_at[p], self.versions_known_at)
        self.ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                try:
                    await self._join(initial_peers)
                except BaseException as exc:
                    self.failure = exc
                    self.joined.set()
                    raise
                self.joined.set()
                tasks = [
                    tg.create_task(self.net.run()),
                    tg.create_task(self._record_loop()),
                    tg.create_task(self._membership_loop()),
                ]
                await self._stop.wait()
                for t in [*tasks, *self._owner_tasks.values()]:
                    t.cancel()
        finally:
            await self._release_waiters()
            await self.dht.close()
            await self.transport.close()

    async def _release_waiters(self) -> None:
        """Answer every long-poll this peer is holding open (204) before its server closes: the
        server waits for handlers still running, up to its shutdown timeout, and at a swarm's end
        every peer holds others' polls. The owners retire (nothing is handed over: the peer is
        leaving, and its replicas hold its last versions); the versions it holds for others stop
        being waited for."""
        for owner in list(self.owners.values()):
            with contextlib.suppress(Exception):
                await owner.retire()
        await self.holdings.close()

    async def stop_learning(self, flush_s: float = 60.0) -> None:
        """Send what the island has submitted, then say (in our member record) that we stopped.

        Owners declare a fragment final once no member is learning, and refuse contributions from
        a member whose record says it stopped, so flushing first is what gets ours counted."""
        if self.net is not None:
            try:
                async with asyncio.timeout(flush_s):
                    await self.net.flush()
            except TimeoutError:
                log.warning(
                    "contributions still unsent after %.0f s; stopping without them", flush_s
                )
        self.learning = False
        if (
            self.membership is not None
        ):  # say so now, not at the next membership pass: owners wait on it
            with contextlib.suppress(Exception):
                await self.membership.publish(self.my_record())

    async def fetch_final(
        self, *, settle_s: float = FINAL_SETTLE_S, rechecks: int = FINAL_RECHECKS
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """Every fragment's final version from its current owner (verified).

        An owner declares its fragment final once no member is learning and its last round is
        merged; until then this keeps asking (an owner may be finishing a merge or moving).
        Then the members are read afresh (a full read) and each fragment's owner looked up
        again: a fragment whose owner changed since it answered is fetched again from the new
        one, ``settle_s`` later, up to ``rechecks`` times. Views that differed while the machine
        was overloaded (records lapsing) converge once training stops, and a successor that split
        off and declared an older version final then no longer speaks for the fragment."""
        out: dict[int, tuple[int, torch.Tensor]] = {}
        answered: dict[int, bytes] = {}  # fragment -> the owner that declared its final version
        for check in range(rechecks + 1):
            await self._fetch_missing_finals(out, answered)
            if check == rechecks:
                break
            if check > 0:
                await asyncio.sleep(settle_s)
            if self.membership is not None:
                with contextlib.suppress(Exception):
                    await self.membership.refresh(full=True)
            moved = [
                p
                for p in out
                if (current := self.owner_of(p)) is not None and current[0] != answered[p]
            ]
            if not moved:
                break
            for p in moved:
                log.warning(
                    "fragment %d: its owner changed after it declared version %d final; "
                    "asking the new owner",
                    p,
                    out[p][0],
                )
                del out[p]
        return out

    async def _fetch_missing_finals(
        self, out: dict[int, tuple[int, torch.Tensor]], answered: dict[int, bytes]
    ) -> None:
        """Fill ``out`` with every fragment's final version, asking each one's owner until it
        declares it (an owner may be finishing a merge or moving); note who answered."""
        assert self.net is not None
        while len(out) < len(self.shapes):
            for p in range(len(self.shapes)):
                if p in out:
                    continue
                owner = self.owner_of(p)
                if owner is None:
                    await asyncio.sleep(0.5)
                    continue
                try:
                    got = await self.net.fetch(
                        p, after=self.net.received[p], wait_s=5.0, final=True, owner=owner
                    )
                except Exception as exc:  # keep trying: the owner may be finishing a merge
                    log.warning("final fetch of fragment %d failed: %r", p, exc)
                    await asyncio.sleep(0.5)
                    continue
                if got is not None:
                    out[p], answered[p] = got, owner[0]

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the node's loop from the trainer thread and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
