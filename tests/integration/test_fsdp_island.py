"""A 2-rank FSDP island (torchrun, gloo, ``fully_shard``) and a 1-rank island form a swarm on
127.0.0.1: rank 0 gathers one fragment at a time, adoptions land in both ranks' shards, both
islands end on one model, and each FSDP rank holds fewer bytes of parameters and optimizer state
than a DDP rank of the same model."""

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
WORKER = Path(__file__).with_name("fsdp_worker.py")
STEPS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_islands(tmp_path: Path) -> None:
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
                "--shard",
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


def test_an_fsdp_island_and_a_one_rank_island_train_one_model(tmp_path: Path) -> None:
    _run_islands(tmp_path)
    r0, r1, solo = (
        json.loads((tmp_path / f).read_text())
        for f in ("two.rank0.json", "two.rank1.json", "one.rank0.json")
    )
    assert r0["world"] == r1["world"] == 2 and solo["world"] == 1
    # one final model: the shards gathered on either rank are the one-rank island's parameters
    assert r0["final"] == r1["final"] == solo["final"]
    assert r0["versions"] == r1["versions"] == solo["versions"] and min(r0["versions"]) >= 2
    assert r0["tokens_counted"] == 2 * 32 * STEPS  # both ranks' tokens
    assert r0["most_fragments_gathered"] == 1  # rank 0 never held two fragments whole at once
    # each rank holds half the parameters and AdamW moments a DDP rank holds (+ uneven rows)
    for r in (r0, r1):
        assert r["held_bytes"] < 0.55 * r["ddp_held_bytes"], r
    assert solo["held_bytes"] == r0["ddp_held_bytes"]  # a whole replica, as under DDP
    print(json.dumps({"fsdp_rank": [r0, r1], "solo": solo}))
