"""The prefork server of ``atoll local`` (``node.run.prefork``), over its real socket, with real
forked ``atoll peer`` processes: their arguments, pipes, log, title and exit codes, signals
through pidfds, and what is left when the server itself dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from node.config import RunConfig
from node.run.prefork import PreforkServer, fork_supported

pytestmark = pytest.mark.skipif(not fork_supported(), reason="no fork with pidfds here")

ROOT = Path(__file__).resolve().parents[3]


def test_a_forked_peer_runs_as_an_exec_d_one_would_and_its_end_is_told_even_without_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    config = tmp_path / "config.json"
    config.write_text(RunConfig(peers=1, steps=5, model="tiny").to_json())
    peer_args = ["peer", "--config", str(config), "--index", "0", "--initial-peers-from-stdin"]

    async def scenario() -> None:
        server = await PreforkServer.start(tmp_path / "prefork.log")
        try:
            # a mistake in its arguments: atoll's own message in its log, atoll's exit code
            bad = await server.spawn(
                ["peer", "--config", str(tmp_path / "none.json")], tmp_path / "bad.log"
            )
            assert await asyncio.wait_for(bad.wait(), 30) == 2
            assert "--index" in (tmp_path / "bad.log").read_text()

            # a peer: its stdin and stdout are the launcher's pipes, ps shows its command line
            peer = await server.spawn(peer_args, tmp_path / "peer.log")
            assert peer.pid != server.pid
            peer.stdin.write(b'{"initial_peers": []}\n')
            await peer.stdin.drain()
            event = json.loads(await asyncio.wait_for(peer.stdout.readline(), 60))
            assert event["event"] == "listening" and event["url"].startswith("http://127.0.0.1:")
            shown = subprocess.run(
                ["pgrep", "-f", f"node peer --config {config}"], capture_output=True, text=True
            ).stdout.split()
            assert shown == [str(peer.pid)]
            peer.terminate()  # through its pidfd; its parent, the server, tells how it ended
            assert await asyncio.wait_for(peer.wait(), 30) == -signal.SIGTERM
            assert await peer.stdout.read() == b""  # nobody else holds its stdout open
            with pytest.raises(ProcessLookupError):
                peer.kill()

            # the server dies: no more forks, and a live child's end is still told (its code is
            # lost with its parent)
            orphan = await server.spawn(peer_args, tmp_path / "orphan.log")
            os.kill(server.pid, signal.SIGKILL)
            for _ in range(600):
                if server.gone:
                    break
                await asyncio.sleep(0.05)
            assert server.gone
            with pytest.raises(RuntimeError, match="prefork server"):
                await server.spawn(peer_args, tmp_path / "late.log")
            orphan.kill()
            assert await asyncio.wait_for(orphan.wait(), 30) == 255
        finally:
            await server.close()

    asyncio.run(scenario())


def test_a_launcher_whose_prefork_server_fails_starts_its_peers_by_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from node.run.local import LaunchPlan, LocalSwarm

    async def fails(log_path: Path) -> PreforkServer:
        raise RuntimeError("the prefork server failed: it exited (log: prefork.log)")

    monkeypatch.setattr(PreforkServer, "start", fails)

    async def start(spawn: str, device: str = "cpu") -> PreforkServer | None:
        cfg = RunConfig(peers=2, steps=5, model="tiny", device=device)
        swarm = LocalSwarm(cfg, tmp_path, LaunchPlan(spawn=spawn))
        await swarm._start_forks()
        return swarm.forks

    assert asyncio.run(start("fork")) is None
    assert "peers are started by exec instead" in caplog.text
    caplog.clear()
    assert asyncio.run(start("exec")) is None and asyncio.run(start("fork", "cuda")) is None
    assert not caplog.text  # asked for, or on a GPU: no server tried, nothing to warn of


def test_the_blocking_client_forks_the_process_level_tests_children(tmp_path: Path) -> None:
    """``ForkServer`` (threads, no event loop) as ``bench.cli_swarm.Proc`` uses it: a bootstrap
    node forked, its first line read through the pipe, stopped as ``Popen`` is; a mistake's
    exit code."""
    import bench.cli_swarm as cli_swarm
    from node.run.prefork import ForkedChild

    assert cli_swarm.FORK_CHILDREN  # tests/conftest.py
    procs: list[cli_swarm.Proc] = []
    try:
        url = cli_swarm.start_bootstrap(tmp_path, procs)
        assert url.startswith("http://127.0.0.1:") and isinstance(procs[0].proc, ForkedChild)
        bad = cli_swarm.Proc(["peer", "--config", str(tmp_path / "none.json")], tmp_path / "b.log")
        procs.append(bad)
        assert bad.proc.wait(30) == 2 and bad.proc.poll() == 2
        with pytest.raises(subprocess.TimeoutExpired):
            procs[0].proc.wait(0.1)
    finally:
        for p in procs:
            p.stop()
    assert procs[0].proc.returncode == 0  # atoll bootstrap ends cleanly on SIGTERM


def test_a_blocking_client_s_child_whose_server_died_still_ends_and_is_waited_for(
    tmp_path: Path,
) -> None:
    """As with the launcher's client: the server's death loses its children's exit codes, and
    their pidfds still say when they end (255), never a wait that cannot return."""
    from bench.cli_swarm import ENV
    from node.run.prefork import ForkServer

    server = ForkServer(tmp_path / "prefork.log", env=ENV, cwd=ROOT)
    log = (tmp_path / "boot.log").open("wb")
    out, child_out = os.pipe()
    try:
        with open(os.devnull, "rb") as devnull:
            child = server.spawn(
                ["bootstrap", "--listen", "127.0.0.1:0"], devnull.fileno(), child_out, log.fileno()
            )
        os.kill(server._proc.pid, signal.SIGKILL)
        server._proc.wait(30)
        for _ in range(100):
            if server.gone:
                break
            time.sleep(0.05)
        assert server.gone
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)  # alive: not taken for ended
        child.kill()
        assert child.wait(30) == 255
        with pytest.raises(RuntimeError, match="prefork server"):
            server.spawn(["bootstrap"], 0, 1, 2)
    finally:
        os.close(child_out)
        os.close(out)
        log.close()
        server.close()


def test_a_child_forked_after_its_spawn_gave_up_or_was_cancelled_does_not_run_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply that comes after its spawn gave up (the blocking client's timeout), or a launcher's
    spawn cancelled while the fork was made: the forked child is killed, not left running."""
    import node.run.prefork as prefork

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    argv = ["bootstrap", "--listen", "127.0.0.1:0"]

    def children(server: PreforkServer) -> list[int]:
        """The server's live (unreaped) children, as the kernel lists them."""
        path = Path(f"/proc/{server.pid}/task/{server.pid}/children")
        return [int(pid) for pid in path.read_text().split()]

    async def only(server: PreforkServer, pid: int) -> list[int]:
        """Its children once the killed ones are reaped (the server forks in order, so those
        asked for before ``pid`` exist by now, alive or not)."""
        for _ in range(200):
            if children(server) == [pid]:
                break
            await asyncio.sleep(0.05)
        return children(server)

    async def scenario() -> None:
        server = await PreforkServer.start(tmp_path / "prefork.log")
        try:
            monkeypatch.setattr(prefork, "SPAWN_TIMEOUT_S", 0.0)
            with pytest.raises(RuntimeError, match="forked nothing within 0 s"):
                await server.spawn(argv, tmp_path / "late.log")
            monkeypatch.setattr(prefork, "SPAWN_TIMEOUT_S", 30.0)
            task = asyncio.create_task(server.spawn(argv, tmp_path / "cancelled.log"))
            await asyncio.sleep(0)  # its fork is under way on a worker thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the server still forks: one that is waited for runs until it is stopped
            kept = await server.spawn(argv, tmp_path / "kept.log")
            assert await only(server, kept.pid) == [kept.pid]
            kept.terminate()  # 0 once its handler is installed, -15 before
            assert await asyncio.wait_for(kept.wait(), 30) in (0, -signal.SIGTERM)
        finally:
            await server.close()

    asyncio.run(scenario())
