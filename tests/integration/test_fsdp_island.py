"""A 2-rank FSDP island (torchrun, gloo, ``fully_shard``) and a 1-rank island form a swarm on
127.0.0.1: rank 0 gathers one fragment at a time, adoptions land in both ranks' shards, both
islands end on one model, and each FSDP rank holds fewer bytes of parameters and optimizer state
than a DDP rank of the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.two_islands import run_two_islands

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKER = Path(__file__).with_name("fsdp_worker.py")
STEPS = 40


def test_an_fsdp_island_and_a_one_rank_island_train_one_model(tmp_path: Path) -> None:
    run_two_islands(WORKER, tmp_path, STEPS, "--shard")
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
