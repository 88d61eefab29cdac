"""A 2-rank island (torchrun, gloo, DDP inside) and a 1-rank island form a swarm: rank 0 speaks
for its island, and after every adoption both of its ranks hold identical parameters; tokens
count both ranks; every island ends on the same global model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multirank_worker.py")
STEPS = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_two_rank_island_and_a_one_rank_island_train_one_model(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    common = ["--out", str(tmp_path), "--steps", str(STEPS)]
    one = subprocess.Popen(
        [sys.executable, str(WORKER), "--name", "one", "--found", *common],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    two = None
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "founder.url").exists():
            assert one.poll() is None, one.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the 1-rank island never came up"
            time.sleep(0.2)
        url = (tmp_path / "founder.url").read_text()
        two = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(_free_port()),
                str(WORKER),
                "--name",
                "two",
                "--initial-peer",
                url,
                *common,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out_two, _ = two.communicate(timeout=200)
        assert two.returncode == 0, out_two[-3000:]
        out_one, _ = one.communicate(timeout=60)
        assert one.returncode == 0, out_one[-3000:]
    finally:
        for proc in (one, two):
            if proc is not None and proc.poll() is None:
                proc.kill()
    r0, r1, solo = (
        json.loads((tmp_path / f).read_text())
        for f in ("two.rank0.json", "two.rank1.json", "one.rank0.json")
    )
    assert r0["world"] == r1["world"] == 2 and solo["world"] == 1
    # after every step, adoptions included, both ranks hold the same versions and parameters
    assert len(r0["steps"]) == len(r1["steps"]) == STEPS
    assert r0["steps"] == r1["steps"]
    versions = [tuple(s["versions"]) for s in r0["steps"]]
    adoptions = sum(a != b for a, b in zip(versions, versions[1:], strict=False))
    assert adoptions >= 3, versions  # the island did adopt merged versions while training
    # tokens count the whole island: both ranks' 32 per step
    assert r0["tokens_counted"] == 2 * 32 * STEPS
    # and every island, every rank, ends on the swarm's one final model
    assert r0["final"] == r1["final"] == solo["final"]
    assert r0["versions"] == solo["versions"] and min(r0["versions"]) >= 2
