"""What chaos does to a local swarm, and what it cost: kills, restarts and their accounting.

``SwarmChaos`` is mixed into ``LocalSwarm`` (which provides the attributes below). It carries out
a ``--chaos`` schedule (``node.run.chaos``) from the start of training: it kills peers
(SIGKILL), finding the fragments' owners from the peers' status pages when the schedule needs
them, and restarts a killed peer as the same index with the same key, certificate and checkpoint
folder, joining through the live peers. ``accounting`` gives the report's chaos, restarts,
uptime and goodput and what they rest on.
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
from typing import TYPE_CHECKING, Any

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
from node.run.local_peers import PeerProcess, last_error

__all__ = ["SwarmChaos"]

log = logging.getLogger("node.run.local")


class SwarmChaos:
    """The chaos side of ``LocalSwarm``."""

    cfg: RunConfig
    run_dir: Path
    startup_timeout_s: float
    peers: list[PeerProcess]
    killed: list[int]
    t0_mono: float
    chaos: ChaosSpec | None
    duration_s: float | None
    restarts: list[dict[str, Any]]
    chaos_events: list[str]
    train_started: float | None
    progress_log: list[tuple[float, int, int]]
    version_times: dict[tuple[int, int], float]
    done_times: list[float]

    if TYPE_CHECKING:  # LocalSwarm's

        @staticmethod
        def _kill(peer: PeerProcess) -> None: ...

        async def _spawn(
            self,
            index: int,
            config_path: Path,
            *,
            wait_members: int | None = None,
            incarnation: int = 0,
        ) -> PeerProcess: ...

        async def _read(self, peer: PeerProcess) -> None: ...

        async def _send(self, peer: PeerProcess, msg: dict[str, Any]) -> None: ...

    # --- chaos ---------------------------------------------------------------------------------
    @staticmethod
    def _training(p: PeerProcess) -> bool:
        return p.started and not p.killed and p.result is None and p.proc.returncode is None

    async def _run_chaos(
        self,
        spec: ChaosSpec,
        config_path: Path,
        tg: asyncio.TaskGroup,
        readers: list[asyncio.Task[None]],
    ) -> None:
        """Carry out the schedule's kills and restarts until it has nothing left to do or no peer
        trains any more (a restarted peer finishes its start-up on a task of its own)."""
        assert self.train_started is not None
        end = self.t0_mono + self.duration_s if self.duration_s is not None else float("inf")
        schedule = ChaosSchedule(spec, end - self.train_started, random.Random(self.cfg.seed))
        while not schedule.finished() and any(
            p.result is None and not p.killed for p in self.peers
        ):
            await asyncio.sleep(0.25)
            now = time.monotonic() - self.train_started
            live = {p.index for p in self.peers if self._training(p)}
            owners = await self._owners(live) if schedule.owners_needed(now) else set()
            for decision in schedule.tick(now, live, owners):
                log.warning("chaos: %s", decision.reason)
                self.chaos_events.append(decision.reason)
                if isinstance(decision, Kill):
                    self._kill(self.peers[decision.peer])
                    self.restarts.append(
                        {
                            "peer": decision.peer,
                            "killed_at_s": round(now, 1),
                            "restarted_at_s": None,
                        }
                    )
                    if decision.restart_at is None:
                        self.killed.append(decision.peer)
                elif isinstance(decision, Restart):
                    await self._restart(decision.peer, config_path, tg, readers)
                    entry = next(r for r in reversed(self.restarts) if r["peer"] == decision.peer)
                    entry["restarted_at_s"] = round(now, 1)
        for index in schedule.pending_restarts():  # every other peer finished first: it stays dead
            self.chaos_events.append(f"peer {index} not restarted: the others had finished")
            self.killed.append(index)

    async def _restart(
        self,
        index: int,
        config_path: Path,
        tg: asyncio.TaskGroup,
        readers: list[asyncio.Task[None]],
    ) -> None:
        """Start peer ``index`` again: same key, certificate and checkpoint folder."""
        old = self.peers[index]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):
                await old.proc.wait()  # SIGKILLed: gone in a moment; its checkpoint folder is ours
        peer = await self._spawn(
            index, config_path, wait_members=1, incarnation=old.incarnation + 1
        )
        self.peers[index] = peer
        readers.append(tg.create_task(self._read(peer)))
        tg.create_task(self._start_restarted(peer))

    async def _start_restarted(self, peer: PeerProcess) -> None:
        urls = [p.url for p in self.peers if self._training(p) and p.url]
        await self._send(peer, {"initial_peers": urls})
        async with asyncio.timeout(self.startup_timeout_s + 180.0):
            await peer.ready.wait()
        if peer.proc.returncode is not None:
            raise RuntimeError(
                f"restarted peer {peer.index} exited before training: {last_error(peer.log_path)} "
                f"(log: {peer.log_path})"
            )
        peer.started = True
        await self._send(peer, {"start": True})

    async def _owners(self, live: set[int]) -> set[int]:
        """The live peers that own a fragment, from their ``GET /v1/status`` (``owned``); a peer
        that does not answer counts as no owner."""
        from node.run.join import signed_request
        from node.wire.identity import load_certificate, load_key

        folder = self.run_dir / "swarm"

        def owns(i: int) -> bool:
            try:
                code, body = signed_request(
                    f"{self.peers[i].url}/v1/status",
                    swarm=self.cfg.swarm,
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

    # --- accounting -----------------------------------------------------------------------------
    def accounting(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """The report's ``chaos``, ``restarts``, ``uptime``, ``goodput`` and what they rest on
        (definitions: ``node.run.chaos.uptime`` and ``goodput``)."""
        start = self.train_started or self.t0_mono
        end = (
            self.t0_mono + self.duration_s
            if self.duration_s is not None
            else min(self.done_times, default=time.monotonic())
        )
        step_s = median_step_s(self.progress_log)
        window = 2 * self.cfg.inner_steps * step_s
        growing = (
            window and self.cfg.sync_growth != "constant" and self.cfg.mode != "ddp"
        )  # ddp: H = 1
        published = [(t, f) for (f, _v), t in self.version_times.items()]
        return {
            "chaos": self.chaos.text if self.chaos else None,
            "chaos_events": self.chaos_events,
            "restarts": self.restarts,
            "duration_s": self.duration_s,
            "training_s": end - start,
            "median_step_s": step_s,
            "uptime_window_s": window,
            "uptime": uptime(
                published,
                self.cfg.fragments,
                start,
                end,
                self._growing_window(start, step_s) if growing else window,
            )
            if window
            else None,
            "longest_version_gap_s": [
                round(g, 2) for g in longest_gaps(published, self.cfg.fragments, start, end)
            ],
            "goodput": goodput(results, peers=self.cfg.peers, span_s=end - start),
        }

    def _growing_window(self, start: float, step_s: float) -> Callable[[float], float]:
        """2H at each time, from the step the swarm had reached then, when H grows as the lr decays."""
        from node.diloco.inner import lr_at  # torch: only a growing H needs it here
        from node.workload.baseline import train_config_for
        from protocol.diloco.interval import interval

        tcfg, base, growth = train_config_for(self.cfg), self.cfg.inner_steps, self.cfg.sync_growth

        def window_at(t: float) -> float:
            step = max(int((t - start) / step_s), tcfg.warmup_steps)  # warmup counts as the peak
            return 2 * interval(base, lr_at(step, tcfg) / tcfg.lr, growth) * step_s

        return window_at
