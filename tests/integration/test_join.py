"""`atoll bootstrap` + `atoll join` processes on 127.0.0.1: peers find each other through the DHT,
train, and a late joiner syncs the global fragments and catches up with the others."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.swarms import ENV, ROOT, Proc, get_json, make_swarm, start_bootstrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

H = 20
# the schedule's length is the manifest's: no joiner passes --steps, each follows the swarm's
RECIPE = ["--model", "tiny", "--fragments", "4", "--inner-steps", str(H), "--steps", "100000"]
# stand-in steps (0.1 s of wall each, no CPU): what this test shows is discovery, state sync and
# the schedule, not the loss, and four islands training for real on 2 cores slowed every start-up.
# A round is H x 0.1 = 2 s, so the late joiner's versions can be caught equal to another's
# between two status reads on a busy box (at 0.05, 1 s rounds)
TRAIN = [
    "--compute",
    "standin=0.1",
    "--eval-every",
    "1000000",
    "--threads",
    "1",
    "--serve-after-s",
    "0",
    "--listen",
    "127.0.0.1:0",
]


def _status(url: str) -> dict[str, Any]:
    return get_json(f"{url}/v1/status")


def test_bootstrap_three_joiners_and_a_late_fourth(tmp_path: Path) -> None:
    files = make_swarm(
        tmp_path / "swarm", name="open-swarm", admission="open", labs=("lab",), recipe=RECIPE
    )
    for peer in ("j0", "j1", "j2", "late"):
        files.certify(peer, lab="lab")
    procs: list[Proc] = []
    try:
        boot_url = start_bootstrap(tmp_path, procs)

        joiners = [
            Proc(
                ["join", "--initial-peers", boot_url, *files.args(f"j{i}"), *TRAIN],
                tmp_path / f"join{i}.log",
            )
            for i in range(3)
        ]
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
        # the "a minute later", shortened to keep the suite fast: the late joiner starts
        # once every fragment has merged and every record shows a step (and its own start-up
        # takes seconds more), which is all its checks below need
        deadline = (
            time.monotonic() + 30
        )  # their records say how far they are (republished every few s)
        while (
            not all(m["step"] > 0 for m in _status(urls[0])["members"])
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)

        late = Proc(
            ["join", "--initial-peers", boot_url, *files.args("late"), *TRAIN],
            tmp_path / "late.log",
        )
        procs.append(late)
        late_url = late.wait_event("listening", 90)["url"]
        joined = late.wait_event("joined", 90)
        assert len(joined["synced"]) == 4, joined  # every fragment came from its owner
        assert min(joined["versions"]) > 0
        # it enters the learning-rate schedule where the others are, not at its warm-up
        schedule = next(e for e in late.events if e.get("event") == "schedule")
        assert schedule["learners"] == 3 and 0 < schedule["step"] <= max(
            _status(u)["step"] for u in urls
        ), schedule
        assert schedule["steps"] == 100000, schedule  # the swarm's schedule, from its manifest
        assert "100000 steps at lr 0.006 (the swarm's schedule)" in late.wait_line(
            "steps at lr", 10
        )
        first = late.wait_event("progress", 60)
        assert first["step"] > schedule["step"], (schedule, first)

        # within one H it holds the same fragment versions as the others
        t_joined, same = time.monotonic(), False
        while time.monotonic() - t_joined < 20 and not same:
            mine = _status(late_url)["versions"]
            others = [_status(u)["versions"] for u in urls]
            same = any(o == mine for o in others)
        assert same, (mine, others)

        out = subprocess.run(
            [sys.executable, "-m", "node", "status", "--peer", late_url, "--json"],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
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
        human = subprocess.run(
            [sys.executable, "-m", "node", "status", "--peer", urls[0]],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        rows = [line.split() for line in human.stdout.splitlines()]
        assert any(r[:1] == ["3"] and len(r) == 4 and r[3] in owner_urls for r in rows), (
            human.stdout
        )  # fragment 3
        assert ["MEMBER", "URL", "LAB", "ROLES", "REACHABLE", "LEARNING", "STEP"] in rows
    finally:
        for p in procs:
            p.stop()
