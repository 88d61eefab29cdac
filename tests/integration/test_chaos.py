"""``atoll local --duration --chaos``: peers are SIGKILLed and restarted on a schedule, and the swarm
still ends on one global model, with every peer (restarted ones included) reporting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]  # hang guards

ROOT = Path(__file__).resolve().parents[2]
CHAOS = "kill=owner@10s+restart10s,kill=learner@every14s+restart10s"


def test_killed_and_restarted_peers_rejoin_and_the_swarm_agrees(tmp_path: Path) -> None:
    # 28 s of training, counted from the launcher's start (start-up is not part of it, so a busy
    # box cannot squeeze the schedule): the owner killed at 10 s restarts at 20 s, the learner
    # killed at 14 s restarts at 24 s and rejoins ~20 merges behind the swarm. Its version fence
    # used to count from the restart, refused the swarm's versions as impossible jumps, spent its
    # one fallback on them and hung the run. With start-up on a busy box the returning peers come
    # back about when the others end: the owner used to take its fragment back, ignore the final
    # the peer that stood in had handed out, merge its late work and end the swarm on two models
    args = [
        sys.executable,
        "-m",
        "node",
        "local",
        "--quiet",
        "--report",
        str(tmp_path / "report.json"),
        "--model",
        "tiny",
        "--peers",
        "4",
        "--fragments",
        "2",
        "--inner-steps",
        "10",
        "--corpus-max-bytes",
        "300000",
        "--duration",
        "28",
        "--chaos",
        CHAOS,
    ]
    proc = subprocess.run(
        args,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    # every peer reports, the restarted ones as their later incarnation, and all agree
    assert report["peers"] == 4 and sorted(report["final_param_hash"]) == ["0", "1", "2", "3"]
    assert report["hashes_agree"], report["final_param_hash"]
    assert report["version_conflicts"] == 0, report["version_conflict_list"]
    # both kills happened (fragments=2: at most two of the four peers own, so a learner is there
    # to kill at 14 s) and both peers came back
    assert report["chaos"] == CHAOS
    restarts = report["restarts"]
    assert len(restarts) == 2 and "owner" in report["chaos_events"][0], report["chaos_events"]
    assert all(
        r["restarted_at_s"] - r["killed_at_s"] == pytest.approx(10, abs=1.0) for r in restarts
    ), restarts
    per_peer = {p["index"]: p for p in report["per_peer"]}
    killed = {r["peer"] for r in restarts}
    assert all(per_peer[i]["incarnation"] >= 1 for i in killed)
    assert report["spawned"] == {"forked": 6, "exec": 0}  # the restarts forked as the first four
    assert any(per_peer[i]["resumed_from_step"] > 0 for i in killed), (
        per_peer
    )  # from its checkpoint
    # the survivors never waited on the swarm. A step counts as stalled when its hook spent over
    # 50 ms with the network side (node.diloco.island); on a 2-core machine a restarting peer
    # (importing torch, evaluating) takes the CPUs for seconds, and in some runs a survivor had
    # one such step (a 120 s run without chaos had 3 in all): one is scheduling, more a stall
    assert all(per_peer[i]["stalled_steps"] <= 1 for i in set(per_peer) - killed), per_peer
    # the global model learned
    assert report["eval_loss_drop"] > 0.25, report["eval_loss"]
    assert 0 < report["goodput"] <= 1 and 0 < report["uptime"] <= 1
    assert "uptime" in proc.stdout and "2 kills, 2 restarts" in proc.stdout
    # the killed owner's fragments moved to its replica, which had its state, momentum included
    logs = "".join(p.read_text() for p in (tmp_path / "report-peers").glob("peer*.log"))
    assert "with its momentum" in logs
    # the owners' event logs replay to every decision and every version's content
    from node.diloco.eventlog import replay

    assert report["event_logs"]
    results = [replay(Path(p)) for p in report["event_logs"]]
    assert [m for r in results for m in r.mismatches] == []
    assert sum(r.contents_checked for r in results) == sum(len(r.versions) for r in results) > 25
    # no wall-clock bound (it was < 120 s): a busy box stretches start-up and wind-down past any
    # fixed figure; a run that does not end still fails at the subprocess timeout above
