"""One island of the multi-process-island test: plain (1 rank) or under torchrun (N ranks, gloo, DDP).

    python tests/integration/multirank_worker.py --out DIR --name one --found
    python -m torch.distributed.run --nproc_per_node 2 tests/integration/multirank_worker.py \
        --out DIR --name two --initial-peer URL

Every rank writes ``DIR/<name>.rank<r>.json``: after each inner step the versions it holds and
a hash of its parameters, and at the end the final model's hash.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from node.api import Network, Swarm, SwarmIsland, exit_without_teardown
from node.config import RunConfig

DIM = 16
CONFIG = RunConfig(fragments=2, inner_steps=5, codec="int8", outer_lr=1.0, outer_momentum=0.0)


def params_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument(
        "--found", action="store_true", help="found the swarm and write its address"
    )
    parser.add_argument("--initial-peer", default="")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # every island, every rank: the same initial weights
    model = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, DIM))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    wrapped: nn.Module = DistributedDataParallel(model) if dist.is_initialized() else model
    g = torch.Generator().manual_seed(1000 * len(args.name) + rank)  # each rank its own data
    target = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7))
    steps: list[dict[str, object]] = []
    initial = [args.initial_peer] if args.initial_peer else []
    with SwarmIsland(
        wrapped,
        opt,
        tokens_per_step=32,
        swarm=Swarm(name="multirank-test", config=CONFIG),
        network=Network(initial_peers=initial),
    ) as isl:
        if args.found:
            (args.out / "founder.url").write_text(isl.url)
        isl.wait_for_members(2)
        for _ in range(args.steps):
            x = torch.randn(32, DIM, generator=g)
            loss = nn.functional.mse_loss(wrapped(x), x @ target.T)
            loss.backward()
            isl.tokens(32)
            opt.step()
            opt.zero_grad()
            steps.append({"versions": isl.versions, "hash": params_hash(model)})
            time.sleep(0.01)  # leave the owners time to merge within the run
        counted = isl.island.stats.tokens_trained if rank == 0 else None
    (args.out / f"{args.name}.rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": dist.get_world_size() if dist.is_initialized() else 1,
                "steps": steps,
                "final": params_hash(model),
                "versions": isl.versions,
                "tokens_counted": counted,
            }
        )
    )
    if dist.is_initialized():
        dist.barrier()  # rank 0 writes its file too before any rank leaves the group
        dist.destroy_process_group()
        exit_without_teardown(0)  # not through gloo's teardown in finalization (it can abort)


if __name__ == "__main__":
    main()
