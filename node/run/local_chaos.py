"""What chaos does to a local swarm, and what it cost: kills, restarts and their accounting.

``ChaosDriver`` carries out a ``--chaos`` schedule (``node.run.chaos``) from the start of
training, on the peers of a ``Launcher`` (``LocalSwarm``, which holds the driver): it kills
peers (SIGKILL), finding the fragments' owners from the peers' status pages when the schedule
needs them, and restarts a killed peer as the same index with the same key, certificate and
checkpoint folder, joining through the live peers. ``run_accounting`` gives the report's chaos,
restarts, uptime and goodput and what they rest on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from node.config import RunConfig
from node.run.chaos import (
    ChaosSchedule,
    ChaosSpec,
    Kill,
    Restart,
    goodput,
    longest_gaps,
    median_step_s,
    uptime,
)
from node.run.local_peers import PeerProcess, Timeline, last_error

__all__ = ["ChaosDriver", "Launcher", "run_accounting"]

log = logging.getLogger("node.run.local")


class Launcher(Protocol):
    """What the chaos driver needs of the launcher: its peers (by index, the latest
    incarnation), the indices killed for good, and starting, reading, telling and killing a
    peer process."""

    cfg: RunConfig
    run_dir: Path
    startup_timeout_s: float
    peers: list[PeerProcess]
    killed: list[int]

    def kill(self, peer: PeerProcess) -> None: ...

    async def spawn(
        self,
        index: int,
        config_path: Path,
        *,
        wait_members: int | None = None,
        incarnation: int = 0,
    ) -> PeerProcess: ...

    async def read(self, peer: PeerProcess) -> None: ...

    async def send(self, peer: PeerProcess, msg: dict[str, Any]) -> None: ...

    def start_message(self) -> dict[str, Any]: ...


class ChaosDriver:
    """Carries out ``spec`` on ``launcher``'s peers; keeps what it did (``events``, ``restarts``)."""

    def __init__(self, spec: ChaosSpec, launcher: Launcher, timeline: Timeline) -> None:
        self.spec, self.launcher, self.timeline = spec, launcher, timeline
        self.restarts: list[
            dict[str, Any]
        ] = []  # {peer, killed_at_s, restarted_at_s} (s after training start)
        self.events: list[str] = []  # every chaos decision's reason

    # --- chaos ---------------------------------------------------------------------------------
    @staticmethod
    def _training(p: PeerProcess) -> bool:
        return p.started and not p.killed and p.result is None and p.proc.returncode is None

    async def run(
        self,
        config_path: Path,
        tg: asyncio.TaskGroup,
        readers: list[asyncio.Task[None]],
    ) -> None:
        """Carry out the schedule's kills and restarts until it has nothing left to do or no peer
        trains any more (a restarted peer finishes its start-up on a task of its own)."""
        swarm, timeline = self.launcher, self.timeline
        assert timeline.train_started is not None
        end = timeline.training_end() or float("inf")
        schedule = ChaosSchedule(
            self.spec, end - timeline.train_started, random.Random(swarm.cfg.seed)
        )
        while not schedule.finished() and any(
            p.result is None and not p.killed for p in swarm.peers
        ):
            await asyncio.sleep(0.25)
            now = time.monotonic() - timeline.train_started
            live = {p.index for p in swarm.peers if self._training(p)}
            owners = await self._owners(live) if schedule.owners_needed(now) else set()
            for decision in schedule.tick(now, live, owners):
                log.warning("chaos: %s", decision.reason)
                self.events.append(decision.reason)
                if isinstance(decision, Kill):
                    swarm.kill(swarm.peers[decision.peer])
                    self.restarts.append(
                        {
                            "peer": decision.peer,
                            "killed_at_s": round(now, 1),
                            "restarted_at_s": None,
                        }
                    )
                    if decision.restart_at is None:
                        swarm.killed.append(decision.peer)
                elif isinstance(decision, Restart):
                    await self._restart(decision.peer, config_path, tg, readers)
                    entry = next(r for r in reversed(self.restarts) if r["peer"] == decision.peer)
                    entry["restarted_at_s"] = round(now, 1)
        for index in schedule.pending_restarts():  # every other peer finished first: it stays dead
            self.events.append(f"peer {index} not restarted: the others had finished")
            swarm.killed.append(index)

    async def _restart(
        self,
        index: int,
        config_path: Path,
        tg: asyncio.TaskGroup,
        readers: list[asyncio.Task[None]],
    ) -> None:
        """Start peer ``index`` again: same key, certificate and checkpoint folder."""
        swarm = self.launcher
        old = swarm.peers[index]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):
                await old.proc.wait()  # SIGKILLed: gone in a moment; its checkpoint folder is ours
        peer = await swarm.spawn(
            index, config_path, wait_members=1, incarnation=old.incarnation + 1
        )
        swarm.peers[index] = peer
        readers.append(tg.create_task(swarm.read(peer)))
        tg.create_task(self._start_restarted(peer))

    async def _start_restarted(self, peer: PeerProcess) -> None:
        swarm = self.launcher
        urls = [p.url for p in swarm.peers if self._training(p) and p.url]
        await swarm.send(peer, {"initial_peers": urls})
        async with asyncio.timeout(swarm.startup_timeout_s + 180.0):
            await peer.ready.wait()
        if peer.proc.returncode is not None:
            raise RuntimeError(
                f"restarted peer {peer.index} exited before training: {last_error(peer.log_path)} "
                f"(log: {peer.log_path})"
            )
        peer.started = True
        await swarm.send(peer, swarm.start_message())

    async def _owners(self, live: set[int]) -> set[int]:
        """The live peers that own a fragment, from their ``GET /v1/status`` (``owned``); a peer
        that does not answer counts as no owner."""
        from node.run.join import signed_request
        from node.wire.identity import load_certificate, load_key

        swarm = self.launcher
        folder = swarm.run_dir / "swarm"

        def owns(i: int) -> bool:
            try:
                code, body = signed_request(
                    f"{swarm.peers[i].url}/v1/status",
                    swarm=swarm.cfg.swarm,
                    signer=load_key(folder / f"peer{i}.key"),
                    cert=load_certificate(folder / f"peer{i}.cert"),
                    timeout=5.0,
                )
                return code == 200 and bool(json.loads(body).get("owned"))
            except (OSError, ValueError) as exc:
                log.info("chaos: peer %d's status unreadable: %s", i, exc)
                return False

        answers = await asyncio.gather(*(asyncio.to_thread(owns, i) for i in sorted(live)))
        return {i for i, yes in zip(sorted(live), answers, strict=True) if yes}


# --- accounting ---------------------------------------------------------------------------------
def run_accounting(
    cfg: RunConfig, timeline: Timeline, chaos: ChaosDriver | None, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """The report's ``chaos``, ``restarts``, ``uptime``, ``goodput`` and what they rest on
    (definitions: ``node.run.chaos.uptime`` and ``goodput``)."""
    start = timeline.train_started or timeline.t0_mono
    end = timeline.training_end() or min(timeline.done_times, default=time.monotonic())
    step_s = median_step_s(timeline.progress_log)
    window = 2 * cfg.inner_steps * step_s
    growing = window and cfg.sync_growth != "constant" and cfg.mode != "ddp"  # ddp: H = 1
    published = [(t, f) for (f, _v), t in timeline.version_times.items()]
    return {
        "chaos": chaos.spec.text if chaos else None,
        "chaos_events": chaos.events if chaos else [],
        "restarts": chaos.restarts if chaos else [],
        "duration_s": timeline.duration_s,
        # the launch until every peer had joined and the launcher said start
        "startup_s": start - timeline.t0_mono,
        "training_s": end - start,
        "median_step_s": step_s,
        "uptime_window_s": window,
        "uptime": uptime(
            published,
            cfg.fragments,
            start,
            end,
            _growing_window(cfg, start, step_s) if growing else window,
        )
        if window
        else None,
        "longest_version_gap_s": [
            round(g, 2) for g in longest_gaps(published, cfg.fragments, start, end)
        ],
        "goodput": goodput(results, peers=cfg.peers, span_s=end - start),
    }


def _growing_window(cfg: RunConfig, start: float, step_s: float) -> Callable[[float], float]:
    """2H at each time, from the step the swarm had reached then, when H grows as the lr decays."""
    from node.diloco.inner import lr_at  # torch: only a growing H needs it here
    from node.workload.baseline import train_config_for
    from protocol.diloco.interval import interval

    tcfg, base, growth = train_config_for(cfg), cfg.inner_steps, cfg.sync_growth

    def window_at(t: float) -> float:
        step = max(int((t - start) / step_s), tcfg.warmup_steps)  # warmup counts as the peak
        return 2 * interval(base, lr_at(step, tcfg) / tcfg.lr, growth) * step_s

    return window_at
