"""``atoll join --shard fsdp``'s pieces on two gloo ranks (two processes): ``shard_model`` shards
every block and the root; after an evaluation's forward (no backward) FSDP2 leaves the root's
parameters whole, and ``reshard`` puts the shards back, so an island built then captures shards;
``full_parameters`` yields every whole parameter (the same on both ranks, the unsharded model's);
``rank_memory`` gives each rank every rank's bytes held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from node.diloco.ranks import exit_without_teardown, rank_memory
from node.diloco.sharding import full_parameters, held_bytes, is_sharded, reshard, shard_model

pytestmark = pytest.mark.timeout(120)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 3)  # the root's own parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _all_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def _rank(rank: int, rendezvous: str, results: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        net = _Net()
        shard_model(net, net.blocks)
        sharded_at_start = _all_sharded(net) and is_sharded(net)
        with torch.no_grad():
            net(torch.ones(2, 6))  # an evaluation: forward only
        whole_after_forward = not _all_sharded(net)
        reshard(net)
        sharded_again = _all_sharded(net)
        full = dict(full_parameters(net))
        optimizer = torch.optim.AdamW(net.parameters())
        memory = rank_memory(held_bytes(net, optimizer), 1000 + rank)
        results.put(
            (
                rank,
                sharded_at_start,
                whole_after_forward,
                sharded_again,
                {n: t.tolist() for n, t in full.items()},
                memory,
            )
        )
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()  # the results are out before the process ends
    exit_without_teardown(0)  # not through torch's and gloo's teardown: 1-2 s, and it can abort


def test_shard_model_reshard_full_parameters_and_rank_memory(tmp_path: Path) -> None:
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
    whole = {n: p.detach().tolist() for n, p in sorted(_Net().named_parameters())}
    for rank in (0, 1):
        sharded_at_start, whole_after_forward, sharded_again, full, memory = got[rank]
        assert sharded_at_start and sharded_again
        assert whole_after_forward  # what reshard is for: the root kept its parameters whole
        assert list(full) == sorted(whole) and full == whole  # in name order, the model's values
        assert [m["rank"] for m in memory] == [0, 1]
        assert [m["max_rss_bytes"] for m in memory] == [1000, 1001]
        # no AdamW state yet: each rank holds its rows of the parameters, together the model
        assert sum(m["held_bytes"] for m in memory) == 4 * sum(
            torch.tensor(v).numel() for v in whole.values()
        )
    assert got[0][4] == got[1][4]  # every rank has every rank's figures
