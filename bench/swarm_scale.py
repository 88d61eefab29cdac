"""Hundreds of real peers on one box: what each peer's control traffic, view and spread cost.

Every peer is a real ``PeerNode`` (its own aiohttp server on 127.0.0.1, its own client session,
Ed25519-sealed RPCs, the real DHT and membership) around an ``Island`` of a tiny tensor model
(``TinyModel``: a few hundred floats) whose inner "optimizer" is stand-in compute: each step sets
a seeded gradient (a drift every peer shares plus its own noise) and takes an SGD step, then waits
``step_s``. The transport is the real loopback one, with no link emulation: what is measured is
the bytes the protocol puts on the wire (``Transport.bytes_by_route``) and the CPU the box has.

Peers live ``--per-process`` to a worker process (one asyncio loop each, ``torch`` on one
thread). The parent starts worker 0, whose first peer founds the swarm, then the others, which
join through it. Every worker follows the same seeded schedule (``Schedule``), on a clock the
parent sets: the first ``peers`` join, staggered over ``join_s``; the swarm trains; from
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
                              until 99 % of the learners live through it held it (or a newer
                              one); the median over versions (``spread_p99_max_s``: the worst)
``owner_agreement``           per sample outside churn and per fragment, the fraction of pairs
                              of live peers that name the same owner; the mean
``peak_rss_mb``               the largest worker's peak RSS (``rss_mb_per_peer``: all workers'
                              peaks summed, per peer)

Run from the repository root (a heavy run: see docs/scale_peers.md for the conditions)::

    python -m bench.swarm_scale --peers 16,128,512 --json
    python -m bench.swarm_scale --peers 16 --duration 60 --json     # a quick look

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from node.config import RunConfig
from node.diloco.island import Island
from node.diloco.island_config import island_config
from node.peer import NodeOptions, PeerNode
from protocol.diloco.fragments import plan_fragments
from protocol.wire.signing import Signer

__all__ = [
    "Config",
    "Schedule",
    "TinyModel",
    "is_control",
    "owner_agreement",
    "spread_times",
    "summarize",
]

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP_LOCAL = 2  # joined peers of its own worker a joiner also bootstraps from


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
                at=cfg.join_s * i / max(1, cfg.peers - 1) if i else 0.0,
                kind="join",
                slot=i,
                may_own=owner[i],
            )
            for i in range(cfg.peers)
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
        swarm="swarm-scale",
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
    may_own: bool = True
    serve: asyncio.Task[None] | None = None
    train: asyncio.Task[None] | None = None
    joined_at: float | None = None
    gone_at: float | None = None
    bytes_at_open: Counter[str] | None = None
    bytes_at_close: Counter[str] | None = None
    held: dict[int, int] = field(default_factory=dict)  # fragment -> newest version held
    first_held: dict[str, float] = field(default_factory=dict)  # "p:v" -> when first held


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
    signer = Signer.from_seed(random.Random(f"{cfg.seed}/{slot}").randbytes(32))
    # (NodeOptions() when every peer may own: the harness runs on trees before ``may_own`` too)
    options = NodeOptions() if may_own else NodeOptions(may_own=False)
    node = PeerNode(rcfg, signer, model, plan, options)
    box.append(node)
    return Peer(slot=slot, node=node, island=island, optimizer=optimizer, may_own=may_own)


async def train(peer: Peer, cfg: Config) -> None:
    """Stand-in compute: a seeded gradient (shared drift + own noise), an SGD step, a wait."""
    while not peer.node.joined.is_set():
        await asyncio.sleep(0.1)
    if peer.node.failure is not None:
        return
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


class Worker:
    """The peers of one process, on one loop, following the schedule for its slots."""

    def __init__(
        self, cfg: Config, index: int, workers: int, t0: float, initial: list[str]
    ) -> None:
        self.cfg, self.index, self.workers, self.t0 = cfg, index, workers, t0
        self.initial = initial
        self.schedule = Schedule.of(cfg)
        self.rcfg = run_config(cfg)
        self.peers: dict[int, Peer] = {}
        self.samples: list[dict[str, Any]] = []

    def mine(self, slot: int) -> bool:
        return self.schedule.worker_of(slot, self.cfg.per_process, self.workers) == self.index

    def now(self) -> float:
        return time.time() - self.t0

    async def run(self) -> dict[str, Any]:
        async with asyncio.TaskGroup() as tg:
            sampler = tg.create_task(self.sample_loop())
            for ev in self.schedule.events:
                if not self.mine(ev.slot):
                    continue
                await asyncio.sleep(max(0.0, ev.at - self.now()))
                await self.apply(ev, tg)
            await asyncio.sleep(max(0.0, self.cfg.duration_s - self.now()))
            sampler.cancel()
            for peer in self.peers.values():
                if peer.gone_at is None:
                    self.close_window(peer)
                    await self.stop(peer, kill=True)
                    peer.gone_at = None  # live to the end (the run's end is no churn)
        return self.report()

    async def apply(self, ev: Event, tg: asyncio.TaskGroup) -> None:
        if ev.kind == "join":
            peer = self.peers[ev.slot] = build_peer(
                ev.slot, self.cfg, self.rcfg, may_own=ev.may_own
            )
            peer.serve = tg.create_task(self.serve(peer, self.initial_peers(ev.slot)))
            peer.train = tg.create_task(train(peer, self.cfg))
            if ev.slot == 0:  # the founder: the others join through it
                while not peer.node.ready.is_set():
                    await asyncio.sleep(0.05)
                self.initial = [peer.node.url]
                print(json.dumps({"founder": peer.node.url}), flush=True)
            return
        peer = self.peers[ev.slot]
        self.close_window(peer)
        await self.stop(peer, kill=ev.kind == "kill")

    def initial_peers(self, slot: int) -> list[str]:
        """The founder and up to ``BOOTSTRAP_LOCAL`` live peers of this worker that have joined,
        drawn by ``slot``: one founder alone cannot answer hundreds of joins in a few seconds
        (its loop is shared with its worker's other peers)."""
        joined = [
            p.node.url
            for p in self.peers.values()
            if p.gone_at is None and p.joined_at is not None and p.slot != slot
        ]
        rng = random.Random(slot)
        return [*rng.sample(joined, min(BOOTSTRAP_LOCAL, len(joined))), *self.initial]

    async def serve(self, peer: Peer, initial: list[str]) -> None:
        with contextlib.suppress(Exception):
            await peer.node.serve(peer.island, initial)

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

    def close_window(self, peer: Peer) -> None:
        if peer.bytes_at_open is not None and peer.bytes_at_close is None:
            peer.bytes_at_close = Counter(peer.node.transport.bytes_by_route)
            peer.bytes_closed_at = self.now()  # type: ignore[attr-defined]

    async def sample_loop(self) -> None:
        """Poll held versions often (spread timing), the rest every ``sample_s``."""
        lo, hi = self.schedule.steady
        next_sample = 0.0
        while True:
            t = self.now()
            for peer in self.peers.values():
                if peer.gone_at is None and peer.node.joined.is_set() and peer.node.net is not None:
                    if peer.joined_at is None:
                        peer.joined_at = t
                    self.note_versions(peer, t)
                    if lo <= t < hi and peer.bytes_at_open is None:
                        peer.bytes_at_open = Counter(peer.node.transport.bytes_by_route)
                        peer.bytes_opened_at = t  # type: ignore[attr-defined]
                    if t >= hi:
                        self.close_window(peer)
            if t >= next_sample:
                next_sample = t + self.cfg.sample_s
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
                peer.held[p] = version

    def sample(self, t: float) -> dict[str, Any]:
        owners: dict[str, list[str]] = {}
        views: dict[str, int] = {}
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
        return {"t": t, "owners": owners, "views": views}

    def report(self) -> dict[str, Any]:
        peers = {}
        for peer in self.peers.values():
            opened, closed = peer.bytes_at_open, peer.bytes_at_close
            window = None
            if opened is not None and closed is not None:
                span = peer.bytes_closed_at - peer.bytes_opened_at  # type: ignore[attr-defined]
                window = {"s": span, "bytes": dict(closed - opened)}
            peers[str(peer.slot)] = {
                "joined_at": peer.joined_at,
                "may_own": peer.may_own,
                "gone_at": peer.gone_at,
                "window": window,
                "first_held": peer.first_held,
                "failure": repr(peer.node.failure) if peer.node.failure is not None else None,
            }
        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {
            "worker": self.index,
            "peers": peers,
            "samples": self.samples,
            "peak_rss_mb": rss_kb / 1024,
        }


def worker_main(cfg: Config, index: int, workers: int, t0: float, initial: list[str]) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    out = asyncio.run(Worker(cfg, index, workers, t0, initial).run())
    print(json.dumps(out), flush=True)


# --- the parent: start workers, merge their reports ------------------------------------------


def owner_agreement(samples: Sequence[dict[str, list[str]]], fragments: int) -> float | None:
    """Per sample and fragment, the fraction of pairs of peers naming the same owner; the mean.
    ``samples``: per sample, peer -> the owner it names for each fragment ("" for none)."""
    scores = []
    for owners in samples:
        rows = list(owners.values())
        n = len(rows)
        if n < 2:
            continue
        for p in range(fragments):
            counts = Counter(row[p] for row in rows)
            same = sum(c * (c - 1) for name, c in counts.items() if name)
            scores.append(same / (n * (n - 1)))
    return statistics.fmean(scores) if scores else None


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
    merged: dict[int, dict[str, dict[str, Any]]] = defaultdict(lambda: {"owners": {}, "views": {}})
    for r in reports:
        for s in r["samples"]:
            tick = int(s["t"] // cfg.sample_s)
            merged[tick]["owners"].update(s["owners"])
            merged[tick]["views"].update(s["views"])
    lo, hi = schedule.steady

    def calm(t: float) -> bool:
        return lo <= t < hi or (t >= lo and not any(a <= t < b for a, b in schedule.churn_windows))

    steady = [m for tick, m in merged.items() if lo <= tick * cfg.sample_s < hi]
    calm_owners = [m["owners"] for tick, m in merged.items() if calm(tick * cfg.sample_s)]
    views = [v for m in steady for v in m["views"].values()]
    lives = {pid: (p["joined_at"], p["gone_at"]) for pid, p in peers.items()}
    spread, judged = spread_times(
        {pid: p["first_held"] for pid, p in peers.items()},
        lives,
        until=cfg.duration_s,
        horizon_s=min(60.0, cfg.duration_s / 4),
    )
    versions = {v for p in peers.values() for v in p["first_held"]}
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
        "owner_agreement": owner_agreement(calm_owners, cfg.fragments),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in reports), 1),
        "rss_mb_per_peer": round(sum(r["peak_rss_mb"] for r in reports) / schedule.slots, 2),
        "joined": sum(1 for p in peers.values() if p["joined_at"] is not None),
        "failed": len(failures),
        "failures": dict(Counter(f[:120] for f in failures).most_common(4)),
        "steady_window_s": [lo, hi],
        "config": asdict(cfg),
    }


def run_case(cfg: Config) -> dict[str, Any]:
    workers = max(1, math.ceil(cfg.peers / cfg.per_process))
    t0 = time.time() + 3.0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    spec = json.dumps(asdict(cfg))

    def start(index: int, initial: list[str]) -> subprocess.Popen[str]:
        args = [sys.executable, "-m", "bench.swarm_scale", "--worker", spec, str(index),
                str(workers), repr(t0), json.dumps(initial)]  # fmt: skip
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)

    procs = [start(0, [])]
    assert procs[0].stdout is not None
    founder = json.loads(procs[0].stdout.readline())["founder"]
    procs += [start(i, [founder]) for i in range(1, workers)]
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=cfg.duration_s + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"worker exited {proc.returncode}; see its stderr above")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return summarize(cfg, reports)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        spec, index, workers, t0, initial = argv[1:6]
        worker_main(
            Config(**json.loads(spec)), int(index), int(workers), float(t0), json.loads(initial)
        )
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
