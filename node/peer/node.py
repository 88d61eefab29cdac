"""One peer of a swarm: an island (learner) and the owner of some fragments, in one process.

The asyncio node runs on its own thread; the training loop runs on the main thread and never
waits on the network. ``PeerNode`` composes the peer from one object per concern, each built with
the few collaborators it calls, and runs them in one task group:

  transport, rpc, router   node/wire, node/dht   HTTP, the sealed RPC path, the DHT's route
  presence                 node/peer/presence    joining, our member record, the members' view
  expected, finals         node/peer/            the learners a round waits for; final versions
  ownership (+ handoffs)   node/peer/ownership   the fragments we own, replicas and handoffs
  serving                  node/peer/serving     the version routes and their long-polls
  net                      node/diloco/learner   the island's network side (built in ``serve``)

What exists only while serving (the DHT node, the membership, the learner, the task group) is
in ``started``, which the services read.

Joining (``serve``): bind, start the DHT node, join through the initial peers (bootstrap,
dial-back, state sync, then our member record: ``Presence.join``). Only then may the rendezvous
hash hand us fragments to own; a new owner starts from the version it synced and, for a few
seconds, catches up with the previous owner's latest version (versions are fencing tokens).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from node.config import RunConfig
from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.membership import Membership
from node.dht.route import DHTRouter
from node.dht.swarm import SwarmCredentials
from node.diloco.island import Island, Outgoing
from node.diloco.learner import IslandNet, LearnerNetConfig, OwnerLinks, Reach
from node.diloco.owner import FragmentOwner, OwnerCounts
from node.diloco.replica import ReplicaStore
from node.diloco.spread import Holdings, Spreading, SpreadStats
from node.diloco.validation import Evaluator
from node.peer.expected import LearnerExpectations
from node.peer.finals import FINAL_RECHECKS, FINAL_SETTLE_S, FinalFetch, FinalVersions
from node.peer.handoffs import Handoffs
from node.peer.holder_lookup import HolderLookup
from node.peer.ownership import Ownership, OwnershipConfig
from node.peer.presence import Presence, ViewScope
from node.peer.serving import Askers, Published, ServingConfig, VersionServer
from node.peer.started import PeerShared, Started
from node.peer.status import PeerReader
from node.state.artifact_serve import ArtifactServer
from node.state.artifacts import ArtifactStore
from node.state.owner_checkpoint import OwnerCheckpoints
from node.status import Cached, StatusBoard
from node.wire.admission import Identification, MemberAddresses
from node.wire.bodies import pool_bytes_for_model
from node.wire.rpc import RpcServer, max_rpc_body
from node.wire.tls import server_context
from node.wire.transport import LinkEmulator, LinkProfile, Transport
from protocol.diloco.fragments import FragmentPlan
from protocol.wire.messages import Contribution, ReplicaState
from protocol.wire.signing import Signer

__all__ = ["NodeOptions", "PeerNode", "emit"]

log = logging.getLogger("atoll.peer")

_EMIT_LOCK = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """One JSON line to the launcher, whole: the trainer and the node's thread both emit, and
    ``print`` writes a line's text and its newline as two writes, between which another thread's
    line can land (a launcher then cannot parse either, and once missed a peer's "ready")."""
    line = json.dumps({"event": event, **fields}) + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


STATUS_MAX_AGE_S = 1.0  # /v1/status is computed at most this often (as the board is)


@dataclass(frozen=True, slots=True)
class NodeOptions:
    """How one peer is run (the swarm's config is ``RunConfig``).

    ``host``/``port``: where it binds (port 0: any); ``public_address``: the address others dial
    when it is not the bound one. ``tamper`` rewrites our own contributions (attack measurements
    only). ``initial_global``: every fragment's version 0 (the model's initial weights), when the
    island holds other versions already (resumed from a checkpoint); ``versions_known_at``: the
    wall-clock time those versions were held (the checkpoint's), from which the version fence
    counts the merges the swarm can have made. ``event_log_dir``: every owner logs its merger's
    events and decisions there (``atoll replay`` re-runs them). ``owner_checkpoint_dir``: owners
    checkpoint their fragments' states there, and the states found there at start are taken over
    like a handoff (``node.state.owner_checkpoint``). ``evaluator``: what owners check candidate
    versions with before publishing them (``node.diloco.validation``; None: validated
    publication is off, which is logged). ``may_own``: False for a peer that never offers to own
    fragments, which then reads only a bounded view of the members (``node.dht.membership``), as
    does any member of an open swarm outside its capped roster; ``whole_view``: read every
    member's record all the same (a recipe's shards are dealt among the learners seen)."""

    host: str = "127.0.0.1"
    port: int = 0
    public_address: str | None = None
    tamper: Callable[[Outgoing], Outgoing] | None = None
    initial_global: list[torch.Tensor] | None = None
    versions_known_at: float | None = None
    event_log_dir: Path | None = None
    owner_checkpoint_dir: Path | None = None
    evaluator: Evaluator | None = None
    artifacts: ArtifactStore | None = None  # the recipe's artifacts, served to members
    may_own: bool = True  # False: never offer to own; read a bounded view of the members
    whole_view: bool = False  # True: read every member's record even when not owning


class PeerNode:
    """The peer's asyncio side, composed (see the module docstring): serves owners, RPC and the
    DHT, drives the island's network side. ``credentials``: the swarm's admission (None: a
    development swarm, where any reachable member may own fragments)."""

    def __init__(
        self,
        cfg: RunConfig,
        signer: Signer,
        model: torch.nn.Module,
        plan: FragmentPlan,
        options: NodeOptions = NodeOptions(),
        *,
        credentials: SwarmCredentials | None = None,
    ) -> None:
        if cfg.max_tokens_per_step < 1:
            raise ValueError(
                "the swarm config must set max_tokens_per_step (>= 1): the merge clamps "
                "every learner's self-reported tokens to it"
            )
        if credentials is not None and credentials.swarm_id != cfg.swarm:
            raise ValueError(
                f"config swarm {cfg.swarm!r} is not the manifest's swarm id {credentials.swarm_id}"
            )
        self.cfg, self.signer, self.plan, self.options = cfg, signer, plan, options
        self.credentials = credentials
        self.evaluator = _validated_publication(cfg, options.evaluator)
        named = dict(model.named_parameters())
        self.shapes = [[tuple(named[n].shape) for n in f.names] for f in plan.fragments]
        self.started = Started()
        self.transport = self._transport()
        # a large model's bodies: a pool of its size, not a fixed 512 MiB (docs/scale.md)
        self.transport.pool.bound(pool_bytes_for_model(4 * sum(f.numel for f in plan.fragments)))
        self.spread = SpreadStats()  # versions spread peer to peer (``node.diloco.spread``)
        self.holdings = Holdings(len(plan.fragments), self.transport.pool, fanout=cfg.spread_fanout)
        started = self.started  # pointed holders our view lacks, looked up as a fetch needs them
        self.holder_lookup = HolderLookup(lambda: started.membership)
        self._build_services()
        self.owner_checkpoints = self._owner_checkpoints(options.owner_checkpoint_dir)
        # bodies capped by what the plan's largest fragment can need (not a fixed 256 MiB)
        self.rpc = RpcServer(
            self.transport,
            signer,
            authorize=self.presence.authorize,
            max_message=max_rpc_body(f.numel for f in plan.fragments),
        )
        self.rpc.route(Contribution, self.ownership.on_contribution)
        self.rpc.route(ReplicaState, self.ownership.on_replica_state)
        self.router = DHTRouter(self.transport)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()  # bound and listening
        self.joined = threading.Event()  # synced and published: training may start
        self.failure: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self.announce_versions = False  # a launcher counts every published version (and content)
        # /v1/status walks the DHT store (~30 ms at 30k records): at most once a second
        self._status_json = Cached(
            lambda: json.dumps(self.status()).encode(), max_age_s=STATUS_MAX_AGE_S
        )
        app = self.transport.app
        app.router.add_get("/v1/fragments/{p}/{kind}", self.serving.on_fetch)
        app.router.add_get("/v1/fragments/{p}/latest/manifest", self.serving.on_manifest)
        app.router.add_get("/v1/status", self._on_status)
        app.router.add_get("/v1/dialback", self.presence.on_dialback)
        app.router.add_get("/v1/members", self.presence.on_members)
        self.artifacts = (
            ArtifactServer(options.artifacts, self.transport, hints=self._member_urls)
            if options.artifacts is not None
            else None
        )
        if self.artifacts is not None:
            self.artifacts.install()
        self.board = StatusBoard(PeerReader(self))  # "/", "/metrics" and the JSON the page polls

    def _member_urls(self) -> list[str]:
        """The addresses of the members this peer knows (where a missing artifact may be)."""
        members = self.membership.members if self.membership is not None else {}
        return [m.record.url for m in members.values() if m.record.url and m.record.reachable]

    def _transport(self) -> Transport:
        """Our transport, with admission (or, in a development swarm, identification: owners
        still learn who asks), and our Atoll-Auth naming the member we reach."""
        cred, opts = self.credentials, self.options
        tls = server_context(self.signer) if cred is not None and cred.certified else None
        transport = Transport(
            opts.host,
            opts.port,
            link=LinkEmulator(default=LinkProfile.parse(self.cfg.link)),
            tls=tls,
        )
        if cred is not None:
            cred.install(transport)
        else:
            Identification(self.signer, self.cfg.swarm).install(transport)
        started = self.started  # the member records: good at that node only
        transport.recipient_of = MemberAddresses(
            lambda: started.membership.members if started.membership else {}
        )
        return transport

    def _build_services(self) -> None:
        """The peer's services, each with what it calls; callbacks wired here explicitly."""
        cfg, started = self.cfg, self.started
        shared = PeerShared(self.signer, self.transport, started)
        self.presence = Presence(
            cfg,
            shared,
            shapes=self.shapes,
            credentials=self.credentials,
            public_address=self.options.public_address,
            on_suspect=self._reconcile_soon,
            scope=ViewScope(may_own=self.options.may_own, whole_view=self.options.whole_view),
        )
        self.expected = LearnerExpectations(cfg, started, self.presence)
        self.finals = FinalVersions(started, self.expected)
        self.final_fetch = FinalFetch(started, self.presence, len(self.plan.fragments))
        self.ownership = Ownership(
            OwnershipConfig(
                cfg, self.plan, self.shapes, self.evaluator, self.options.event_log_dir
            ),
            shared,
            self.presence,
            self.finals,
            on_publish=self._published,
            on_taken=self._handoff_taken,
        )
        self.serving = VersionServer(
            ServingConfig(cfg, len(self.plan.fragments), self.signer.peer_id),
            self.transport,
            Published(self.ownership.owners, self.finals, self.handoffs.replica_took),
            self.holdings,
            self.spread,
            Askers(
                self.presence.member_url,
                self.credentials,
                self._members_seen,
                find=self.holder_lookup.find,
            ),
        )

    def _members_seen(self) -> int:
        """How many members there are, ourselves included, when this peer reads the whole view
        (an owner does); 0 otherwise: a bounded view holds only the members it looked up, and
        a count too small would have an owner serve a large swarm whole."""
        membership = self.membership
        if membership is None or not membership.sees_all:
            return 0
        return len(membership.members)

    def _owner_checkpoints(self, directory: Path | None) -> OwnerCheckpoints | None:
        """Owner checkpoints in ``directory``; the states found there are taken as handed over."""
        if directory is None:
            return None
        numels = [sum(int(torch.Size(s).numel()) for s in shapes) for shapes in self.shapes]
        checkpoints = OwnerCheckpoints(directory, self.cfg.swarm, numels)
        for p, state in checkpoints.load().items():
            self.replicas.restore(state)
            log.info(
                "fragment %d: owner checkpoint at version %d (epoch %d) loaded",
                p,
                state.version,
                state.epoch,
            )
        return checkpoints

    # --- what the trainer, the launchers and the status page read ------------------------------
    @property
    def handoffs(self) -> Handoffs:
        return self.ownership.handoffs

    @property
    def replicas(self) -> ReplicaStore:
        return self.ownership.replicas

    @property
    def owners(self) -> dict[int, FragmentOwner]:
        return self.ownership.owners

    @property
    def membership(self) -> Membership | None:
        return self.started.membership

    @membership.setter
    def membership(self, membership: Membership | None) -> None:
        self.started.membership = membership

    @property
    def net(self) -> IslandNet | None:
        return self.started.net

    @net.setter
    def net(self, net: IslandNet | None) -> None:
        self.started.net = net

    @property
    def dht(self) -> DHTNode | None:
        return self.started.dht

    @property
    def url(self) -> str:
        return self.presence.url

    @property
    def public_address(self) -> str | None:
        return self.presence.public_address

    @public_address.setter
    def public_address(self, address: str | None) -> None:
        self.presence.public_address = address

    @property
    def reachable(self) -> bool:
        return self.presence.reachable

    @property
    def learning(self) -> bool:
        return self.presence.learning

    @learning.setter
    def learning(self, learning: bool) -> None:
        self.presence.learning = learning

    @property
    def step(self) -> int:
        """The inner step our record claims (the trainer sets it)."""
        return self.presence.step

    @step.setter
    def step(self, step: int) -> None:
        self.presence.step = step

    @property
    def synced(self) -> dict[int, tuple[int, torch.Tensor]]:
        return self.presence.synced

    @property
    def replica_bytes(self) -> int:
        return self.handoffs.replica_bytes

    def owner_of(self, p: int) -> tuple[bytes, str] | None:
        return self.presence.owner_of(p)

    def suspects(self) -> set[bytes]:
        return self.presence.suspects()

    def learner_steps(self) -> list[int]:
        return self.presence.learner_steps()

    def wait_for_members(self, n: int, timeout_s: float = 180.0) -> None:
        self.presence.wait_for_members(n, timeout_s)

    # --- callbacks the services are wired with -------------------------------------------------
    def _reconcile_soon(self) -> None:
        self.ownership.reconcile_soon()

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

    # --- status --------------------------------------------------------------------------------
    async def _on_status(self, _request: web.Request) -> web.Response:
        """``status()`` as JSON, computed at most once per ``STATUS_MAX_AGE_S``."""
        return web.Response(body=self._status_json.get(), content_type="application/json")

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
            *(c for kept in self.ownership.retired.values() for c in kept),
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
            "manifest": self.presence.manifest,
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
            "addresses": self.presence.address_status(),  # address disputes, pin mismatches, manifest claims
            "model_bytes_served": dict(self.serving.model_bytes_served),
            "spread": {
                **self.spread.as_dict(),
                "holder_lookups": self.holder_lookup.lookups,
                "holder_lookups_shared": self.holder_lookup.shared,
            },
            "dht_records_by_signer": self._records_by_signer(),
            "version_jumps_refused": self.net.stats.version_jumps if self.net else 0,
            "handoff_refusals": dict(self.replicas.refusals),  # handoffs refused here, by reason
            "owners": owners,
            "versions": list(island_versions),
            "owned": {str(p): o.version for p, o in self.owners.items()},
            "owner_epochs": {str(p): o.epoch for p, o in self.owners.items()},
            "replicas": {
                **self.replicas.status(),
                "unreplicated_versions": self.handoffs.unreplicated,
                "lease_lapses": self.handoffs.lease_lapses,
                "claimant_fences": self.handoffs.claimant_fences,
                # versions not published for want of a read of the members begun < 4 s before
                "stale_view_fences": self.handoffs.stale_view_fences,
                "view_reads": self.handoffs.view_reads,  # reads a publication awaited
                "resumed": self.handoffs.resumed,  # owners back from a lapsed lease, at once
            },
            "bytes_sent": self.transport.bytes_sent,
            "bytes_received": self.transport.bytes_received,
            "direct_bodies": self.transport.direct_bodies,
            "connections": self.transport.serve_status(),  # caps, evictions, reply deadlines (issue 48)
            "remote_errors": dict(self.rpc.errors),
            "penalties": self.penalties(),
            # per fragment owned: senders refused for low standing, the lowest scores (issue 47)
            "standing": {str(p): o.standing_status() for p, o in self.owners.items()},
            # a recipe swarm's artifacts this peer serves (issue 51); None: it serves none
            "artifacts": self.artifacts.status() if self.artifacts is not None else None,
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
        dht = self.started.dht = DHTNode(
            self.signer,
            self.transport,
            self.url + "/v1/dht",
            DHTConfig(maintenance_period_s=30.0, request_timeout_s=3.0),
        )
        self.router.mount(dht)
        await dht.start()
        cred = self.credentials
        self.started.membership = Membership(
            dht,
            self.cfg.swarm,
            self.presence.manifest,
            swarm_manifest=(lambda: cred.manifest) if cred is not None else None,
            n_fragments=len(self.plan.fragments),
        )
        net = self.started.net = self._learner(island)
        self.ready.set()
        try:
            async with asyncio.TaskGroup() as tg:
                self.started.tg = tg
                try:
                    await self._join(initial_peers)
                except BaseException as exc:
                    self.failure = exc
                    self.joined.set()
                    raise
                self.joined.set()
                tasks = [
                    tg.create_task(net.run()),
                    tg.create_task(self.presence.record_loop()),
                    tg.create_task(self._membership_loop()),
                ]
                await self._stop.wait()
                for t in tasks:
                    t.cancel()
                self.ownership.cancel_tasks()
        finally:
            await self._release_waiters()
            await dht.close()
            await self.transport.close()

    def learner_config(self) -> LearnerNetConfig:
        """The learner side's settings; the largest version reply it takes follows the fragment
        plan (``max_rpc_body``), so an owner can neither make it buffer more than the largest
        fragment's bytes nor have a large model's versions refused."""
        cred = self.credentials
        return LearnerNetConfig(
            swarm=self.cfg.swarm,
            shapes=self.shapes,
            codec=self.cfg.codec,
            block_size=self.cfg.block_size,
            max_message=max_rpc_body(f.numel for f in self.plan.fragments),
            created=cred.manifest.created if cred is not None else None,
            tamper=self.options.tamper,
        )

    def _learner(self, island: Island) -> IslandNet:
        """The island's network side; a resumed island's versions are held (state sync fetches
        only newer ones), as of when its checkpoint held them."""
        opts = self.options
        net = IslandNet(
            island,
            self.learner_config(),
            OwnerLinks(
                self.signer,
                Reach(
                    self.transport,
                    self.presence.owner_of,
                    url_of=self.presence.member_url,
                    on_unreachable=self.presence.unreachable,
                    find=self.holder_lookup.find,
                ),
                self.ownership,
            ),
            spreading=Spreading(holdings=self.holdings, stats=self.spread),
            initial=opts.initial_global,
        )
        known_at = opts.versions_known_at
        for p, version in enumerate(island.versions):
            if version > 0:
                net.remember(p, version, island.global_flat[p])
                if known_at is not None and math.isfinite(known_at):
                    net.received_at[p] = min(net.received_at[p], known_at)
        return net

    async def _join(self, initial_peers: list[str]) -> None:
        """Join (``Presence.join``), then own what the view hands us."""
        await self.presence.join(initial_peers)
        await self.ownership.reconcile()
        assert self.membership is not None
        log.info(
            "joined swarm %s: %d members, reachable=%s",
            self.cfg.swarm,
            len(self.membership.members),
            self.presence.reachable,
        )

    async def _membership_loop(self) -> None:
        """Read everyone's records, follow a newer manifest, probe a disputed address, reconcile
        the fragments we own and tell their owners whom to wait for; then pause."""
        membership = self.membership
        assert membership is not None
        try:
            while True:
                self.presence.scope_view()
                try:
                    await membership.refresh_if_due()
                except Exception as exc:  # the DHT unreachable or slow: the view ages, counted
                    log.info("membership read failed (%s): %r", membership.read_errors, exc)
                await self.presence.follow_manifest()
                await self.presence.probe_disputes()
                await self.ownership.reconcile()
                for owner in list(self.owners.values()):
                    await self.expected.tell_expected(owner)
                await self.presence.pause()
        finally:  # what knowing the swarm cost this peer (docs/scale_peers.md)
            dht = self.started.dht
            log.info(
                "membership: %d reads, %d passes without one, %d ids looked up, view of %d; "
                "DHT requests sent: %s",
                membership.cadence.reads,
                membership.cadence.skipped,
                membership.lookups.looked_up,
                len(membership.members),
                dict(dht.metrics.rpcs_out) if dht is not None else {},
            )

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
        self.presence.learning = False
        if (
            self.membership is not None
        ):  # say so now, not at the next membership pass: owners wait on it
            with contextlib.suppress(Exception):
                await self.membership.publish(self.presence.my_record())

    async def fetch_final(
        self, *, settle_s: float = FINAL_SETTLE_S, rechecks: int = FINAL_RECHECKS
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """Every fragment's final version from its current owner (``FinalFetch.fetch``); then
        the peer fetches no more, and says so to learners pointed at it (``done_fetching``)."""
        finals = await self.final_fetch.fetch(settle_s=settle_s, rechecks=rechecks)
        await self.holdings.done_fetching()
        return finals

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the node's loop from the trainer thread and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def _validated_publication(cfg: RunConfig, evaluator: Evaluator | None) -> Evaluator | None:
    """The evaluator owners check candidates with (None: validated publication off), logged."""
    if cfg.validate_windows <= 0 or evaluator is None:
        log.info(
            "validated publication is off: %s",
            "no validation set was given" if evaluator is None else "--validate-windows 0",
        )
        return None
    log.info(
        "validated publication: %d windows a check from a pool of %d (validation set %s)",
        cfg.validate_windows,
        evaluator.pool,
        evaluator.digest[:16],
    )
    return evaluator
