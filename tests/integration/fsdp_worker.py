"""One island of the FSDP-island test: plain (1 rank) or under torchrun (2 ranks, gloo, FSDP2).

    python tests/integration/fsdp_worker.py --out DIR --name one --found
    python -m torch.distributed.run --nproc_per_node 2 tests/integration/fsdp_worker.py \
        --out DIR --name two --initial-peer URL --shard

Every rank writes ``DIR/<name>.rank<r>.json``: the final model's hash (whole tensors, gathered
from the shards), the versions held, the bytes of parameters and optimizer state the rank
holds, and, on a sharded island, those bytes for a DDP replica of the same model and optimizer
(built and stepped once on the same ranks before the swarm, then freed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from node.api import Network, Swarm, SwarmIsland, exit_without_teardown
from node.config import RunConfig
from node.diloco.sharding import held_bytes

DIM, HIDDEN = 64, 4096  # ~0.5M parameters: 2 MiB fp32, and AdamW's two moments beside them
CONFIG = RunConfig(fragments=3, inner_steps=5, codec="int8", outer_lr=1.0, outer_momentum=0.0)
BATCH = 32


def build() -> nn.Module:
    torch.manual_seed(0)  # every island, every rank: the same initial weights
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))


def full_hash(model: nn.Module) -> str:
    """The hash of the whole model (a collective on a sharded one: every shard is gathered)."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(name.encode())
        digest.update(full.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    target = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7))
    x = torch.randn(BATCH, DIM, generator=g)
    nn.functional.mse_loss(model(x), x @ target.T).backward()


def ddp_held() -> int:
    """A DDP island's bytes per rank for this model and optimizer: one real step, then freed."""
    from torch.nn.parallel import DistributedDataParallel

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step(DistributedDataParallel(model), opt, torch.Generator().manual_seed(1))
    opt.step()
    return held_bytes(model, opt)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--found", action="store_true", help="found the swarm, write its address")
    parser.add_argument("--initial-peer", default="")
    parser.add_argument("--shard", action="store_true", help="fully_shard the model (FSDP2)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    ddp = ddp_held() if args.shard else None
    model = build()
    if args.shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1000 * len(args.name) + rank)  # each rank its own data
    initial = [args.initial_peer] if args.initial_peer else []
    with SwarmIsland(
        model,
        opt,
        tokens_per_step=BATCH,
        swarm=Swarm(name="fsdp-test", config=CONFIG),
        network=Network(initial_peers=initial),
    ) as isl:
        if args.found:
            (args.out / "founder.url").write_text(isl.url)
        isl.wait_for_members(2)
        for _ in range(args.steps):
            step(model, opt, g)
            isl.tokens(BATCH)
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)  # leave the owners time to merge within the run
        held = held_bytes(model, opt)
        counted = isl.island.stats.tokens_trained if rank == 0 else None
        most_open = isl.shards.most_open if isl.shards is not None and rank == 0 else None
    result = {
        "rank": rank,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "final": full_hash(model),
        "versions": isl.versions,
        "held_bytes": held,
        "ddp_held_bytes": ddp,
        "tokens_counted": counted,
        "most_fragments_gathered": most_open,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (args.out / f"{args.name}.rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()  # rank 0 writes its file too before any rank leaves the group
        dist.destroy_process_group()
        exit_without_teardown(0)  # not through gloo's teardown in finalization (it can abort)


if __name__ == "__main__":
    main()
