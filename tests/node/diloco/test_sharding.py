"""Two ranks of an FSDP2 island (gloo, two processes, ``fully_shard``): rank 0 gathers a fragment
whole (the shards of uneven and too-short parameters included) and writes a new version back
into both ranks' shards; an Island on rank 0 adopts through it, and the other rank's shard
follows at the same sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from node.diloco.island import Island, IslandConfig
from node.diloco.ranks import IslandRanks, exit_without_teardown
from node.diloco.sharding import ShardedFragments, held_bytes, is_sharded
from tests.node.fakes import tiny_plan

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 5 and 1 rows over 2 ranks: uneven shards, and an empty one
    return nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]


def _rank(rank: int, rendezvous: str, results: mp.Queue) -> None:  # type: ignore[type-arg]
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        model = _model()
        plan = tiny_plan(model)
        fully_shard(model)
        assert is_sharded(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        shards = ShardedFragments(model, plan, optimizer)
        before = _whole(model)
        island = (
            Island(
                model, optimizer, plan, lambda _o: None, IslandConfig(inner_steps=5), shards=shards
            )
            if rank == 0
            else None
        )
        shards.settle()  # rank 0's island read every fragment for its version 0
        ranks = IslandRanks(model, optimizer, plan, island, shards=shards)
        gathered_ok = island is None or all(
            torch.equal(island.global_flat[p], torch.cat([before[n].reshape(-1) for n in f.names]))
            for p, f in enumerate(plan.fragments)
        )
        new = [
            torch.arange(f.numel, dtype=torch.float32) + 100 * p
            for p, f in enumerate(plan.fragments)
        ]
        if island is not None:
            island.adopt_final(1, 3, new[1])  # written into both ranks' shards at this sync
        ranks.sync()
        after = _whole(model)
        # a resync of fragment 0: rank 1's shard of its state is NaN, rank 0's is finite
        first = shards.params[0][0]
        optimizer.state[first] = {"buf": torch.full((1,), float("nan") if rank else 1.0)}
        if island is not None:
            island.deliver(0, 5, new[0], force=True)
            island.adopt_pending()
        ranks.sync()
        resynced = _whole(model)
        results.put(
            (
                rank,
                gathered_ok,
                torch.cat([after[n].reshape(-1) for n in plan.fragments[1].names]).tolist(),
                [torch.equal(after[n], before[n]) for n in plan.fragments[0].names],
                ranks.versions,
                shards.most_open if rank == 0 else 1,
                held_bytes(model, optimizer),
                torch.cat([resynced[n].reshape(-1) for n in plan.fragments[0].names]).tolist(),
                first in optimizer.state,
            )
        )
        ranks.close()
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()  # the results are out before the process ends
    exit_without_teardown(0)  # not through torch's and gloo's teardown: 1-2 s, and it can abort


def test_rank_0_gathers_one_fragment_and_writes_an_adoption_into_every_shard(
    tmp_path: Path,
) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, str(tmp_path / "rendezvous"), results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    got = {r[0]: r[1:] for r in (results.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    plan = tiny_plan(_model())
    for rank in (0, 1):
        gathered_ok, written, untouched, versions, most_open, held, resynced, kept = got[rank]
        assert gathered_ok  # rank 0's version 0 is the whole model, gathered from both shards
        assert written == (torch.arange(plan.fragments[1].numel) + 100.0).tolist()
        assert all(untouched)  # the other fragment was read, never written
        assert versions == [5, 3]
        assert most_open == 1
        assert resynced == torch.arange(plan.fragments[0].numel).tolist()  # overwritten
        assert kept is (rank == 0)  # each rank dropped its own non-finite state, and only that
    whole = sum(p.numel() * 4 for p in _model().parameters())
    assert (
        got[0][5] + got[1][5] == whole + 4
    )  # + rank 0's one-float state kept  # each rank holds its rows only, together the model
