"""A 2-rank island (torchrun, gloo, DDP inside) and a 1-rank island form a swarm: rank 0 speaks
for its island, and after every adoption both of its ranks hold identical parameters; tokens
count both ranks; every island ends on the same global model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.two_islands import run_two_islands

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKER = Path(__file__).with_name("multirank_worker.py")
STEPS = 60


def test_a_two_rank_island_and_a_one_rank_island_train_one_model(tmp_path: Path) -> None:
    run_two_islands(WORKER, tmp_path, STEPS)
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
