"""examples/custom_model.py: the public API around a user's own nn.Module, two processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def test_two_islands_train_a_custom_model_together() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_model.py"), "--steps", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = float(re.search(r"loss at start ([\d.]+)", proc.stdout).group(1))  # type: ignore[union-attr]
    islands = re.findall(
        r"island (\d): loss ([\d.]+), global versions \[([\d, ]+)\], global model (\w+)",
        proc.stdout,
    )
    assert len(islands) == 2, proc.stdout
    for _, loss, versions, _ in islands:
        assert float(loss) < 0.3 * start
        assert min(int(v) for v in versions.split(",")) >= 3  # fragments were merged and adopted
    # both islands end holding the same global model, at the same versions
    assert islands[0][1:] == islands[1][1:], proc.stdout
    # a new member is not refused as a stranger while the owners learn of it
    assert "NotAuthorized" not in proc.stderr, proc.stderr[-3000:]
