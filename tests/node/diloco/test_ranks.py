"""Two ranks of one island (gloo, two processes): rank 0's place on the learning-rate schedule
reaches the other rank, so both take the same steps at the same rates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from node.diloco.inner import lr_at
from node.diloco.island import Island, IslandConfig
from node.diloco.ranks import IslandRanks, exit_without_teardown
from node.workload.baseline import TrainConfig
from tests.node.fakes import tiny_model, tiny_plan

pytestmark = pytest.mark.timeout(120)

SCHEDULE = TrainConfig(steps=100, lr=1e-2, warmup_steps=10)


def _rank(rank: int, rendezvous: str, results: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    # a file rendezvous: a TCP one on a port picked and released first could lose that port to
    # any other test's listener in between (a one-off failure seen in a full-suite run)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        plan = tiny_plan(model)
        island = (
            Island(model, optimizer, plan, lambda _out: None, IslandConfig(inner_steps=5))
            if rank == 0
            else None
        )
        ranks = IslandRanks(model, optimizer, plan, island)
        ranks.sync()
        start = ranks.start_step(
            63 if rank == 0 else 0
        )  # rank 0 joined the swarm's schedule at step 63
        results.put(
            (rank, start, [lr_at(s, SCHEDULE, rewarm_from=start) for s in range(start, start + 3)])
        )
        ranks.close()
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()  # the results are out before the process ends
    exit_without_teardown(0)  # not through torch's and gloo's teardown: 1-2 s, and it can abort


def test_every_rank_starts_where_rank_0_joined_the_schedule(tmp_path: Path) -> None:
    rendezvous = str(tmp_path / "rendezvous")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, rendezvous, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(
        (rank, (start, rates)) for rank, start, rates in (results.get(timeout=90) for _ in procs)
    )
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got[0] == got[1] and got[1][0] == 63
    assert got[1][1][0] == lr_at(63, SCHEDULE) / SCHEDULE.warmup_steps  # warmed up again from there
