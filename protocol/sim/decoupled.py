"""Decoupled and synchronous DiLoCo on the virtual clock, merged by protocol/'s own merger.

Theory of operation (arXiv 2604.21428, goodput under failures; docs/simulation.md). ``M``
learners, each an ``ElasticGroup`` of ``chips / M`` chips, train one fragment's worth of model
(fragments are staggered copies of the same round, so one stands for all). The owner is a real
``protocol.diloco.merge.FragmentMerger``: every contribution, tick, membership change and
publication goes through it, and only its decisions say what counts. A contribution's payload is
the chip-seconds of compute it carries; **goodput is the sum of the payloads of the entries the
merger merged** over chips x horizon. A refused contribution's compute is lost, as is a learner's
unsent compute when it loses its state.

Decoupled (``simulate_decoupled``): learners keep the swarm's cadence: at every multiple of the
interval (H inner steps) each live learner sends what it computed since its last contribution,
based on the version it adopted; one that is reconfiguring sends as soon as it is back (the
merger carries or refuses it by its late policy and staleness bound). A contribution reaches the
owner after an upload time; merged versions are published ``sync_s`` after the merge, and each
learner adopts the first version published after its contribution arrived. Learners never wait.

Synchronous DiLoCo (``simulate_sync``): the same merger with quorum 1, a grace window that waits
for every live learner (``set_expected``), and learners that block after sending until the next
version is published, then compute H steps of their own.

The owner learns that a learner lost its state, or came back, ``reconfig_s`` later (the time to
notice). At the horizon every live learner sends what it has and in-flight merges complete.
"""

from __future__ import annotations

import collections
import hashlib
import random
from dataclasses import replace

from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig
from protocol.errors import LocalProtocolError
from protocol.sim.config import Method, Outcome, SimConfig
from protocol.sim.events import EventQueue
from protocol.sim.group import ElasticGroup

__all__ = ["simulate_decoupled", "simulate_sync", "sync_merge_config"]

_EPS = 1e-9


def sync_merge_config(cfg: SimConfig) -> MergeConfig:
    """Synchronous DiLoCo's merger: wait for every live learner (capped at 10 intervals)."""
    cap = 10.0 * (cfg.timing.interval_s + cfg.timing.sync_s + cfg.hardware.restart_s)
    return replace(cfg.merge, quorum=1, gamma=1.0, tau=1e9, grace_cap_s=cap)


class _Learner:
    __slots__ = (
        "awaiting",
        "group",
        "index",
        "mark_chip_s",
        "mark_compute_s",
        "mark_t",
        "peer",
        "send_at",
        "version",
        "wake_token",
        "send_token",
    )

    def __init__(self, index: int, group: ElasticGroup) -> None:
        self.index, self.group = index, group
        self.peer = hashlib.sha256(b"learner %d" % index).digest()
        self.version = 0
        self.awaiting = False  # its contribution reached the owner; adopt the next version
        self.mark_chip_s = self.mark_compute_s = self.mark_t = 0.0
        self.send_at: float | None = None  # a send scheduled for the end of a reconfiguration
        self.wake_token = self.send_token = 0  # bumped to void scheduled wakes and sends


class _Run:
    """One simulated DiLoCo run (decoupled or synchronous)."""

    def __init__(self, cfg: SimConfig, *, sync: bool) -> None:
        self.cfg, self.sync = cfg, sync
        self.q = EventQueue()
        self.rng = random.Random(cfg.seed)
        self.horizon = cfg.horizon_s
        self.merger = FragmentMerger(0, sync_merge_config(cfg) if sync else cfg.merge, now=0.0)
        self.learners: list[_Learner] = []
        for i in range(cfg.learners):
            group = ElasticGroup(
                self.q,
                cfg.hardware,
                cfg.chips_per_learner,
                random.Random(cfg.seed * 1_000_003 + i + 1),
                until=self.horizon,
                failures=cfg.failures,
            )
            learner = _Learner(i, group)
            group.on_lost = lambda now, lr=learner: self._lost(lr, now)
            group.on_restart = lambda now, lr=learner: self._restarted(lr, now)
            self.learners.append(learner)
        self.useful = self.lost = 0.0
        self.merges = 0
        self.refusals: collections.Counter[str] = collections.Counter()
        self.published: list[float] = [0.0]
        self._tick_at: float | None = None
        self._handle(self.merger.set_expected(cfg.learners, now=0.0))

    # -- the learners' side ------------------------------------------------------------------

    def start(self) -> None:
        if self.sync:
            for lr in self.learners:
                self._wake(lr, 0.0)
        else:
            self.q.at(min(self.cfg.timing.interval_s, self.horizon), self._due)

    def _due(self) -> None:
        now = self.q.now
        for lr in self.learners:
            if lr.group.alive and lr.send_at is None:
                when = max(now, lr.group.stall_until)
                lr.send_at = when
                self.q.at(when, self._send, lr, lr.send_token)
        if now < self.horizon:
            self.q.at(min(now + self.cfg.timing.interval_s, self.horizon), self._due)

    def _send(self, lr: _Learner, token: int) -> None:
        if token != lr.send_token:
            return
        now = self.q.now
        lr.send_at = None
        if not lr.group.alive:
            return
        lr.group.advance(now)
        compute = lr.group.compute_s - lr.mark_compute_s
        chip_s = lr.group.chip_s - lr.mark_chip_s
        if compute <= _EPS:
            if self.sync and now < self.horizon:  # nothing computed yet (stalled): try again
                self._wake(lr, now)
            return
        step_s = self.cfg.timing.step_s
        steps = max(1, round(compute / step_s))
        tokens = max(
            1, round(chip_s / step_s)
        )  # chip-steps: a learner's batch scales with its chips
        step_time = (now - lr.mark_t) / steps
        lr.mark_chip_s, lr.mark_compute_s, lr.mark_t = lr.group.chip_s, lr.group.compute_s, now
        if self.sync:
            lr.group.block(now)
        arrive = now + self.rng.uniform(0.0, self.cfg.timing.upload_s)
        self.q.at(arrive, self._arrive, lr, lr.version, tokens, steps, step_time, chip_s)

    def _wake(self, lr: _Learner, now: float) -> None:
        """Synchronous learner: send once it has computed H steps since it last adopted."""
        lr.wake_token += 1
        lr.group.advance(now)
        need = self.cfg.timing.interval_s - (lr.group.compute_s - lr.mark_compute_s)
        if need <= _EPS or now >= self.horizon:
            self._send(lr, lr.send_token)
            return
        when = min(max(now, lr.group.stall_until) + need, self.horizon)
        self.q.at(when, self._wake_check, lr, lr.wake_token)

    def _wake_check(self, lr: _Learner, token: int) -> None:
        if token == lr.wake_token and lr.group.alive and not lr.group.blocked:
            self._wake(lr, self.q.now)

    def _lost(self, lr: _Learner, now: float) -> None:
        self.lost += lr.group.chip_s - lr.mark_chip_s
        lr.mark_chip_s, lr.mark_compute_s = lr.group.chip_s, lr.group.compute_s
        lr.awaiting, lr.send_at = False, None
        lr.wake_token += 1
        lr.send_token += 1
        lr.group.unblock(now)
        self.q.at(now + self.cfg.hardware.reconfig_s, self._update_expected)

    def _restarted(self, lr: _Learner, now: float) -> None:
        lr.version = self.merger.version  # resync: the latest version the owner holds
        lr.mark_chip_s, lr.mark_compute_s, lr.mark_t = lr.group.chip_s, lr.group.compute_s, now
        self.q.at(now + self.cfg.hardware.reconfig_s, self._update_expected)
        if self.sync:
            self._wake(lr, now)

    # -- the owner's side: everything goes through the merger ---------------------------------

    def _arrive(
        self, lr: _Learner, base: int, tokens: int, steps: int, step_time: float, chip_s: float
    ) -> None:
        d = self.merger.on_contribution(
            lr.peer,
            base_version=base,
            tokens=tokens,
            steps=steps,
            step_time=step_time,
            payload=chip_s,
            now=self.q.now,
        )
        if d.refusal is not None:
            self.refusals[d.refusal] += 1
            self.lost += chip_s
            if lr.group.alive:  # resync: adopt the latest version the owner holds
                lr.version = self.merger.version
                if self.sync:
                    lr.group.unblock(self.q.now)
                    self._wake(lr, self.q.now)
        if lr.group.alive and not (self.sync and d.refusal is not None):
            lr.awaiting = True
        self._handle(d)

    def _update_expected(self) -> None:
        alive = sum(1 for lr in self.learners if lr.group.alive)
        self._handle(self.merger.set_expected(alive, now=self.q.now))

    def _tick(self) -> None:
        self._tick_at = None
        deadline = self.merger.deadline()
        if deadline is not None and deadline <= self.q.now:
            self._handle(self.merger.on_tick(self.q.now))
        else:
            self._arm_tick()

    def _publish(self, version: int) -> None:
        now = self.q.now
        d = self.merger.on_published(version, sync_time=self.cfg.timing.sync_s, now=now)
        self.published.append(now)
        for lr in self.learners:
            if lr.awaiting:
                lr.version, lr.awaiting = version, False
                if self.sync:
                    lr.group.unblock(now)
                    self._wake(lr, now)
        self._handle(d)

    def _handle(self, d: Decision) -> None:
        if d.kind == "merge":
            self.merges += 1
            self.useful += sum(_chip_s(e.payload) for e in d.entries)
            self.q.at(self.q.now + self.cfg.timing.sync_s, self._publish, d.version + 1)
        self._arm_tick()

    def _arm_tick(self) -> None:
        deadline = self.merger.deadline()
        if deadline is not None and self._tick_at != deadline:
            self._tick_at = deadline
            self.q.at(max(deadline, self.q.now), self._tick)

    # -- the run -----------------------------------------------------------------------------

    def run(self, method: Method) -> Outcome:
        self.start()
        self.q.run()
        cfg = self.cfg
        provisioned = cfg.hardware.chips * self.horizon
        nominal = cfg.timing.interval_s + (cfg.timing.sync_s if self.sync else 0.0)
        return Outcome(
            method=method,
            chips=cfg.hardware.chips,
            learners=cfg.learners,
            goodput=self.useful / provisioned,
            uptime=_uptime(self.published, self.horizon, 2.0 * nominal),
            horizon_s=self.horizon,
            failures=sum(lr.group.failures for lr in self.learners),
            versions=self.merger.version,
            merged=self.merges,
            refusals=tuple(sorted(self.refusals.items())),
            lost_fraction=self.lost / provisioned,
        )


def _chip_s(payload: object) -> float:
    """A merged entry's payload: the chip-seconds its contribution carried (set by ``_send``)."""
    if not isinstance(payload, float):
        raise LocalProtocolError(f"merged a payload that is not chip-seconds: {payload!r}")
    return payload


def _uptime(published: list[float], horizon: float, slack: float) -> float:
    """Fraction of [0, horizon] at most ``slack`` after the latest published version."""
    times = sorted(t for t in published if t <= horizon) + [horizon]
    stale = sum(max(0.0, b - a - slack) for a, b in zip(times, times[1:], strict=False))
    return 1.0 - stale / horizon


def simulate_decoupled(cfg: SimConfig) -> Outcome:
    """Decoupled DiLoCo with ``cfg.learners`` learners; see the module docstring."""
    return _Run(cfg, sync=False).run("decoupled")


def simulate_sync(cfg: SimConfig) -> Outcome:
    """Synchronous DiLoCo with ``cfg.learners`` learners; see the module docstring."""
    return _Run(cfg, sync=True).run("sync-diloco")
