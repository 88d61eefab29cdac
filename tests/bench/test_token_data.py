"""bench.token_data: a tiny run prints its JSON last with every figure positive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_prints_its_json_last() -> None:
    cmd = [sys.executable, "-m", "bench.token_data", "--json", "--mbytes", "0.2"]
    cmd += ["--vocab", "300", "--shards", "4", "--seq-len", "64", "--batches", "3"]
    run = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["bench"] == "token_data" and result["config"]["shards"] == 4
    assert result["text_mb"] >= 0.2  # whole stdlib files, until 0.2 MB are in
    for key in ("tokenise_vs_encode", "reuse_vs_tokenise", "sample_vs_gather", "tokens"):
        assert result[key] > 0, key
