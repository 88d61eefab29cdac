"""Hundreds of real peers on one box: what each peer's control traffic, view and spread cost.

Every peer is a real ``PeerNode`` (its own aiohttp server on 127.0.0.1, its own client session,
Ed25519-sealed RPCs, the real DHT and membership) around an ``Island`` of a tiny tensor model
(``TinyModel``: a few hundred floats) whose inner "optimizer" is stand-in compute: each step sets
a seeded gradient (a drift every peer shares plus its own noise) and takes an SGD step, then waits
``step_s``. The transport is the real loopback one, with no link emulation: what is measured is
the bytes the protocol puts on the wire (``Transport.bytes_by_route``) and the CPU the box has.

Peers live ``--per-process`` to a worker process (one asyncio loop each, ``torch`` on one
thread). The parent starts every worker at once and, when all are up, sets the clock's start;
worker 0's first peer founds the swarm. Each worker's first peer is its seed: seeds join through
the founder, the other peers through their worker's seed and joined neighbours
(``bootstrap_peers``), at most ``JOINS_AT_ONCE`` joins a worker at a time, a failed join retried.
Every worker follows the same seeded schedule (``Schedule``): the first ``peers`` join, seeds
first, staggered over ``join_s`` (``join_order``); the swarm trains; from
``churn_at`` on, each minute ``churn`` of the peers leaves (half said goodbye: ``stop_learning``
then stop; half killed: the node's task cancelled, its record left to lapse) and as many new
peers join; at ``duration_s`` everyone stops. Each worker samples its live peers every
``sample_s`` and reports, at the end, one JSON line: per peer the bytes sent by route in the
measured window, member-view sizes, every fragment's owner as each peer names it at each sample,
when each peer first held each fragment version, and the process's peak RSS.

The parent turns them into one case per swarm size (``summarize``):

``control_bytes_per_peer_s``  bytes sent on control routes (anything that is not a fragment's
                              payload: DHT reads and stores, status, dial-backs, manifests,
                              "held" pointers) per live peer per second over the steady window
                              (after every first peer joined and ``settle_s``, before churn);
                              ``control_by_route`` splits it by route
``member_view``               the mean number of members a peer's view holds (steady window)
``spread_p99_s``              per fragment version, the time from its first holder (its owner)
                              until 99 % of the learners live through it held it or a newer
                              one (a learner that took v+1 without ever holding v is not
                              behind); the median over versions (``spread_p99_max_s``: the
                              worst), of the ``versions_reaching_99`` of ``versions_judged``
                              that got there within the horizon. ``spread_p99_exact_s`` (and
                              ``versions_reaching_99_exact``): the strict one, counting only
                              learners seen holding v itself (sampled every 0.1 s)
``spread_counts``             what the peers' fetches did (pointers, fallbacks, holders, ...)
``holder_uploads_per_version``  learners' uploads of the versions they re-served as holders,
                              per version re-served (the mean; ``..._max``: the most of any one
                              version by any one holder)
``owner_agreement``           per sample outside the join phase and churn, and per fragment,
                              the fraction of pairs of live peers that name the same owner;
                              the mean. ``owner_agreement_settled``: the same, leaving out the
                              samples within ``PROPAGATION_S`` of a change of the owner most
                              peers name (``owner_moves``; views learn of a move at their next
                              reads: that is propagation, not disagreement); each move and each
                              peer naming another owner outside one: ``owner_move_log``,
                              ``owner_dissent_log``; what each dissenter's candidate owners
                              lacked or had beside the majority's: ``owner_dissent_causes``
                              (``dissent_causes``). ``owner_agreement_churn``: the agreement
                              over the churn windows' samples
``peak_rss_mb``               the largest worker's peak RSS (``rss_mb_per_peer``: all workers'
                              peaks summed, per peer)
``unowned_max_s``             the longest stretch in which no live peer ran an owner for a
                              fragment (``owner_gaps``), against ``lease_s``; each of half a
                              lease or more, with who let it go and who took it:
                              ``unowned_long_log`` (``long_gaps``)
``roster_candidates``         per calm sample, the size of the candidate set most peers rank
                              over, the peers offering to own (``roster_offering``) and the age
                              of the peers' reads (``read_age_over_s``): ``roster_sizes``
``versions_two_contents``     versions published with more than one digest (``two_contents``);
                              ``two_contents_by``: for each, the peer slots that published it
``publication_fences``        versions the peers' owners did not publish, by gate (``/v1/status``
                              "replicas": lease lapses, claimant and stale-view fences), and
                              the reads of the members a publication awaited (``view_reads``)
``cpu``                       each worker's share of a core over the steady window and where
                              its loop's time went (``bench.swarm_scale_cpu``)
``cpu_ms_per_peer_s``         the workers' CPU time over the steady window, per peer measured
                              there and second (``cpu.core_share_per_process`` summed, / peers)
``http_requests_per_peer_s``  HTTP requests each peer sent a second in the steady window (every
                              route; ``http_requests_by_route``), DHT ones included
``record_signatures_per_peer_s``  DHT record signatures a peer verified in full a second, and
                              those skipped as checked before (``VerifiedSignatures``)

Run from the repository root (a heavy run: see docs/scale_peers.md for the conditions)::

    python -m bench.swarm_scale --peers 16,128,512 --json
    python -m bench.swarm_scale --peers 16 --duration 60 --json     # a quick look

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import json
import logging
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.swarm_scale_cpu import StackSampler
from node.config import RunConfig
from node.dht.membership import MEMBER_REPLICAS, ROSTER_CAP, Membership
from node.diloco.island import Island
from node.diloco.island_config import island_config
from node.peer import NodeOptions, PeerNode
from node.run.local_command import contents_by_version
from protocol.dht.member_reads import roster_score
from protocol.diloco.fragments import plan_fragments
from protocol.wire.signing import Signer

__all__ = [
    "Config",
    "Schedule",
    "TinyModel",
    "is_control",
    "owner_agreement",
    "settled_agreement",
    "spread_times",
    "summarize",
]

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP_LOCAL = 2  # joined peers of its own worker a joiner also bootstraps from
JOINS_AT_ONCE = 8  # joins in progress at once per worker (bootstrap to first reads)
JOIN_TRIES = 4  # a failed join is retried with a new node this many times in all...
JOIN_BACKOFF_S = 2.0  # ...after 2, 4, 8 s
SIGS_VERIFIED, SIGS_SKIPPED = "signatures verified", "signatures skipped"
LEASE_S = 20.0  # a member record's ttl (``Membership.ttl_s``): an owner's lease
# Views learn of an owner's move within this: reads at most ``READ_MAX_S`` = 6 s apart, the 2 s
# membership pass, and the samples' own 2 s grid (``settled_agreement``)
PROPAGATION_S = 10.0
PROFILE_DIR = os.environ.get("SWARM_SCALE_PROFILE", "")  # cProfile each worker's steady window
SWARM = "swarm-scale"  # the swarm id every run uses (it seeds the roster ranks)
SAMPLES_FILE = os.environ.get("SWARM_SCALE_SAMPLES", "")  # the merged samples, as JSON, for study


@dataclass(frozen=True)
class Config:
    """One run (mirrored by the command line); ``peers`` is the swarm size of one case."""

    peers: int = 16
    per_process: int = 64  # peers hosted by one worker process
    duration_s: float = 240.0  # from the clock's start until everyone stops
    join_s: float = 40.0  # the first ``peers`` join staggered over this
    settle_s: float = 20.0  # after the last first join, before the steady window opens
    churn_at: float = 0.0  # churn from this time on (0: no churn)
    churn: float = 0.10  # the share of peers that leave (and as many that join) per minute
    step_s: float = 0.5  # one stand-in inner step
    inner_steps: int = 40  # H
    fragments: int = 4
    sample_s: float = 2.0
    owners: int = 0  # peers that may own (the first ones, and who replaces them); 0: every peer
    seed: int = 0
    json: bool = False


@dataclass(frozen=True)
class Event:
    at: float  # seconds after the clock's start
    kind: str  # "join", "leave" or "kill"
    slot: int  # which peer (slots past ``peers`` are churn joiners)
    may_own: bool = True  # a joiner that may own fragments (``Config.owners``)


@dataclass(frozen=True)
class Schedule:
    """The seeded join / leave / kill schedule every worker derives from the same ``Config``."""

    events: tuple[Event, ...]
    slots: int  # peers ever started
    steady: tuple[float, float]  # the window over which bytes and views are measured
    churn_windows: tuple[tuple[float, float], ...]  # samples here do not count for agreement

    @classmethod
    def of(cls, cfg: Config) -> Schedule:
        rng = random.Random(cfg.seed)
        owner = {i: cfg.owners <= 0 or i < cfg.owners for i in range(cfg.peers)}
        events = [
            Event(
                at=cfg.join_s * rank / max(1, cfg.peers - 1),
                kind="join",
                slot=i,
                may_own=owner[i],
            )
            for rank, i in enumerate(join_order(cfg.peers, cfg.per_process))
        ]
        first_joined = cfg.join_s + cfg.settle_s
        end_steady = cfg.churn_at if cfg.churn_at > 0 else cfg.duration_s - 5.0
        churn_windows: list[tuple[float, float]] = []
        live, slot = list(range(cfg.peers)), cfg.peers
        per_min = max(1, round(cfg.churn * cfg.peers)) if cfg.churn_at > 0 else 0
        t = cfg.churn_at
        while per_min and t + 60.0 <= cfg.duration_s - 5.0:
            gone = rng.sample([s for s in live if s != 0], per_min)  # the founder stays
            for j, s in enumerate(gone):
                at = t + 60.0 * j / per_min
                events.append(Event(at=at, kind="leave" if j % 2 == 0 else "kill", slot=s))
                owner[slot] = owner[s]  # an owner is replaced by one that may own
                events.append(Event(at=at + 1.0, kind="join", slot=slot, may_own=owner[s]))
                live.remove(s)
                live.append(slot)
                slot += 1
            churn_windows.append((t, t + 60.0 + 30.0))  # + a lease period: records lapse
            t += 60.0
        events.sort(key=lambda e: (e.at, e.slot))
        return cls(
            events=tuple(events),
            slots=slot,
            steady=(first_joined, max(first_joined + 1.0, end_steady)),
            churn_windows=tuple(churn_windows),
        )

    def worker_of(self, slot: int, per_process: int, workers: int) -> int:
        """First peers fill workers in order; churn joiners go round-robin."""
        return slot // per_process if slot < workers * per_process else slot % workers


def join_order(peers: int, per_process: int) -> list[int]:
    """The first peers' slots in the order they join: every worker's seed (its first slot; the
    founder's is slot 0) first, then one peer of each worker in turn, so that every worker's
    loop takes its share of the joins throughout ``join_s`` instead of one worker all of them."""
    return sorted(range(peers), key=lambda slot: (slot % per_process, slot // per_process))


def is_seed(slot: int, per_process: int) -> bool:
    """A worker's first peer: it joins through the founder, its worker's other peers through it."""
    return slot % per_process == 0


# --- one worker: many peers on one loop ------------------------------------------------------


class TinyModel(nn.Module):
    """A few hundred floats in four fragments' worth of tensors; the same init on every peer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.a = nn.Parameter(torch.randn(16, 16, generator=g) * 0.1)
        self.b = nn.Parameter(torch.randn(16, 16, generator=g) * 0.1)
        self.c = nn.Parameter(torch.randn(16, 16, generator=g) * 0.1)
        self.d = nn.Parameter(torch.randn(16, 16, generator=g) * 0.1)


def run_config(cfg: Config) -> RunConfig:
    return RunConfig(
        swarm=SWARM,
        fragments=cfg.fragments,
        inner_steps=cfg.inner_steps,
        max_tokens_per_step=64,
        lr=0.01,
        validate_windows=0,
    )


@dataclass
class Peer:
    """One live peer in a worker, and what is measured of it."""

    slot: int
    node: PeerNode
    island: Island
    optimizer: torch.optim.Optimizer
    box: list[PeerNode]  # the node the island submits to (a join retried gets a new one)
    may_own: bool = True
    serve: asyncio.Task[None] | None = None
    train: asyncio.Task[None] | None = None
    joined_at: float | None = None
    gone_at: float | None = None
    join_tries: int = 0
    opened_at: float = 0.0
    closed_at: float = 0.0
    bytes_at_open: Counter[str] | None = None
    bytes_at_close: Counter[str] | None = None
    rpcs_at_open: Counter[str] | None = None
    rpcs_at_close: Counter[str] | None = None
    held: dict[int, int] = field(default_factory=dict)  # fragment -> newest version held
    first_held: dict[str, float] = field(default_factory=dict)  # "p:v" -> when first held
    # "p:v" -> when first held as the very version (not passed over for a newer one)
    held_exact: dict[str, float] = field(default_factory=dict)
    owning: dict[int, float] = field(default_factory=dict)  # fragment -> since when, now
    owned: list[tuple[int, float, float]] = field(default_factory=list)  # (p, from, to) ended
    published: list[tuple[int, int, str]] = field(default_factory=list)  # (p, v, digest)


def build_peer(slot: int, cfg: Config, rcfg: RunConfig, *, may_own: bool = True) -> Peer:
    torch.manual_seed(slot)
    model = TinyModel()
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_fragments(shapes, cfg.fragments)
    optimizer = torch.optim.SGD(model.parameters(), lr=rcfg.lr)
    box: list[PeerNode] = []

    def submit(out: Any) -> None:
        net = box[0].net if box else None
        if net is not None:
            net.submit(out)

    island = Island(model, optimizer, plan, submit, island_config(rcfg, optimizer))
    peer = Peer(slot, None, island, optimizer, box, may_own=may_own)  # type: ignore[arg-type]
    fresh_node(peer, cfg, rcfg)
    return peer


def fresh_node(peer: Peer, cfg: Config, rcfg: RunConfig) -> None:
    """A new ``PeerNode`` (same key, same island) for ``peer``: its first, or a join's retry."""
    signer = Signer.from_seed(random.Random(f"{cfg.seed}/{peer.slot}").randbytes(32))
    # (NodeOptions() when every peer may own: the harness runs on trees before ``may_own`` too)
    options = NodeOptions() if peer.may_own else NodeOptions(may_own=False)
    node = PeerNode(rcfg, signer, peer.island.model, peer.island.plan, options)
    publish = node.ownership.on_publish  # read when an owner is made: every version is noted

    def published(p: int, v: int, digest: bytes) -> None:
        peer.published.append((p, v, digest.hex()[:32]))
        publish(p, v, digest)

    node.ownership.on_publish = published
    peer.node = node
    peer.box[:] = [node]


async def train(peer: Peer, cfg: Config) -> None:
    """Stand-in compute: a seeded gradient (shared drift + own noise), an SGD step, a wait.
    Starts once the peer's join succeeded (a retried join has a new node: ``peer.node``)."""
    while not (peer.node.joined.is_set() and peer.node.failure is None):
        await asyncio.sleep(0.1)
    peer.island.adopt_pending()  # the synced global fragments
    g = torch.Generator().manual_seed(peer.slot)
    drift = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(7))
        for p in peer.island.model.parameters()
    ]
    while True:
        for p, d in zip(peer.island.model.parameters(), drift, strict=True):
            p.grad = d + torch.randn(p.shape, generator=g)
        peer.island.tokens(64)
        peer.optimizer.step()
        await asyncio.sleep(cfg.step_s)


def control_bytes(by_route: Counter[str]) -> Counter[str]:
    return Counter({r: n for r, n in by_route.items() if is_control(r)})


def is_control(route: str) -> bool:
    """Anything but a fragment's payload: contributions, replica states, and version bodies
    (latest / next / final / updates) are data; DHT reads and stores, held pointers, status,
    dial-backs and manifests are control."""
    r = route.removeprefix("reply ")
    if r.startswith("/v1/fragments/"):
        tail = r.split("/", 4)[-1]
        return tail.startswith("held") or tail.endswith("manifest")
    return not any(kind in r for kind in ("Contribution", "ReplicaState", "/v1/rpc"))


def bootstrap_peers(
    slot: int,
    *,
    seed: bool,
    own_seed: str | None,
    local: Sequence[str],
    founder: str,
    attempt: int = 0,
) -> list[str]:
    """The addresses a joiner bootstraps from (the first one also dials it back).

    The founder (slot 0) founds; a worker's seed joins through the founder; every other joiner
    through its worker's seed and up to ``BOOTSTRAP_LOCAL`` joined peers of its worker (``local``,
    drawn by slot). The founder is named to a non-seed only when neither is there, or on a retry
    (``attempt`` >= 1), last: so it answers at most one join per worker, not every one."""
    if slot == 0:
        return []
    if seed:
        return [founder]
    rng = random.Random(slot * 1000 + attempt)
    others = [u for u in local if u != own_seed]
    picked = rng.sample(others, min(BOOTSTRAP_LOCAL, len(others)))
    out = ([own_seed] if own_seed else []) + picked
    return out + [founder] if attempt or not out else out


def owner_gaps(
    spans: Sequence[tuple[int, float, float]], fragments: int, start: float, end: float
) -> dict[int, list[float]]:
    """Per fragment, how long each stretch of [start, end] lasted in which no live peer ran an
    owner for it; ``spans``: (fragment, from, to), one per owner a peer ran, any overlap."""
    gaps: dict[int, list[float]] = {}
    for p in range(fragments):
        t, out = start, []
        for _, lo, hi in sorted((s for s in spans if s[0] == p), key=lambda s: s[1]):
            if hi <= t:
                continue
            if lo > t:
                out.append(min(lo, end) - t)
            t = max(t, hi)
            if t >= end:
                break
        if t < end:
            out.append(end - t)
        gaps[p] = [round(g, 2) for g in out if g > 0]
    return gaps


def long_gaps(
    peers: dict[str, dict[str, Any]], fragments: int, start: float, end: float, *, min_s: float
) -> list[list[Any]]:
    """The stretches of at least ``min_s`` in which no live peer ran an owner for a fragment
    (``owner_gaps``), each as [fragment, from, to, the slot whose owner ended last before it,
    when that peer was gone (None: live on), the slot whose owner began it]: who let it go, and
    whether it had left."""
    out: list[list[Any]] = []
    for p in range(fragments):
        spans = sorted(
            (lo, hi, slot) for slot, peer in peers.items() for q, lo, hi in peer.get("owned", [])
            if q == p
        )  # fmt: skip
        t, last = start, None
        for lo, hi, slot in spans + [(end, end, None)]:
            if hi <= t and slot is not None:
                continue
            if min(lo, end) - t >= min_s:
                gone = peers[last]["gone_at"] if last is not None else None
                out.append([p, round(t, 1), round(min(lo, end), 1), last, gone, slot])
            if hi > t:
                t, last = hi, slot
            if t >= end:
                break
    return out


def two_contents(published: Sequence[tuple[int, int, str]]) -> list[str]:
    """The versions ("p:v") published with more than one content (digest), by any owners."""
    contents = contents_by_version(published)
    return sorted(f"{p}:{v}" for (p, v), seen in contents.items() if len(seen) > 1)


class Worker:
    """The peers of one process, on one loop, following the schedule for its slots."""

    def __init__(
        self, cfg: Config, index: int, workers: int, t0: float, initial: list[str]
    ) -> None:
        self.cfg, self.index, self.workers, self.t0 = cfg, index, workers, t0
        self.founder = initial[0] if initial else ""
        self.schedule = Schedule.of(cfg)
        self.rcfg = run_config(cfg)
        self.peers: dict[int, Peer] = {}
        self.samples: list[dict[str, Any]] = []
        self.join_slots = asyncio.Semaphore(JOINS_AT_ONCE)
        self.sampler = StackSampler()
        self.cpu_window: list[float] = []  # [CPU s at the window's open, wall s then, ...close]
        self.load: list[float] = []  # the box's 1-min load average at the window's open, close
        # SWARM_SCALE_PROFILE=DIR: cProfile of the steady window, DIR/worker<index>.prof
        self.profile = cProfile.Profile() if PROFILE_DIR else None

    def mine(self, slot: int) -> bool:
        return self.schedule.worker_of(slot, self.cfg.per_process, self.workers) == self.index

    def now(self) -> float:
        return time.time() - self.t0

    async def run(self) -> dict[str, Any]:
        self.sampler.start()
        try:
            async with asyncio.TaskGroup() as tg:
                sampler = tg.create_task(self.sample_loop())
                for ev in self.schedule.events:
                    if not self.mine(ev.slot):
                        continue
                    await asyncio.sleep(max(0.0, ev.at - self.now()))
                    await self.apply(ev, tg)
                await asyncio.sleep(max(0.0, self.cfg.duration_s - self.now()))
                sampler.cancel()
                live = [peer for peer in self.peers.values() if peer.gone_at is None]
                for peer in live:
                    self.close_window(peer)
                await asyncio.gather(*(self.stop(peer, kill=True) for peer in live))
                for peer in live:
                    peer.gone_at = None  # live to the end (the run's end is no churn)
        finally:
            self.sampler.stop()
        return self.report()

    async def apply(self, ev: Event, tg: asyncio.TaskGroup) -> None:
        if ev.kind == "join":
            peer = self.peers[ev.slot] = build_peer(
                ev.slot, self.cfg, self.rcfg, may_own=ev.may_own
            )
            peer.serve = tg.create_task(self.serve(peer))
            peer.train = tg.create_task(train(peer, self.cfg))
            if ev.slot == 0:  # the founder: the others join through it
                while not peer.node.ready.is_set():
                    await asyncio.sleep(0.05)
                self.founder = peer.node.url
                print(json.dumps({"founder": peer.node.url}), flush=True)
            return
        peer = self.peers[ev.slot]
        self.close_window(peer)
        await self.stop(peer, kill=ev.kind == "kill")

    def initial_peers(self, slot: int, attempt: int) -> list[str]:
        """``bootstrap_peers`` for ``slot`` from this worker's live, joined peers."""
        per = self.cfg.per_process
        live = [
            p
            for p in self.peers.values()
            if p.gone_at is None and p.joined_at is not None and p.slot != slot
        ]
        seed = next(
            (p.node.url for p in live if p.slot < self.cfg.peers and is_seed(p.slot, per)), None
        )
        return bootstrap_peers(
            slot,
            seed=slot < self.cfg.peers and is_seed(slot, per),
            own_seed=seed,
            local=[p.node.url for p in live],
            founder=self.founder,
            attempt=attempt,
        )

    async def serve(self, peer: Peer) -> None:
        """Join (at most ``JOINS_AT_ONCE`` of this worker's peers at a time), retrying a failed
        join ``JOIN_TRIES`` times with a new node, backing off; then serve until stopped."""
        for attempt in range(JOIN_TRIES):
            peer.join_tries = attempt + 1
            if attempt:
                await asyncio.sleep(JOIN_BACKOFF_S * 2 ** (attempt - 1))
                fresh_node(peer, self.cfg, self.rcfg)
            async with asyncio.TaskGroup() as tg, self.join_slots:
                node = peer.node
                initial = self.initial_peers(peer.slot, attempt)
                task = tg.create_task(self.serve_once(node, peer.island, initial))
                while not node.joined.is_set() and not task.done():
                    await asyncio.sleep(0.05)
            if node.failure is None or peer.gone_at is not None:
                return  # served until stopped (or stopped while joining)

    @staticmethod
    async def serve_once(node: PeerNode, island: Island, initial: list[str]) -> None:
        with contextlib.suppress(Exception):
            await node.serve(island, initial)

    async def stop(self, peer: Peer, *, kill: bool) -> None:
        peer.gone_at = self.now()
        assert peer.train is not None and peer.serve is not None
        peer.train.cancel()
        if not kill and peer.node.joined.is_set() and peer.node.failure is None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await peer.node.stop_learning(flush_s=2.0)
        if kill:
            peer.serve.cancel()
        else:
            peer.node.stop()
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(15.0):
                await peer.serve
        self.note_owners(peer, self.now(), stopped=True)

    def close_window(self, peer: Peer) -> None:
        if peer.bytes_at_open is not None and peer.bytes_at_close is None:
            peer.bytes_at_close = Counter(peer.node.transport.bytes_by_route)
            peer.rpcs_at_close = rpcs_out(peer.node)
            peer.closed_at = self.now()

    def open_cpu_window(self, t: float) -> None:
        if not self.cpu_window:
            self.cpu_window = [cpu_seconds(), t]
            self.load = [os.getloadavg()[0]]
            self.sampler.counting.set()
            if self.profile is not None:
                self.profile.enable()

    def close_cpu_window(self, t: float) -> None:
        if len(self.cpu_window) == 2:
            self.cpu_window += [cpu_seconds(), t]
            self.load.append(os.getloadavg()[0])
            self.sampler.counting.clear()
            if self.profile is not None:
                self.profile.disable()
                self.profile.dump_stats(os.path.join(PROFILE_DIR, f"worker{self.index}.prof"))

    async def sample_loop(self) -> None:
        """Poll held versions and owners often (spread timing, unowned time), the rest every
        ``sample_s``."""
        lo, hi = self.schedule.steady
        next_sample = 0.0
        while True:
            t = self.now()
            if lo <= t < hi:
                self.open_cpu_window(t)
            elif t >= hi:
                self.close_cpu_window(t)
            for peer in self.peers.values():
                if peer.gone_at is None and peer.node.joined.is_set() and peer.node.net is not None:
                    if peer.joined_at is None:
                        peer.joined_at = t
                    self.note_versions(peer, t)
                    self.note_owners(peer, t)
                    if lo <= t < hi and peer.bytes_at_open is None:
                        peer.bytes_at_open = Counter(peer.node.transport.bytes_by_route)
                        peer.rpcs_at_open = rpcs_out(peer.node)
                        peer.opened_at = t
                    if t >= hi:
                        self.close_window(peer)
            if t >= next_sample:  # on the grid of sample_s, as every worker: merged by tick
                next_sample = (math.floor(t / self.cfg.sample_s) + 1) * self.cfg.sample_s
                self.samples.append(self.sample(t))
            await asyncio.sleep(0.1)

    def note_versions(self, peer: Peer, t: float) -> None:
        net = peer.node.net
        assert net is not None
        for p, (version, _) in list(net.latest.items()):
            had = peer.held.get(p, 0)
            if version > had:
                for v in range(had + 1, version + 1):
                    peer.first_held.setdefault(f"{p}:{v}", t)
                peer.held_exact.setdefault(f"{p}:{version}", t)
                peer.held[p] = version

    @staticmethod
    def note_owners(peer: Peer, t: float, *, stopped: bool = False) -> None:
        """Which fragments the peer runs an owner for now: spans open and close."""
        now = set() if stopped else set(peer.node.owners)
        for p in now - peer.owning.keys():
            peer.owning[p] = t
        for p in set(peer.owning) - now:
            peer.owned.append((p, peer.owning.pop(p), t))

    def sample(self, t: float) -> dict[str, Any]:
        owners: dict[str, list[str]] = {}
        views: dict[str, int] = {}
        seen: dict[str, tuple[Membership, set[bytes], list[bytes]]] = {}
        for peer in self.peers.values():
            ms = peer.node.membership
            if peer.gone_at is not None or not peer.node.joined.is_set() or ms is None:
                continue
            row = []
            for p in range(self.cfg.fragments):
                o = peer.node.owner_of(p)
                row.append(o[0].hex()[:12] if o else "")
            owners[str(peer.slot)] = row
            views[str(peer.slot)] = len(ms.members)
            suspects = peer.node.suspects()
            seen[str(peer.slot)] = (ms, suspects, ms.owner_candidates(suspects))
        return {"t": t, "owners": owners, "views": views, "rosters": roster_views(seen)}

    def report(self) -> dict[str, Any]:
        peers = {}
        end = self.now()
        for peer in self.peers.values():
            opened, closed = peer.bytes_at_open, peer.bytes_at_close
            window = None
            if opened is not None and closed is not None:
                window = {
                    "s": peer.closed_at - peer.opened_at,
                    "bytes": dict(closed - opened),
                    "rpcs": dict(
                        (peer.rpcs_at_close or Counter()) - (peer.rpcs_at_open or Counter())
                    ),
                }
            owned = peer.owned + [(p, since, end) for p, since in peer.owning.items()]
            peers[str(peer.slot)] = {
                "id": peer.node.signer.peer_id.hex()[:12],  # as samples name owners
                "peer_id": peer.node.signer.peer_id.hex(),  # its roster rank: ``roster_score``
                "joined_at": peer.joined_at,
                "may_own": peer.may_own,
                "gone_at": peer.gone_at,
                "join_tries": peer.join_tries,
                "window": window,
                "first_held": peer.first_held,
                "held_exact": peer.held_exact,
                "spread": spread_counts(peer.node),
                "owned": owned,
                "published": peer.published,
                "fences": publication_fences(peer.node),
                "failure": repr(peer.node.failure) if peer.node.failure is not None else None,
            }
        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cpu = self.cpu_window
        return {
            "worker": self.index,
            "peers": peers,
            "samples": self.samples,
            "peak_rss_mb": rss_kb / 1024,
            "cpu_share": (cpu[2] - cpu[0]) / (cpu[3] - cpu[1]) if len(cpu) == 4 else None,
            "load_average": self.load,
            "stacks": self.sampler.report(),
        }


def publication_fences(node: PeerNode) -> dict[str, int]:
    """The versions this node's owners did not publish, by gate, and the reads of the members
    its publications awaited (``Handoffs``; the counters its tree has)."""
    names = ("lease_lapses", "claimant_fences", "stale_view_fences", "view_reads")
    return {n: getattr(node.handoffs, n) for n in names if hasattr(node.handoffs, n)}


def spread_counts(node: PeerNode) -> dict[str, int]:
    """What the node's fetches and serves of versions did (``SpreadStats``), and the lookups
    of pointed holders it made (on trees that have them)."""
    lookup = getattr(node, "holder_lookup", None)
    extra = (
        {"holder_lookups": lookup.lookups, "holder_lookups_shared": getattr(lookup, "shared", 0)}
        if lookup is not None
        else {}
    )
    return {**node.spread.as_dict(), **extra}


def rpcs_out(node: PeerNode) -> Counter[str]:
    """What this node sent and checked so far: DHT requests by message type, HTTP requests by
    route (``"http <route>"``), and record signatures verified in full or skipped as checked
    before (``"signatures verified"``, ``"signatures skipped"``): counters the node keeps anyway."""
    out: Counter[str] = Counter()
    if node.dht is not None:
        out.update(node.dht.metrics.rpcs_out)
        seen = node.dht.records.verified
        if seen is not None:
            out[SIGS_VERIFIED], out[SIGS_SKIPPED] = seen.verified, seen.hits
    for route, n in node.transport.messages_by_route.items():
        if not route.startswith("reply "):
            out[f"http {route}"] = n
    return out


def cpu_seconds() -> float:
    """User and system CPU seconds this process used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker_main(cfg: Config, index: int, workers: int) -> None:
    """One worker: warm up, say so, take the clock's start (and the founder's address) from the
    parent on stdin, then run the schedule and print the report as the last line."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    warm_up(cfg)
    print(json.dumps({"up": index}), flush=True)
    t0 = json.loads(sys.stdin.readline())["t0"]
    initial = [json.loads(sys.stdin.readline())["founder"]] if index else []
    out = asyncio.run(Worker(cfg, index, workers, t0, initial).run())
    print(json.dumps(out), flush=True)


def warm_up(cfg: Config) -> None:
    """Build a peer and take a step off the clock: the imports a first peer and a first step
    pull in (torch's optimizer pulls in sympy) would otherwise land in the measured window."""
    peer = build_peer(-1, cfg, run_config(cfg))
    for p in peer.island.model.parameters():
        p.grad = torch.zeros_like(p)
    peer.optimizer.step()


def roster_views(
    seen: dict[str, tuple[Membership, set[bytes], list[bytes]]],
) -> dict[str, dict[str, Any]]:
    """Per peer (slot -> its membership, suspects and candidate owners): the candidate owners it
    ranks fragments over, each with the seconds its record has left (``c``), the age of its
    last read (``age``), and why it lacks each candidate another peer of this worker has
    (``m``: "suspect", "learner": held without the owner role, or "absent": no record held),
    the oldest read in flight (``r``, s), reads ended in an error (``f``, by type), the seconds
    since the membership loop's last pass began (``p``),
    whether its own record offers to own (``o``), whether it counts itself among the roster's
    holders (``n``: its reads of the roster stay local) and whose roster records its own DHT
    store holds (``h``).
    What a dissent is made of: ``dissent_causes`` compares a dissenter's with the majority's."""
    now, mono = time.time(), time.monotonic()
    union = {pid for _, _, cands in seen.values() for pid in cands}
    out: dict[str, dict[str, Any]] = {}
    for slot, (ms, suspects, cands) in seen.items():
        members, mine = ms.members, set(cands)
        out[slot] = {
            "c": {pid.hex()[:12]: round(members[pid].expires_at - now, 1) for pid in cands},
            "age": round(min(ms.read_age(), 999.0), 1),
            # the oldest read still in flight (s), reads that ended in an error by type, and the
            # seconds since the membership loop's last pass began: why a view went stale
            "r": round(mono - min(ms.reads_in_flight), 1) if ms.reads_in_flight else 0.0,
            "f": dict(ms.read_errors),
            "p": round(mono - ms.pass_at, 1) if ms.pass_at is not None else None,
            "o": int(ms._published_under == ms.roster),  # our record offers to own
            # whether we count ourselves among the roster's holders (reads of it stay local),
            # and whose roster records our own DHT store holds
            "n": int(ms.dht.held_near(ms.roster, MEMBER_REPLICAS) is not None),
            "h": sorted(r.subkey.hex()[:12] for r in ms.dht.client.records.get(ms.roster, now)),
            "m": {
                pid.hex()[:12]: "suspect"
                if pid in suspects
                else ("learner" if pid in members else "absent")
                for pid in union - mine
            },
        }
    return out


# --- the parent: start workers, merge their reports ------------------------------------------


def owner_agreement(samples: Sequence[dict[str, list[str]]], fragments: int) -> float | None:
    """Per sample and fragment, the fraction of pairs of peers naming the same owner; the mean.
    ``samples``: per sample, peer -> the owner it names for each fragment ("" for none)."""
    scores = [
        pairs_agreeing(rows, p)
        for rows in (list(owners.values()) for owners in samples)
        if len(rows) >= 2
        for p in range(fragments)
    ]
    return statistics.fmean(scores) if scores else None


def pairs_agreeing(rows: Sequence[Sequence[str]], p: int) -> float:
    """The fraction of pairs of ``rows`` (>= 2 peers' named owners) that name the same owner
    of fragment ``p`` (naming none is no agreement)."""
    n = len(rows)
    counts = Counter(row[p] for row in rows)
    return sum(c * (c - 1) for name, c in counts.items() if name) / (n * (n - 1))


def settled_agreement(
    timed: Sequence[tuple[float, dict[str, list[str]]]], fragments: int, *, around_s: float
) -> dict[str, Any]:
    """``owner_agreement`` outside the propagation of an owner's move. Per fragment, the owner
    most peers name in each sample (``timed``: (t, peer -> owners), any order); where it
    changes, the samples within ``around_s`` before or after the change are left out: views
    learn of a move at their next reads (at most ``READ_MAX_S`` apart, plus the 2 s pass), and
    until then they differ by propagation, not by disagreement. What is left is scored as
    ``owner_agreement``. Returns the mean (None with nothing left), the moves seen, and the
    (sample, fragment) scores left out, and every peer naming another owner than most in the
    samples kept (what keeps the settled agreement below 1)."""
    ordered = sorted(((t, owners) for t, owners in timed if len(owners) >= 2), key=lambda x: x[0])
    scores: list[float] = []
    moves: list[tuple[float, int, str, str]] = []
    dissent: list[tuple[float, int, str, str, str]] = []
    left_out = 0
    for p in range(fragments):
        majors = [max(Counter(r[p] for r in owners.values()).items(),
                      key=lambda kv: (kv[1], kv[0]))[0] for _, owners in ordered]  # fmt: skip
        changed = [i for i in range(1, len(ordered)) if majors[i] != majors[i - 1]]
        changes = [ordered[i][0] for i in changed]
        moves += [(ordered[i][0], p, majors[i - 1], majors[i]) for i in changed]
        for (t, owners), major in zip(ordered, majors, strict=True):
            if any(abs(t - c) <= around_s for c in changes):
                left_out += 1
                continue
            scores.append(pairs_agreeing(list(owners.values()), p))
            dissent += [
                (t, p, peer, row[p], major) for peer, row in owners.items() if row[p] != major
            ]
    return {
        "agreement": statistics.fmean(scores) if scores else None,
        "owner_moves": len(moves),
        "moves": sorted(moves),  # (t, fragment, owner before, owner after) as most peers name it
        "left_out": left_out,
        # (t, fragment, peer, the owner it names, the one most name) in the samples kept
        "dissent": sorted(dissent),
    }


def roster_sizes(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over ``samples`` (each with ``rosters``: ``roster_views``): how many candidate owners
    the set most peers rank over holds, how many peers offer to own, and how old the peers'
    last reads are (the median and the most of each; ages as the share of peer-samples over
    6, 12 and 30 s)."""
    majority, offering, ages = [], [], []
    for m in samples:
        rosters = m.get("rosters", {})
        if not rosters:
            continue
        sets = Counter(frozenset(r["c"]) for r in rosters.values())
        majority.append(len(max(sets.items(), key=lambda kv: (kv[1], sorted(kv[0])))[0]))
        offering.append(sum(r.get("o", 0) for r in rosters.values()))
        ages += [r["age"] for r in rosters.values()]

    def spread(xs: list[int]) -> dict[str, float] | None:
        return {"median": statistics.median(xs), "max": max(xs)} if xs else None

    return {
        "roster_candidates": spread(majority),
        "roster_offering": spread(offering),
        "read_age_over_s": {
            str(s): round(sum(1 for a in ages if a > s) / len(ages), 4) for s in (6, 12, 30)
        }
        if ages
        else None,
    }


def roster_deep_starts(
    samples: Sequence[tuple[float, dict[str, Any]]], ids: dict[str, str], swarm: str, *, cap: int
) -> dict[str, Any]:
    """Offers to own begun (a peer's record offering in a sample and not in the one before)
    by peers ranked below ``1.5 * cap`` by ``roster_score`` among all the run's peers: places
    a member took that, in a view holding the whole roster, it never would (a view lacking a
    roster record, or a stale one). ``samples``: (t, sample) in time order; ``ids``: slot ->
    peer id (hex)."""
    known = {slot: bytes.fromhex(h) for slot, h in ids.items() if h}
    order = sorted(known, key=lambda slot: -roster_score(swarm, known[slot]))
    rank = {slot: i + 1 for i, slot in enumerate(order)}
    deep = cap + cap // 2
    before: dict[str, int] = {}
    begun: list[list[Any]] = []
    for t, m in samples:
        for slot, r in m.get("rosters", {}).items():
            o = r.get("o", 0)
            if o and slot in before and not before[slot] and rank.get(slot, 0) > deep:
                begun.append([round(t, 1), slot, rank[slot], r.get("age")])
            before[slot] = o
    return {"ranked_below": deep, "count": len(begun), "log": begun[:40]}


def dissent_causes(
    dissent: Sequence[tuple[float, int, str, str, str]],
    samples: dict[float, dict[str, dict[str, Any]]],
    slot_of: Callable[[str], str],
) -> dict[str, Any]:
    """Why each dissent (``settled_agreement``'s: t, fragment, peer, the owner it names, the one
    most name) named another owner: its candidate owners (``roster_views``, in ``samples`` at
    t) against those most of the peers naming the majority's owner rank over. A candidate the
    dissenter lacks is "missing:<why it lacks it>"; one it has that they lack is "extra:<why
    most of them lack it>"; "same candidates" names neither (a ranking that differs on one
    set would be a bug). Returns counts by cause, by dissenting peer and by member, and the
    first 40 as [t, fragment, peer, named, major, missing, extra, read age] (members as slots;
    each extra with the seconds its record had left in the dissenter's view)."""
    by_cause: Counter[str] = Counter()
    by_peer: Counter[str] = Counter()
    by_member: Counter[str] = Counter()
    log: list[list[Any]] = []
    ages: list[float] = []
    for t, p, peer, named, major in dissent:
        rosters, owners = samples[t]["rosters"], samples[t]["owners"]
        mine = rosters.get(peer)
        with_major = [q for q, row in owners.items() if row[p] == major and q in rosters]
        if mine is None or not with_major:
            by_cause["unsampled"] += 1
            continue
        sets = Counter(frozenset(rosters[q]["c"]) for q in with_major)
        majority = max(sets.items(), key=lambda kv: (kv[1], sorted(kv[0])))[0]
        missing = sorted(majority - set(mine["c"]))
        extra = sorted(set(mine["c"]) - majority)
        why_missing = [[slot_of(m), mine["m"].get(m, "?")] for m in missing]
        why_extra = [
            [
                slot_of(x),
                Counter(rosters[q]["m"].get(x, "?") for q in with_major).most_common(1)[0][0],
                mine["c"][x],
            ]
            for x in extra
        ]
        kinds = sorted(
            {f"missing:{w}" for _, w in why_missing} | {f"extra:{w}" for _, w, _ in why_extra}
        )
        by_cause[" + ".join(kinds) or "same candidates"] += 1
        by_peer[peer] += 1
        ages.append(mine["age"])
        by_member.update(slot_of(m) for m in missing + extra)
        if len(log) < 40:
            log.append([round(t, 1), p, peer, slot_of(named), slot_of(major),
                        why_missing, why_extra, mine["age"]])  # fmt: skip
    return {
        "owner_dissent_causes": dict(by_cause.most_common()),
        "owner_dissents_by_peer": dict(by_peer.most_common(12)),
        "owner_dissents_by_member": dict(by_member.most_common(12)),
        "owner_dissent_why_log": log,
        # the dissenters' last reads: the share older than 6, 12 and 30 s
        "owner_dissent_read_age_over_s": {
            str(s): round(sum(1 for a in ages if a > s) / len(ages), 4) for s in (6, 12, 30)
        }
        if ages
        else None,
    }


def spread_times(
    first_held: dict[str, dict[str, float]],
    lives: dict[str, tuple[float | None, float | None]],
    *,
    until: float,
    share: float = 0.99,
    horizon_s: float = 60.0,
) -> tuple[list[float], int]:
    """Per version ("p:v"), the seconds from its first holder until ``share`` of the peers live
    through [first, first + horizon] held it (or a newer one); and how many versions were first
    held early enough to be judged (``horizon_s`` before ``until``, the run's end). A version
    that never got there within the horizon has no time: ``len(times) < judged`` counts them.
    ``lives``: peer -> (joined, gone), gone None for a peer live to the end."""
    by_version: dict[str, dict[str, float]] = defaultdict(dict)
    for peer, held in first_held.items():
        for version, t in held.items():
            by_version[version][peer] = t
    out, judged = [], 0
    for times in by_version.values():
        first = min(times.values())
        if first + horizon_s > until:
            continue
        live = [
            pid
            for pid, (joined, gone) in lives.items()
            if joined is not None
            and joined <= first
            and (gone is None or gone >= first + horizon_s)
        ]
        if len(live) < 2:
            continue
        judged += 1
        need = math.ceil(share * len(live))
        reached = sorted(times.get(pid, math.inf) for pid in live)[need - 1]
        if reached - first <= horizon_s:
            out.append(reached - first)
    return out, judged


def summarize(cfg: Config, reports: list[dict[str, Any]]) -> dict[str, Any]:
    schedule = Schedule.of(cfg)
    peers: dict[str, dict[str, Any]] = {}
    for r in reports:
        peers.update(r["peers"])
    route_rates: Counter[str] = Counter()
    rates: list[float] = []
    by_role: dict[str, list[float]] = defaultdict(list)
    for p in peers.values():
        w = p["window"]
        if w is None or w["s"] <= 0:
            continue
        ctrl = control_bytes(Counter(w["bytes"]))
        rates.append(sum(ctrl.values()) / w["s"])
        by_role["owner" if p.get("may_own", True) else "learner"].append(rates[-1])
        for route, n in ctrl.items():
            route_rates[route] += n / w["s"]
    measured = max(1, len(rates))
    by_route = {r: round(v / measured, 1) for r, v in route_rates.most_common(12)}
    data_rates = [
        sum(n for r, n in p["window"]["bytes"].items() if not is_control(r)) / p["window"]["s"]
        for p in peers.values()
        if p["window"] is not None and p["window"]["s"] > 0
    ]
    # samples: merge the workers' samples taken in the same sample period
    merged: dict[int, dict[str, dict[str, Any]]] = defaultdict(
        lambda: {"owners": {}, "views": {}, "rosters": {}}
    )
    for r in reports:
        for s in r["samples"]:
            tick = int(s["t"] // cfg.sample_s)
            merged[tick]["owners"].update(s["owners"])
            merged[tick]["views"].update(s["views"])
            merged[tick]["rosters"].update(s.get("rosters", {}))
    lo, hi = schedule.steady

    def calm(t: float) -> bool:
        return lo <= t < hi or (t >= lo and not any(a <= t < b for a, b in schedule.churn_windows))

    steady = [m for tick, m in merged.items() if lo <= tick * cfg.sample_s < hi]
    slots = {p["id"]: pid for pid, p in peers.items() if p.get("id")}  # owner names -> slots
    # the calm samples in time order, each with its time: what agreement and the roster are read from
    calm_samples = [
        (tick * cfg.sample_s, m) for tick, m in sorted(merged.items()) if calm(tick * cfg.sample_s)
    ]
    calm_timed = [(t, m["owners"]) for t, m in calm_samples]
    calm_owners = [owners for _, owners in calm_timed]
    churning = [
        m["owners"]
        for tick, m in merged.items()
        if any(a <= tick * cfg.sample_s < b for a, b in schedule.churn_windows)
    ]
    settled = settled_agreement(calm_timed, cfg.fragments, around_s=PROPAGATION_S)
    if SAMPLES_FILE:
        with open(SAMPLES_FILE, "w") as f:
            json.dump({"ids": {slot: p.get("peer_id") for slot, p in peers.items()},
                       "samples": {str(tick): m for tick, m in sorted(merged.items())}}, f)  # fmt: skip
    causes = dissent_causes(
        settled["dissent"],
        {tick * cfg.sample_s: m for tick, m in merged.items()},
        lambda pid: slots.get(pid, pid),
    )
    views = [v for m in steady for v in m["views"].values()]
    lives = {pid: (p["joined_at"], p["gone_at"]) for pid, p in peers.items()}
    spread, judged = spread_times(
        {pid: p["first_held"] for pid, p in peers.items()},
        lives,
        until=cfg.duration_s,
        horizon_s=min(60.0, cfg.duration_s / 4),
    )
    exact, _ = spread_times(
        {pid: p.get("held_exact", {}) for pid, p in peers.items()},
        lives,
        until=cfg.duration_s,
        horizon_s=min(60.0, cfg.duration_s / 4),
    )
    versions = {v for p in peers.values() for v in p["first_held"]}
    spread_counts: Counter[str] = Counter()
    held_max = 0  # the most uploads of one version by one holder (a maximum, not summed)
    for p in peers.values():
        counts = dict(p.get("spread", {}))
        held_max = max(held_max, counts.pop("held_uploads_max", 0))
        spread_counts.update(counts)
    rpc_rates: Counter[str] = Counter()
    for p in peers.values():
        w = p["window"]
        if w is not None and w["s"] > 0:
            for kind, n in w.get("rpcs", {}).items():
                rpc_rates[kind] += n / w["s"] / measured
    http_rates = {k[5:]: v for k, v in rpc_rates.items() if k.startswith("http ")}
    sig_rates = {k: rpc_rates.pop(k, 0.0) for k in (SIGS_VERIFIED, SIGS_SKIPPED)}
    dht_rates = {k: v for k, v in rpc_rates.items() if not k.startswith("http ")}
    cpu = cpu_summary(reports)
    spans = [tuple(span) for p in peers.values() for span in p.get("owned", [])]
    firsts = [span[1] for span in spans]
    gaps = owner_gaps(spans, cfg.fragments, min(firsts), cfg.duration_s - 1.0) if firsts else {}
    published = [tuple(x) for p in peers.values() for x in p.get("published", [])]
    fences: Counter[str] = Counter()
    for p in peers.values():
        fences.update(p.get("fences", {}))
    failures = [
        p["failure"] for p in peers.values() if p["failure"] and "Cancelled" not in p["failure"]
    ]
    return {
        "peers": cfg.peers,
        "processes": len(reports),
        "control_bytes_per_peer_s": round(statistics.fmean(rates), 1) if rates else None,
        "control_bytes_per_peer_s_p90": round(sorted(rates)[int(0.9 * (len(rates) - 1))], 1)
        if rates
        else None,
        "control_by_route": by_route,
        "control_bytes_by_role": {
            role: {"mean": round(statistics.fmean(r), 1), "max": round(max(r), 1), "n": len(r)}
            for role, r in sorted(by_role.items())
        },
        "data_bytes_per_peer_s": round(statistics.fmean(data_rates), 1) if data_rates else None,
        "member_view": round(statistics.fmean(views), 1) if views else None,
        "spread_p99_s": round(statistics.median(spread), 2) if spread else None,
        "spread_p99_max_s": round(max(spread), 2) if spread else None,
        "versions": len(versions),
        "versions_judged": judged,  # first held a horizon before the end, with >= 2 live peers
        "versions_reaching_99": len(spread),
        # the same, counting only peers that held the very version (not passed over for a newer)
        "spread_p99_exact_s": round(statistics.median(exact), 2) if exact else None,
        "versions_reaching_99_exact": len(exact),
        # what the peers' fetches did, summed over peers (``node.diloco.spread.SpreadStats``)
        "spread_counts": dict(sorted(spread_counts.items())),
        # holders' uploads per version they re-served: the mean, and the most of any one version
        "holder_uploads_per_version": round(
            spread_counts["held_bytes"] / spread_counts["held_versions_bytes"], 2
        )
        if spread_counts["held_versions_bytes"]
        else None,
        "holder_uploads_per_version_max": held_max,
        "owner_agreement": owner_agreement(calm_owners, cfg.fragments),
        # the same over the churn windows' samples (None without churn)
        "owner_agreement_churn": owner_agreement(churning, cfg.fragments),
        # the same outside an owner move's propagation (``settled_agreement``)
        "owner_agreement_settled": settled["agreement"],
        "owner_moves": settled["owner_moves"],
        "owner_samples_left_out": settled["left_out"],
        # each move: when, fragment, and the owners before and after as peer slots
        "owner_move_log": [
            [round(t, 1), p, slots.get(a, a), slots.get(b, b)] for t, p, a, b in settled["moves"]
        ],
        # a peer naming another owner than most, outside a move: [t, fragment, peer slot, the
        # owner it names, the one most name] (the first 40), and how many in all
        "owner_dissent_log": [
            [round(t, 1), p, peer, slots.get(a, a), slots.get(b, b)]
            for t, p, peer, a, b in settled["dissent"][:40]
        ],
        "owner_dissents": len(settled["dissent"]),
        # what each dissent's candidate owners lacked or had beside the majority's
        # (``dissent_causes``): counts by cause, by dissenting peer and by member, and a log
        **causes,
        # per calm sample, the candidate owners most peers rank over and the peers whose
        # records offer to own: the median and the most (the roster's cap is ``ROSTER_CAP``)
        **roster_sizes([m for _, m in calm_samples]),
        # places taken in the calm samples by members ranked below 1.5 x the cap: [t, slot,
        # rank, its read's age] (``roster_deep_starts``)
        "roster_deep_starts": roster_deep_starts(
            calm_samples,
            {slot: p.get("peer_id", "") for slot, p in peers.items()},
            SWARM,
            cap=ROSTER_CAP,
        ),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in reports), 1),
        "rss_mb_per_peer": round(sum(r["peak_rss_mb"] for r in reports) / schedule.slots, 2),
        "dht_requests_per_peer_s": {
            k: round(v, 3) for k, v in sorted(dht_rates.items(), key=lambda kv: -kv[1])
        },
        "http_requests_per_peer_s": round(sum(http_rates.values()), 3),
        "http_requests_by_route": {
            k: round(v, 3) for k, v in sorted(http_rates.items(), key=lambda kv: -kv[1])[:12]
        },
        # record signatures each peer verified in full, and those it had checked before
        "record_signatures_per_peer_s": {k.split()[-1]: round(v, 3) for k, v in sig_rates.items()},
        # the workers' CPU over the steady window, per peer measured there
        "cpu_ms_per_peer_s": round(1000 * sum(cpu["core_share_per_process"]) / len(rates), 2)
        if rates and cpu["core_share_per_process"]
        else None,
        # a fragment with no live peer running an owner for it, from its first owner on
        "unowned_max_s": max((max(g, default=0.0) for g in gaps.values()), default=None),
        "unowned_s_by_fragment": {str(p): round(sum(g), 1) for p, g in gaps.items()},
        "unowned_gaps_over_lease": sum(1 for g in gaps.values() for x in g if x > LEASE_S),
        # each stretch of half a lease or more: [fragment, from, to, the slot whose owner ended
        # last before it, when that peer was gone, the slot whose owner ended it]
        "unowned_long_log": long_gaps(
            peers, cfg.fragments, min(firsts), cfg.duration_s - 1.0, min_s=LEASE_S / 2
        )
        if firsts
        else [],
        "lease_s": LEASE_S,
        "versions_published": len(contents_by_version(published)),
        "versions_two_contents": two_contents(published),  # type: ignore[arg-type]
        "two_contents_by": two_contents_by(peers, two_contents(published)),  # type: ignore[arg-type]
        "publication_fences": dict(sorted(fences.items())),
        "cpu": cpu,
        "joined": sum(1 for p in peers.values() if p["joined_at"] is not None),
        # the first peers: seconds from a join's scheduled time to its end, and the last one's end
        "join_latency_s": join_latency(cfg, schedule, peers),
        "join_retried": sum(1 for p in peers.values() if p.get("join_tries", 1) > 1),
        "failed": len(failures),
        "failures": dict(Counter(f[:120] for f in failures).most_common(4)),
        "steady_window_s": [lo, hi],
        "config": asdict(cfg),
    }


def two_contents_by(peers: dict[str, dict[str, Any]], versions: list[str]) -> dict[str, list[str]]:
    """For each version ("p:v") published with two contents, who published which: "slot:digest"
    (the digest's first 8 hex digits), sorted."""
    out: dict[str, list[str]] = {v: [] for v in versions}
    for slot, peer in peers.items():
        for p, v, digest in peer.get("published", []):
            if f"{p}:{v}" in out:
                out[f"{p}:{v}"].append(f"{slot}:{digest[:8]}")
    return {v: sorted(set(who)) for v, who in out.items()}


def join_latency(
    cfg: Config, schedule: Schedule, peers: dict[str, dict[str, Any]]
) -> dict[str, float | None]:
    """Median and worst seconds from a first peer's scheduled join to its joining (a peer that
    never joined counts as the run's end), and when the last of them joined."""
    due = {str(e.slot): e.at for e in schedule.events if e.kind == "join" and e.slot < cfg.peers}
    ends = [peers.get(s, {}).get("joined_at") for s in due]
    waits = [(cfg.duration_s if t is None else t) - due[s] for s, t in zip(due, ends, strict=True)]
    joined = [t for t in ends if t is not None]
    return {
        "median": round(statistics.median(waits), 1) if waits else None,
        "max": round(max(waits), 1) if waits else None,
        "last_joined_at": round(max(joined), 1) if len(joined) == len(due) else None,
    }


def cpu_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' CPU over the steady window: each one's share of a core, the box's load,
    and what the sampled stacks were doing (shares of all looks, ``idle`` included)."""
    shares = [r["cpu_share"] for r in reports if r.get("cpu_share") is not None]
    activities: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    for r in reports:
        stacks = r.get("stacks") or {}
        activities.update(stacks.get("by_activity", {}))
        modules.update(stacks.get("by_module", {}))
    looks = sum(activities.values()) or 1
    busy = sum(modules.values()) or 1
    return {
        "core_share_per_process": [round(x, 3) for x in shares],
        "cores_in_all": round(sum(shares), 2),
        "load_average": [r.get("load_average") for r in reports[:1]],
        "by_activity": {k: round(n / looks, 3) for k, n in activities.most_common(16)},
        "busy_by_module": {k: round(n / busy, 3) for k, n in modules.most_common(12)},
    }


def run_case(cfg: Config) -> dict[str, Any]:
    """Start every worker at once; when all are up (imports done, a peer built), set the clock's
    start and tell them; hand worker 0's founder address to the others once it founded."""
    workers = max(1, math.ceil(cfg.peers / cfg.per_process))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    spec = json.dumps(asdict(cfg))
    args = [sys.executable, "-m", "bench.swarm_scale", "--worker", spec, str(workers)]
    procs = [
        subprocess.Popen(
            [*args, str(i)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(workers)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        json.loads(proc.stdout.readline())  # {"up": index}
    t0 = time.time() + 1.0
    for proc in procs:
        tell(proc, {"t0": t0})
    founder = json.loads(procs[0].stdout.readline())["founder"]  # type: ignore[union-attr]
    for proc in procs[1:]:
        tell(proc, {"founder": founder})
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=cfg.duration_s + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"worker exited {proc.returncode}; see its stderr above")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return summarize(cfg, reports)


def tell(proc: subprocess.Popen[str], what: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(what) + "\n")
    proc.stdin.flush()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        spec, workers, index = argv[1:4]
        worker_main(Config(**json.loads(spec)), int(index), int(workers))
        return
    d = Config()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--peers", default="16,128,512", help="swarm sizes, comma-separated")
    ap.add_argument("--per-process", type=int, default=d.per_process)
    ap.add_argument("--duration", type=float, default=d.duration_s, help="seconds per case")
    ap.add_argument("--join-s", type=float, default=d.join_s)
    ap.add_argument("--settle-s", type=float, default=d.settle_s)
    ap.add_argument("--churn-at", type=float, default=d.churn_at, help="0: no churn")
    ap.add_argument("--churn", type=float, default=d.churn, help="share of peers per minute")
    ap.add_argument("--step-s", type=float, default=d.step_s)
    ap.add_argument("--inner-steps", type=int, default=d.inner_steps)
    ap.add_argument("--fragments", type=int, default=d.fragments)
    ap.add_argument("--sample-s", type=float, default=d.sample_s)
    ap.add_argument(
        "--owners", type=int, default=d.owners, help="peers that may own (0: every peer)"
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cases = []
    for n in (int(x) for x in a.peers.split(",")):
        cfg = dataclasses.replace(
            d, peers=n, per_process=a.per_process, duration_s=a.duration, join_s=a.join_s,
            settle_s=a.settle_s, churn_at=a.churn_at, churn=a.churn, step_s=a.step_s,
            inner_steps=a.inner_steps, fragments=a.fragments, sample_s=a.sample_s, seed=a.seed,
            owners=a.owners,
            json=a.json,
        )  # fmt: skip
        print(f"case: {n} peers, {math.ceil(n / cfg.per_process)} processes", file=sys.stderr)
        case = run_case(cfg)
        print(json.dumps({k: v for k, v in case.items() if k != "config"}), file=sys.stderr)
        cases.append(case)
    print(json.dumps({"cases": cases}))


if __name__ == "__main__":
    main()
