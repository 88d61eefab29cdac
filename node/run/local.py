"""``atoll local``: a multi-process swarm on 127.0.0.1.

The launcher starts peer 0 (``atoll peer``: forked from a warm process, ``node.run.prefork``, or
with ``--spawn exec`` ``python -m node peer``), waits for the address it bound, then
starts the other peers giving them only that address: they find each other and the fragments'
owners through the DHT, as peers joining over the internet do. It shows live progress from the
JSON lines the peers print, and when every peer has reported its final result it stops them,
hands their results to ``node.run.local_command``, which writes the JSON report and the plot
and prints a summary. Ctrl-C stops every peer cleanly.

``--duration S`` runs the swarm for a wall-clock time counted from the start of training (the
moment every peer has joined and the launcher says start, so a slow start-up on a busy box does
not eat the run): every peer steps without end and stops training at the end time that the start
message carries. ``--chaos SPEC``
(``node.run.chaos``) kills peers (SIGKILL) and restarts them on a schedule counted from the
start of training: a restarted peer is the same index with the same key, certificate and
``--checkpoint-dir`` (every peer saves its island there every H steps and resumes from it),
joins through the live peers with ``--wait-members 1`` and starts at once. A peer's result is
its last incarnation's. Carrying out that schedule is a ``ChaosDriver`` the launcher holds, and
the report's accounting of the run is ``run_accounting`` (both ``node.run.local_chaos``); the
launcher's record of each peer process and the run's timeline are ``node.run.local_peers``.

Peer ↔ launcher protocol (one JSON object per line):
  peer → launcher  {"event": "listening", "index", "url", "peer_id"}
                   {"event": "joined", "index", "versions", "synced"}
                   {"event": "progress", "index", "step", "loss", "versions", "bytes_sent"}
                   {"event": "resumed", "index", "step", "versions"}   (from its checkpoint)
                   {"event": "published", "fragment", "version", "digest"}   (as an owner)
                   {"event": "done", "index", "result": {...}}
  launcher → peer  {"initial_peers": [url, ...]}, then {"start": true} once all are ready
                   (with "until": the unix time to stop training, under --duration)
                   {"stop": true}   (once every peer is done)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from node.config import RunConfig
from node.run.chaos import ChaosSpec
from node.run.local_chaos import ChaosDriver, run_accounting
from node.run.local_peers import PeerProcess, Timeline, last_error
from node.run.prefork import ForkedProcess, PreforkServer, fork_supported

__all__ = ["ENDLESS_STEPS", "LaunchPlan", "LocalSwarm", "PeerProcess", "last_error"]

ENDLESS_STEPS = 10**9  # --duration: peers step until the start message's end time
FINISH_GRACE_S = 300.0  # --duration: how long after it the peers may take to agree on a final model
STARTUP_S_PER_PEER = 4.0  # start-up deadline: 120 s plus this per peer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """What a local run does besides training ``cfg``: the swarm's admission, extra flags per
    peer (attackers), fault injection (peer index -> inner step to SIGKILL it at), the chaos
    schedule, and a wall-clock duration (None: ``cfg.steps``)."""

    admission: str = "open"
    extra_peer_args: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    kill_at: dict[int, int] = dataclasses.field(default_factory=dict)
    chaos: ChaosSpec | None = None
    duration_s: float | None = None
    spawn: str = "fork"  # "fork": from one warm process (node.run.prefork) where it can; "exec"


class LocalSwarm:
    """Start, watch and stop N peer processes; collect their results. Holds the chaos driver
    (``--chaos``) and the run's timeline."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        plan: LaunchPlan | None = None,
        *,
        quiet: bool = False,
        startup_timeout_s: float | None = None,
        run_timeout_s: float | None = None,
    ) -> None:
        plan = plan or LaunchPlan()
        self.cfg = cfg
        self.admission = plan.admission
        self.run_dir = run_dir
        self.extra = plan.extra_peer_args
        self.quiet = quiet
        # every peer imports torch and builds its model at once: on a small machine start-up
        # takes longer the more peers share it (32 peers on 2 cores: ~2 min)
        self.startup_timeout_s = (
            startup_timeout_s
            if startup_timeout_s is not None
            else 120.0 + STARTUP_S_PER_PEER * cfg.peers
        )
        self.run_timeout_s = run_timeout_s
        self.peers: list[PeerProcess] = []
        self.kill_at = dict(plan.kill_at)  # fault injection: peer index -> step to SIGKILL it at
        self.killed: list[int] = []
        self.published: list[
            tuple[int, int, str, int]
        ] = []  # (fragment, version, digest, peer index)
        self.forged: set[str] = (
            set()
        )  # digests of states an attacker forged (--attack N:forge-handoffs)
        self.handed: set[str] = set()  # digests of every handoff a peer took (none may be forged)
        self.listening = asyncio.Event()  # every peer has bound its address
        self.t0 = time.time()
        # the same moment on the monotonic clock starts the timeline
        self.timeline = Timeline(t0_mono=time.monotonic(), duration_s=plan.duration_s)
        self.chaos, self.duration_s = plan.chaos, plan.duration_s
        self.until: float | None = None  # unix time training stops (--duration), set at start
        self.chaos_driver = (
            ChaosDriver(plan.chaos, self, self.timeline) if plan.chaos is not None else None
        )
        self.incarnations: list[PeerProcess] = []  # every process started, restarts included
        self.spawn_mode = plan.spawn
        self.forks: PreforkServer | None = None  # the prefork server, while the run lasts

    def accounting(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """The report's chaos, restarts, start-up, uptime and goodput
        (``node.run.local_chaos.run_accounting``), and how many peer processes were forked."""
        forked = sum(isinstance(p.proc, ForkedProcess) for p in self.incarnations)
        return {
            **run_accounting(self.cfg, self.timeline, self.chaos_driver, results),
            "spawned": {"forked": forked, "exec": len(self.incarnations) - forked},
        }

    def make_swarm(self) -> RunConfig:
        """A throw-away founder, one authority ("local") and a key and certificate per peer,
        under ``run_dir/swarm/``: a local swarm runs the same checks as any other, with no set-up.
        Returns the config with the manifest's recipe and the swarm id."""
        from node.dht.membership import config_from_manifest, recipe_of
        from node.wire.identity import generate_key, save_certificate, save_key, save_manifest
        from node.workload.presets import resolved
        from protocol.wire.certificates import Certificate
        from protocol.wire.membership import SwarmManifest

        folder = self.run_dir / "swarm"
        folder.mkdir(parents=True, exist_ok=True)
        founder, authority = generate_key(), generate_key()
        save_key(founder, folder / "founder.key", force=True)
        save_key(authority, folder / "authority.key", force=True)
        now = time.time()
        manifest = SwarmManifest(
            name=self.cfg.swarm,
            founder=founder.public_key,
            admission=self.admission,
            created=now,
            recipe=recipe_of(resolved(self.cfg)),
        )
        manifest = manifest.with_authority("local", authority.public_key).signed(founder)
        save_manifest(manifest, folder / "swarm.toml")
        for i in range(self.cfg.peers):
            key = generate_key()
            save_key(key, folder / f"peer{i}.key", force=True)
            # issue 48's address attacker is a learner-only member (node.run.attack_peer)
            roles = (
                ("learner",) if "claim-address" in self.extra.get(i, []) else ("learner", "owner")
            )
            save_certificate(
                Certificate.issue(
                    authority,
                    manifest=manifest,
                    subject=key.public_key,
                    roles=roles,
                    not_before=now - 60,
                    not_after=now + 7 * 86400,
                ),
                folder / f"peer{i}.cert",
            )
        return config_from_manifest(manifest, self.cfg)

    def _identity_args(self, index: int) -> list[str]:
        folder = self.run_dir / "swarm"
        return [
            "--manifest",
            str(folder / "swarm.toml"),
            "--key",
            str(folder / f"peer{index}.key"),
            "--cert",
            str(folder / f"peer{index}.cert"),
        ]

    def _peer_args(self, index: int) -> list[str]:
        """Per-peer flags: identity, checkpoints, the end time, and chaos's stragglers."""
        args = [
            *self._identity_args(index),
            "--checkpoint-dir",
            str(self.run_dir / f"peer{index}-checkpoints"),
            "--event-log-dir",
            str(self.run_dir / f"peer{index}-events"),
        ]
        args += self.extra.get(index, [])
        slow = dict(self.chaos.slow) if self.chaos else {}
        if index in slow:
            args += ["--slow-factor", str(slow[index])]
        return args

    def _config_for(self, index: int, config_path: Path) -> Path:
        """The swarm's config, or for a peer with its own emulated link (``--chaos link=``) a copy
        with that ``link``: the link is a per-process setting, outside the manifest's recipe."""
        links = dict(self.chaos.links) if self.chaos else {}
        if index not in links:
            return config_path
        own = self.run_dir / f"config-peer{index}.json"
        own.write_text(dataclasses.replace(self.cfg, link=links[index]).to_json())
        return own

    async def spawn(
        self,
        index: int,
        config_path: Path,
        *,
        wait_members: int | None = None,
        incarnation: int = 0,
    ) -> PeerProcess:
        suffix = f".{incarnation}" if incarnation else ""
        log_path = self.run_dir / f"peer{index}{suffix}.log"
        cmd = [
            sys.executable,
            "-m",
            "node",
            "peer",
            "--config",
            str(self._config_for(index, config_path)),
            "--index",
            str(index),
            "--t0",
            str(self.t0),
            "--initial-peers-from-stdin",
            "--wait-members",
            str(wait_members or self.cfg.peers),
            *self._peer_args(index),
        ]
        proc: asyncio.subprocess.Process | ForkedProcess | None = None
        if self.forks is not None:
            try:
                proc = await self.forks.spawn(cmd[3:], log_path)
            except (RuntimeError, OSError, TimeoutError) as exc:
                log.warning("peer %d not forked (%s): started by exec instead", index, exc)
        if proc is None:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_path.open("wb"),
                start_new_session=True,
            )
        peer = PeerProcess(index, proc, log_path, incarnation=incarnation)
        self.incarnations.append(peer)
        return peer

    async def read(self, peer: PeerProcess) -> None:
        assert peer.proc.stdout is not None
        async for raw in peer.proc.stdout:
            try:
                msg = json.loads(raw)
            except json.JSONDecodeError:  # a peer's own print, or a line cut short by a kill
                log.warning(
                    "peer %d: a line on its stdout is not an event, skipped: %r",
                    peer.index,
                    raw[:200],
                )
                continue
            event = msg.get("event") if isinstance(msg, dict) else None
            if event == "listening":
                peer.url, peer.peer_id = msg["url"], msg["peer_id"]
                peer.listening.set()
                if not self.quiet:
                    print(f"peer {peer.index}: {peer.url}/", flush=True)  # its status page
            elif event == "ready":
                peer.ready.set()
            elif event == "progress":
                peer.progress = msg
                self.timeline.progress_log.append((time.monotonic(), id(peer), int(msg["step"])))
                if peer.index in self.kill_at and msg["step"] >= self.kill_at[peer.index]:
                    del self.kill_at[peer.index]
                    self.killed.append(peer.index)
                    log.warning(
                        "fault injection: killing peer %d at step %d", peer.index, msg["step"]
                    )
                    self.kill(peer)
            elif event == "published":  # every version any owner published, killed peers' included
                self.published.append(
                    (int(msg["fragment"]), int(msg["version"]), str(msg["digest"]), peer.index)
                )
                self.timeline.version_times.setdefault(
                    (int(msg["fragment"]), int(msg["version"])), time.monotonic()
                )
            elif event == "forged":  # an attacker's forged handoff: no owner may ever publish it
                self.forged.add(str(msg["digest"]))
            elif event == "handoff_taken":
                self.handed.add(str(msg["digest"]))
            elif event == "resumed":
                peer.resumed_from_step = int(msg["step"])
                log.warning(
                    "peer %d resumed from its checkpoint at step %d",
                    peer.index,
                    peer.resumed_from_step,
                )
            elif event == "done":
                peer.result = {
                    **msg["result"],
                    "incarnation": peer.incarnation,
                    "resumed_from_step": peer.resumed_from_step,
                }
                self.timeline.done_times.append(time.monotonic())
                peer.finished.set()
        peer.finished.set()
        peer.listening.set()
        peer.ready.set()

    @staticmethod
    def kill(peer: PeerProcess) -> None:
        peer.killed = True
        with contextlib.suppress(ProcessLookupError):
            peer.proc.kill()

    async def send(self, peer: PeerProcess, msg: dict[str, Any]) -> None:
        if peer.proc.stdin is None or peer.proc.returncode is not None:
            return
        with contextlib.suppress(ConnectionError, BrokenPipeError):
            peer.proc.stdin.write((json.dumps(msg) + "\n").encode())
            await peer.proc.stdin.drain()

    async def _show_progress(self) -> None:
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(2.0)
            if self.quiet:
                continue
            parts = []
            for p in self.peers:
                g = p.progress
                of = "" if self.duration_s is not None else f"/{self.cfg.steps}"
                if p.result is not None:
                    parts.append(f"p{p.index}: done")
                elif p.killed:
                    parts.append(f"p{p.index}: killed")
                elif g:
                    parts.append(
                        f"p{p.index}: step {g['step']}{of} "
                        + ("loss - " if g["loss"] is None else f"loss {g['loss']:.3f} ")
                        + f"v{g['versions']} {g['bytes_sent'] / 1e6:.1f}MB"
                    )
                else:
                    parts.append(f"p{p.index}: starting")
            print(f"[{time.monotonic() - t0:6.1f}s] " + " | ".join(parts), flush=True)

    async def run(self) -> list[dict[str, Any]]:
        """Run the swarm to completion; return every peer's result (raises on a peer's failure)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.cfg.peers):  # a new swarm: never resume another run's islands
            shutil.rmtree(self.run_dir / f"peer{i}-checkpoints", ignore_errors=True)
        config_path = self.run_dir / "config.json"
        forks = asyncio.create_task(self._start_forks())  # its imports, while we make the swarm
        try:
            self.cfg = await asyncio.to_thread(self.make_swarm)
            config_path.write_text(self.cfg.to_json())
            await forks
            return await self._run(config_path)
        finally:
            if not forks.done():
                forks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forks
            if self.forks is not None:
                await self.forks.close()

    async def _start_forks(self) -> None:
        """Start the prefork server (``--spawn fork``, where this system can fork peers, for peers
        on the CPU); on any failure the peers are started by exec, as with ``--spawn exec``."""
        if self.spawn_mode != "fork" or not fork_supported():
            return
        if self.cfg.device != "cpu":  # CUDA in a process forked from one that touched it: exec
            return
        try:
            self.forks = await PreforkServer.start(self.run_dir / "prefork.log")
        except RuntimeError as exc:
            log.warning("%s: peers are started by exec instead", exc)

    async def _run(self, config_path: Path) -> list[dict[str, Any]]:
        async with asyncio.TaskGroup() as tg:
            readers: list[asyncio.Task[None]] = []
            progress = tg.create_task(self._show_progress())
            completed = False
            try:
                await self._start_peers(config_path, tg, readers)
                await self._start_training()
                if self.chaos_driver is not None and self.chaos_driver.spec.kills:
                    await self.chaos_driver.run(config_path, tg, readers)
                await self._drive()
                completed = True
            finally:
                progress.cancel()
                # done: peers exit by themselves on "stop"; interrupted or failed: terminate now
                await self.stop(grace_s=10.0 if completed else 0.0)
                for r in readers:
                    r.cancel()
        return [p.result for p in self.peers if p.result is not None]

    async def _start_peers(
        self, config_path: Path, tg: asyncio.TaskGroup, readers: list[asyncio.Task[None]]
    ) -> None:
        """Start all peers at once; peer 0 founds the swarm, the others join through its address."""
        for i in range(self.cfg.peers):
            peer = await self.spawn(i, config_path)
            self.peers.append(peer)
            readers.append(tg.create_task(self.read(peer)))
        first = self.peers[0]
        await self.send(first, {"initial_peers": []})
        async with asyncio.timeout(self.startup_timeout_s):
            await first.listening.wait()
        if not first.url:
            raise RuntimeError(
                f"peer 0 exited before listening: {last_error(first.log_path)} (log: {first.log_path})"
            )
        for peer in self.peers[1:]:
            await self.send(peer, {"initial_peers": [first.url]})
        async with asyncio.timeout(self.startup_timeout_s):
            await asyncio.gather(*(p.listening.wait() for p in self.peers))
        dead = [p for p in self.peers if not p.url]
        if dead:
            raise RuntimeError(
                f"peer {dead[0].index} exited before listening: {last_error(dead[0].log_path)} "
                f"(log: {dead[0].log_path})"
            )
        self.listening.set()

    async def _start_training(self) -> None:
        """Once every peer has joined and seen all members, let them all start at once: islands
        that start seconds apart contribute from different points of training."""
        async with asyncio.timeout(self.startup_timeout_s + 180.0):
            await asyncio.gather(*(p.ready.wait() for p in self.peers))
        self.timeline.train_started = time.monotonic()
        if self.duration_s is not None:
            self.until = time.time() + self.duration_s
        for peer in self.peers:
            peer.started = True
            await self.send(peer, self.start_message())

    def start_message(self) -> dict[str, Any]:
        """What tells a peer to start training: with ``--duration``, also when to stop."""
        return {"start": True} if self.until is None else {"start": True, "until": self.until}

    async def _drive(self) -> None:
        limit = self.run_timeout_s
        if (
            limit is None and self.duration_s is not None
        ):  # a timed run must end: wind-down is bounded
            limit = self.startup_timeout_s + 180.0 + self.duration_s + FINISH_GRACE_S
        try:
            async with asyncio.timeout(limit):
                await asyncio.gather(*(p.finished.wait() for p in self.peers))
        except TimeoutError:
            stuck = [p.index for p in self.peers if not p.finished.is_set()]
            raise RuntimeError(
                f"peers {stuck} did not finish within {limit:.0f} s of the launch; see their "
                f"logs in {self.peers[stuck[0]].log_path.parent if stuck else 'the run folder'}"
            ) from None
        failed = [p for p in self.peers if p.result is None and not p.killed]
        if failed:
            raise RuntimeError(
                f"peer {failed[0].index} failed: {last_error(failed[0].log_path)} "
                f"(log: {failed[0].log_path})"
            )

    async def stop(self, grace_s: float = 10.0) -> None:
        """Ask every peer to stop, then terminate, then kill what is left."""
        for p in self.incarnations:
            await self.send(p, {"stop": True})
        for sig, wait in ((None, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.incarnations if p.proc.returncode is None]
            if not alive:
                return
            if sig is not None:
                for p in alive:
                    with contextlib.suppress(ProcessLookupError):
                        p.proc.send_signal(sig)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await asyncio.gather(*(p.proc.wait() for p in alive))
