"""``atoll local``: a multi-process swarm on 127.0.0.1.

The launcher starts peer 0 (``python -m node peer``), waits for the address it bound, then
starts the other peers giving them only that address: they find each other and the fragments'
owners through the DHT, as peers joining over the internet do. It shows live progress from the
JSON lines the peers print, and when every peer has reported its final result it stops them,
writes the JSON report and the plot, and prints a summary. Ctrl-C stops every peer cleanly.

Peer ↔ launcher protocol (one JSON object per line):
  peer → launcher  {"event": "listening", "index", "url", "peer_id"}
                   {"event": "joined", "index", "versions", "synced"}
                   {"event": "progress", "index", "step", "loss", "versions", "bytes_sent"}
                   {"event": "done", "index", "result": {...}}
  launcher → peer  {"stop": true}   (once every peer is done)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.config import RunConfig
from node.run.report import build_report, summary_lines, write_report

__all__ = ["LocalSwarm", "baseline_for", "island_alone_for", "run_local"]

log = logging.getLogger(__name__)


@dataclass
class PeerProcess:
    index: int
    proc: asyncio.subprocess.Process
    log_path: Path
    url: str = ""
    peer_id: str = ""
    progress: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    listening: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # joined, waiting for "start"
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class LocalSwarm:
    """Start, watch and stop N peer processes; collect their results."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, extra_peer_args: dict[int, list[str]] | None = None,
                 quiet: bool = False, startup_timeout_s: float = 120.0, run_timeout_s: float | None = None,
                 kill_at: dict[int, int] | None = None, admission: str = "open") -> None:
        self.cfg = cfg
        self.admission = admission
        self.run_dir = run_dir
        self.extra = extra_peer_args or {}
        self.quiet = quiet
        self.startup_timeout_s = startup_timeout_s
        self.run_timeout_s = run_timeout_s
        self.peers: list[PeerProcess] = []
        self.kill_at = dict(kill_at or {})  # fault injection: peer index -> inner step to SIGKILL it at
        self.killed: list[int] = []
        self.listening = asyncio.Event()  # every peer has bound its address
        self.t0 = time.time()

    def make_swarm(self) -> RunConfig:
        """A throw-away founder, one authority ("local") and a key and certificate per peer,
        under ``run_dir/swarm/``: a local swarm runs the same checks as any other, with no set-up.
        Returns the config with the manifest's recipe and the swarm id."""
        from node.dht.membership import config_from_manifest, recipe_of
        from node.run.train import resolved
        from node.wire.identity import generate_key, save_certificate, save_key, save_manifest
        from protocol.wire.membership import Certificate, SwarmManifest

        folder = self.run_dir / "swarm"
        folder.mkdir(parents=True, exist_ok=True)
        founder, authority = generate_key(), generate_key()
        save_key(founder, folder / "founder.key", force=True)
        save_key(authority, folder / "authority.key", force=True)
        now = time.time()
        manifest = SwarmManifest(name=self.cfg.swarm, founder=founder.public_key, admission=self.admission,
                                 created=now, recipe=recipe_of(resolved(self.cfg)))
        manifest = manifest.with_authority("local", authority.public_key).signed(founder)
        save_manifest(manifest, folder / "swarm.toml")
        for i in range(self.cfg.peers):
            key = generate_key()
            save_key(key, folder / f"peer{i}.key", force=True)
            save_certificate(Certificate.issue(authority, manifest=manifest, subject=key.public_key,
                                               roles=("learner", "owner"), not_before=now - 60,
                                               not_after=now + 7 * 86400), folder / f"peer{i}.cert")
        return config_from_manifest(manifest, self.cfg)

    def _identity_args(self, index: int) -> list[str]:
        folder = self.run_dir / "swarm"
        return ["--manifest", str(folder / "swarm.toml"), "--key", str(folder / f"peer{index}.key"),
                "--cert", str(folder / f"peer{index}.cert")]

    async def _spawn(self, index: int, config_path: Path) -> PeerProcess:
        log_path = self.run_dir / f"peer{index}.log"
        cmd = [sys.executable, "-m", "node", "peer", "--config", str(config_path), "--index", str(index),
               "--t0", str(self.t0), "--initial-peers-from-stdin", "--wait-members", str(self.cfg.peers),
               *self._identity_args(index), *self.extra.get(index, [])]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=log_path.open("wb"), start_new_session=True,
        )
        return PeerProcess(index, proc, log_path)

    async def _read(self, peer: PeerProcess) -> None:
        assert peer.proc.stdout is not None
        async for raw in peer.proc.stdout:
            try:
                msg = json.loads(raw)
            except json.JSONDecodeError:
                continue
            event = msg.get("event")
            if event == "listening":
                peer.url, peer.peer_id = msg["url"], msg["peer_id"]
                peer.listening.set()
            elif event == "ready":
                peer.ready.set()
            elif event == "progress":
                peer.progress = msg
                if peer.index in self.kill_at and msg["step"] >= self.kill_at[peer.index]:
                    del self.kill_at[peer.index]
                    self.killed.append(peer.index)
                    log.warning("fault injection: killing peer %d at step %d", peer.index, msg["step"])
                    with contextlib.suppress(ProcessLookupError):
                        peer.proc.kill()
            elif event == "done":
                peer.result = msg["result"]
                peer.finished.set()
        peer.finished.set()
        peer.listening.set()
        peer.ready.set()

    async def _send(self, peer: PeerProcess, msg: dict[str, Any]) -> None:
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
                if p.result is not None:
                    parts.append(f"p{p.index}: done")
                elif p.index in self.killed:
                    parts.append(f"p{p.index}: killed")
                elif g:
                    parts.append(f"p{p.index}: step {g['step']}/{self.cfg.steps} loss {g['loss']:.3f} "
                                 f"v{g['versions']} {g['bytes_sent'] / 1e6:.1f}MB")
                else:
                    parts.append(f"p{p.index}: starting")
            print(f"[{time.monotonic() - t0:6.1f}s] " + " | ".join(parts), flush=True)

    async def run(self) -> list[dict[str, Any]]:
        """Run the swarm to completion; return every peer's result (raises on a peer's failure)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "config.json"
        self.cfg = self.make_swarm()
        config_path.write_text(self.cfg.to_json())
        async with asyncio.TaskGroup() as tg:
            readers: list[asyncio.Task[None]] = []
            progress = tg.create_task(self._show_progress())
            completed = False
            try:
                await self._start_peers(config_path, tg, readers)
                await self._start_training()
                await self._drive()
                completed = True
            finally:
                progress.cancel()
                # done: peers exit by themselves on "stop"; interrupted or failed: terminate now
                await self.stop(grace_s=10.0 if completed else 0.0)
                for r in readers:
                    r.cancel()
        return [p.result for p in self.peers if p.result is not None]

    async def _start_peers(self, config_path: Path, tg: asyncio.TaskGroup,
                           readers: list[asyncio.Task[None]]) -> None:
        """Start all peers at once; peer 0 founds the swarm, the others join through its address."""
        for i in range(self.cfg.peers):
            peer = await self._spawn(i, config_path)
            self.peers.append(peer)
            readers.append(tg.create_task(self._read(peer)))
        first = self.peers[0]
        await self._send(first, {"initial_peers": []})
        async with asyncio.timeout(self.startup_timeout_s):
            await first.listening.wait()
        if not first.url:
            raise RuntimeError(f"peer 0 exited before listening; see {first.log_path}")
        for peer in self.peers[1:]:
            await self._send(peer, {"initial_peers": [first.url]})
        async with asyncio.timeout(self.startup_timeout_s):
            await asyncio.gather(*(p.listening.wait() for p in self.peers))
        dead = [p for p in self.peers if not p.url]
        if dead:
            raise RuntimeError(f"peer {dead[0].index} exited before listening; see {dead[0].log_path}")
        self.listening.set()

    async def _start_training(self) -> None:
        """Once every peer has joined and seen all members, let them all start at once: islands
        that start seconds apart contribute from different points of training."""
        async with asyncio.timeout(self.startup_timeout_s + 180.0):
            await asyncio.gather(*(p.ready.wait() for p in self.peers))
        for peer in self.peers:
            await self._send(peer, {"start": True})

    async def _drive(self) -> None:
        async with asyncio.timeout(self.run_timeout_s):
            await asyncio.gather(*(p.finished.wait() for p in self.peers))
        failed = [p for p in self.peers if p.result is None and p.index not in self.killed]
        if failed:
            tail = failed[0].log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"peer {failed[0].index} failed; last log lines:\n{tail}")

    async def stop(self, grace_s: float = 10.0) -> None:
        """Ask every peer to stop, then terminate, then kill what is left."""
        for p in self.peers:
            await self._send(p, {"stop": True})
        for sig, wait in ((None, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.peers if p.proc.returncode is None]
            if not alive:
                return
            if sig is not None:
                for p in alive:
                    with contextlib.suppress(ProcessLookupError):
                        p.proc.send_signal(sig)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await asyncio.gather(*(p.proc.wait() for p in alive))


def run_local(cfg: RunConfig, *, report_path: Path | None, baseline: bool = False,
              alone: bool = False, quiet: bool = False, kill_at: dict[int, int] | None = None,
              extra_peer_args: dict[int, list[str]] | None = None,
              attacks: dict[int, str] | None = None, admission: str = "open") -> dict[str, Any]:
    """Run a local swarm end to end, write the report and plot, print the summary."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report_path = report_path or Path("runs") / stamp / "report.json"
    run_dir = report_path.parent / f"{report_path.stem}-peers"
    swarm = LocalSwarm(cfg, run_dir, quiet=quiet, kill_at=kill_at, extra_peer_args=extra_peer_args,
                       admission=admission)
    t0 = time.monotonic()
    print(f"atoll local: {cfg.peers} peers, {cfg.steps} steps, model {cfg.model}, "
          f"{cfg.fragments} fragments, H={cfg.inner_steps}, codec {cfg.codec}; logs in {run_dir}",
          flush=True)
    try:
        results = asyncio.run(swarm.run())
    except KeyboardInterrupt:
        print("interrupted: peers stopped", file=sys.stderr)
        raise
    report = build_report(dict(json.loads(cfg.to_json())), results, time.monotonic() - t0)
    report["attacks"] = {str(i): a for i, a in sorted((attacks or {}).items())}
    report["killed_peers"] = swarm.killed
    if baseline:
        print("training the synchronous data-parallel baseline at equal tokens ...", flush=True)
        report["baseline"] = baseline_for(cfg)
        end = report["baseline"]["eval_loss_end"]
        report["eval_loss_gap_rel"] = (report["eval_loss"]["end"] - end) / end
    if alone:
        print("training peer 0's island alone (same model, shard and steps, no swarm) ...", flush=True)
        report.update(island_alone_for(cfg, report["eval_loss"]["end"]))
    png = write_report(report, report_path)
    for line in summary_lines(report):
        print(line)
    print(f"report: {report_path}  plot: {png}")
    return report


def island_alone_for(cfg: RunConfig, swarm_eval_end: float, index: int = 0) -> dict[str, Any]:
    """The report's ``island_alone`` (island ``index`` trained alone) and ``merge_gain`` (its final
    eval loss minus the swarm's global model's: positive when merging helped)."""
    import torch

    from node.run.alone import train_island_alone

    torch.set_num_threads(max(1, cfg.threads))
    island = train_island_alone(cfg, index)
    return {"island_alone": island, "merge_gain": island["eval_loss_end"] - swarm_eval_end}


def baseline_for(cfg: RunConfig) -> dict[str, Any]:
    """Synchronous data-parallel training of the same model on the same shards and tokens."""
    import torch

    from node.workload.baseline import train_config_for, train_data_parallel
    from node.workload.corpus import load_corpus, split_corpus

    torch.set_num_threads(2)
    data = load_corpus(Path(cfg.corpus) if cfg.corpus else None, max_bytes=cfg.corpus_max_bytes)
    train, heldout = split_corpus(data)
    return train_data_parallel(train_config_for(cfg), cfg.peers, train, heldout, log=None)
