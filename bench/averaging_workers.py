"""Start, drive and kill the peer processes of ``bench.averaging`` (``bench.averaging_peer``).

Each peer is its own process group (``start_new_session``), so killing a peer kills what it
started too: hivemind's DHT and averager processes and their p2pd daemons. Replies are read on
one thread per peer into a queue; every wait has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["PeerFailed", "Workers"]

ROOT = Path(__file__).resolve().parents[1]


_TICK = os.sysconf("SC_CLK_TCK")
_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def session_cpu_s(sessions: set[int]) -> float:
    """CPU seconds (user + system) used so far by every live process of these sessions: a peer
    and what it started (hivemind's DHT and averager processes, their p2pd daemons)."""
    return sum(cpu_by_session(sessions).values())


def cpu_by_session(sessions: set[int]) -> dict[int, float]:
    """``session_cpu_s`` of each of these sessions, from one pass over ``/proc``."""
    ticks = dict.fromkeys(sessions, 0)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        session = int(fields[3])  # field 6 (session) counted after "pid (comm)"
        if session in ticks:
            ticks[session] += int(fields[11]) + int(fields[12])  # utime, stime
    return {session: t / _TICK for session, t in ticks.items()}


def session_rss_kb(sessions: set[int]) -> int:
    """KiB resident in every live process of these sessions."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sessions:
            total += int(fields[21]) * _PAGE_KB  # rss, in pages
    return total


def available_mb() -> int:
    """MemAvailable from /proc/meminfo, in MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) >> 10
    return 1 << 30


class PeerFailed(RuntimeError):
    """A peer process died, failed to start, or did not answer in time."""


class _Proc:
    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log_path = log
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.averaging_peer", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.replies.put(json.loads(raw))
        self.replies.put(None)  # the process closed its stdout: it is gone

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerFailed(f"no reply within {timeout_s:.0f} s; see {self.log_path}") from None
        if reply is None:
            raise PeerFailed(
                f"the peer exited ({self.proc.poll()}); last lines of {self.log_path}:\n"
                + self.tail()
            )
        return reply

    def tail(self, lines: int = 15) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)


class Workers:
    """N peer processes of one configuration; peer 0 starts first and the others join it."""

    def __init__(
        self,
        spec: dict[str, Any],
        log_dir: Path,
        start_timeout_s: float = 600.0,
        min_available_mb: int = 1536,
    ) -> None:
        """Kills every peer (``aborted`` says why) if the machine's available memory falls
        below ``min_available_mb``: the machine is shared, and its OOM killer picks anyone."""
        self.n = spec["peers"]
        self.alive = list(range(self.n))
        self.procs: list[_Proc] = []
        self.last_cpu_s = 0.0
        self.last_peer_cpu_s: list[float] = []  # per live peer, the same
        self.last_wall = (
            0.0,
            0.0,
        )  # the last timed round's start and end, epoch seconds (to line up profiles)
        self.aborted: str | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._guard_memory, args=(min_available_mb,), daemon=True).start()
        tag = f"{spec['peers']}x{spec['params']}-{spec['codec']}-{'+'.join(spec['systems'])}"
        try:
            self._start({**spec, "index": 0}, log_dir / f"{tag}-peer0.log")
            ready0 = self._recv(0, start_timeout_s)
            if ready0.get("event") != "ready":
                raise PeerFailed(f"peer 0 did not start: {ready0}")
            self.ready = [ready0]
            join = {
                "atoll_peers": [ready0["atoll"]] if "atoll" in ready0 else [],
                "hivemind_peers": ready0.get("hivemind", []),
            }
            for i in range(1, self.n):
                self._start({**spec, **join, "index": i}, log_dir / f"{tag}-peer{i}.log")
            for i in range(1, self.n):
                reply = self._recv(i, start_timeout_s)
                if reply.get("event") != "ready":
                    raise PeerFailed(f"a peer did not start: {reply}")
                self.ready.append(reply)
        except BaseException:
            self.close()
            raise

    def _guard_memory(self, min_available_mb: int) -> None:
        while not self._closed.wait(0.25):
            free = available_mb()
            if free < min_available_mb:
                self.aborted = (
                    f"stopped: the machine had {free} MiB available (< {min_available_mb} MiB)"
                )
                for proc in self.procs:
                    proc.kill()
                return

    def _start(self, spec: dict[str, Any], log: Path) -> _Proc:
        proc = _Proc(spec, log)
        self.procs.append(proc)
        return proc

    def _recv(self, i: int, timeout_s: float) -> dict[str, Any]:
        try:
            return self.procs[i].recv(timeout_s)
        except PeerFailed as exc:
            raise PeerFailed(self.aborted) if self.aborted else exc from None

    def ask(self, i: int, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.procs[i].send(cmd)
        return self._recv(i, timeout_s)

    def ask_all(self, cmd: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """Send ``cmd`` to every live peer, then collect the replies (in ``alive`` order)."""
        for i in self.alive:
            self.procs[i].send(cmd)
        return [self._recv(i, timeout_s) for i in self.alive]

    def session_rss_mb(self, i: int) -> int:
        """MiB resident in peer ``i``'s processes now (shared pages counted in each)."""
        return session_rss_kb({self.procs[i].proc.pid}) >> 10

    def cpu_s(self) -> float:
        """CPU seconds used so far by the live peers' process trees."""
        return session_cpu_s({self.procs[i].proc.pid for i in self.alive})

    def timed(
        self, cmd: dict[str, Any], timeout_s: float, kill: tuple[int, float] | None = None
    ) -> tuple[float, list[dict[str, Any]]]:
        """Send ``cmd`` to every live peer and wait for all: (seconds to the last reply, replies).

        ``kill = (peer, after_s)``: SIGKILL that peer's process group ``after_s`` into the round;
        the time and replies are then the survivors'. ``self.last_cpu_s``: the CPU seconds the
        peers' process trees used meanwhile (the survivors' after a kill); ``last_peer_cpu_s``:
        each live peer's (the busiest one bounds the round when every peer has its own cores)."""
        cpu0 = self._cpu_by_peer()
        t0, wall0 = time.perf_counter(), time.time()
        for i in self.alive:
            self.procs[i].send(cmd)
        if kill is not None:
            victim, after_s = kill
            time.sleep(max(0.0, after_s - (time.perf_counter() - t0)))
            self.procs[victim].kill()
            self.alive.remove(victim)
        replies = []
        for i in self.alive:
            replies.append(self._recv(i, max(1.0, timeout_s - (time.perf_counter() - t0))))
        seconds = time.perf_counter() - t0
        self.last_wall = (wall0, time.time())
        cpu1 = self._cpu_by_peer()
        self.last_peer_cpu_s = [cpu1[i] - cpu0[i] for i in self.alive]
        self.last_cpu_s = sum(self.last_peer_cpu_s) if kill is None else sum(cpu1.values())
        return seconds, replies

    def _cpu_by_peer(self) -> dict[int, float]:
        """``cpu_s`` of each live peer (by index), from one pass over ``/proc``."""
        by_session = cpu_by_session({self.procs[i].proc.pid for i in self.alive})
        return {i: by_session[self.procs[i].proc.pid] for i in self.alive}

    def close(self) -> None:
        self._closed.set()
        for i in self.alive:
            with contextlib.suppress(Exception):
                self.procs[i].send({"cmd": "quit"})
        deadline = time.monotonic() + 30
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            proc.kill()  # whatever is left of its group (hivemind's children)
            proc.log.close()
