"""`atoll bootstrap` + `atoll join` processes on 127.0.0.1: peers find each other through the DHT,
train, and a late joiner syncs the global fragments and catches up with the others."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
H = 20
TRAIN = ["--model", "tiny", "--steps", "100000", "--fragments", "4", "--inner-steps", str(H),
         "--corpus-max-bytes", "2000000", "--eval-every", "1000000", "--threads", "1",
         "--serve-after-s", "0", "--listen", "127.0.0.1:0"]
LATE_JOIN_S = 15.0  # the "a minute later", shortened to keep the suite fast


class Proc:
    """A child process whose stdout lines are read on a thread (JSON lines become events)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "node", *args], cwd=ROOT, env=ENV,
                                     stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL)
        self.lines: queue.Queue[str] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            self.lines.put(line)
            with contextlib.suppress(json.JSONDecodeError):
                self.events.append(json.loads(line))

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if e.get("event") == name:
                    return e
            if self.proc.poll() is not None:
                raise AssertionError(f"process exited ({self.proc.returncode}) before {name!r}")
            time.sleep(0.1)
        raise AssertionError(f"no {name!r} event within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def test_bootstrap_three_joiners_and_a_late_fourth(tmp_path: Path) -> None:
    procs: list[Proc] = []
    try:
        boot = Proc(["bootstrap", "--listen", "127.0.0.1:0"], tmp_path / "boot.log")
        procs.append(boot)
        first = boot.lines.get(timeout=60)
        assert "listening at" in first, first
        boot_url = first.rsplit(" ", 1)[-1]

        joiners = [Proc(["join", "--initial-peers", boot_url, *TRAIN], tmp_path / f"join{i}.log") for i in range(3)]
        procs += joiners
        urls = [j.wait_event("listening", 90)["url"] for j in joiners]
        for j in joiners:
            j.wait_event("joined", 90)

        # the three find each other through the DHT and train: versions advance
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            statuses = [_status(u) for u in urls]
            if all(len(s["members"]) == 3 and min(s["versions"]) > 0 for s in statuses):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the three joiners did not form a training swarm: {statuses}")
        time.sleep(LATE_JOIN_S)

        late = Proc(["join", "--initial-peers", boot_url, *TRAIN], tmp_path / "late.log")
        procs.append(late)
        late_url = late.wait_event("listening", 90)["url"]
        joined = late.wait_event("joined", 90)
        assert len(joined["synced"]) == 4, joined  # every fragment came from its owner
        assert min(joined["versions"]) > 0

        # within one H it holds the same fragment versions as the others
        t_joined, same = time.monotonic(), False
        while time.monotonic() - t_joined < 20 and not same:
            mine = _status(late_url)["versions"]
            others = [_status(u)["versions"] for u in urls]
            same = any(o == mine for o in others)
        assert same, (mine, others)

        out = subprocess.run([sys.executable, "-m", "node", "status", "--peer", late_url, "--json"],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=30, check=True)
        status = json.loads(out.stdout)
        deadline = time.monotonic() + 10
        while len(status["members"]) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
            status = _status(late_url)
        assert len(status["members"]) == 4, status["members"]
        assert all(m["reachable"] and "owner" in m["roles"] for m in status["members"])
        assert all(status["owners"][str(p)] is not None for p in range(4)), status["owners"]
        owner_urls = {o["url"] for o in status["owners"].values()}
        assert owner_urls <= {*urls, late_url}
        human = subprocess.run([sys.executable, "-m", "node", "status", "--peer", urls[0]],
                               cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=30, check=True)
        assert "fragment 3: owner" in human.stdout
    finally:
        for p in procs:
            p.stop()
