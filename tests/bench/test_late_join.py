"""bench.late_join's arithmetic and its refusals (the runs themselves are the bench's)."""

from __future__ import annotations

import subprocess
import sys

from bench.late_join import summary


def test_the_summary_is_the_mean_over_every_founder_of_every_seed_per_mode() -> None:
    runs = [
        {"mode": "swarm", "founders_eval_loss_end": [1.0, 2.0]},
        {"mode": "swarm", "founders_eval_loss_end": [3.0, 4.0]},
        {"mode": "own", "founders_eval_loss_end": [5.0, 7.0]},
    ]
    assert summary(runs) == {"swarm": 2.5, "own": 6.0}


def test_a_join_point_outside_the_run_or_an_unknown_mode_is_refused_before_any_swarm_starts() -> (
    None
):
    for args in (["--join-at", "2000"], ["--modes", "swarm,late"]):
        out = subprocess.run(
            [sys.executable, "-m", "bench.late_join", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and (
            "--join-at" in out.stderr or "unknown mode" in out.stderr
        ), out.stderr
