"""``atoll local --compute standin=...``: the real swarm around stand-in steps, and a report
that measures no loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_standin_swarm_ends_on_one_model_and_reports_no_loss(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "node",
            "local",
            "--quiet",
            "--report",
            str(report_path),
            "--peers",
            "3",
            "--model",
            "tiny",
            "--compute",
            "standin=0.02",
            "--steps",
            "80",
            "--inner-steps",
            "10",
            "--fragments",
            "4",
        ],  # fmt: skip
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["hashes_agree"] and len(set(report["final_param_hash"].values())) == 1
    assert report["eval_loss"] is None and report["eval_loss_drop"] is None
    assert report["compute"]["kind"] == "standin" and not report["compute"]["loss_measured"]
    assert report["compute"]["step_s"] == 0.02
    assert report["eval_curve_global"] == []
    assert all(p["eval_curve_local"] == [] for p in report["per_peer"])
    # the parameters moved and the swarm merged them: versions past 0, contributions accepted
    assert min(report["global_versions"]) >= 2
    assert report["contributions"]["accepted"] >= 3 * 4
    assert report["merges"]["max_per_version_s"] is not None
    assert report["bytes_per_step"] > 0 and report["model_fp32_mb"] == pytest.approx(0.3, abs=0.05)
    assert "loss not measured: stand-in compute" in proc.stdout
