"""Peak RSS per rank of the inner steps alone, DDP against FSDP, on 2 gloo ranks: no swarm.

    python -m bench.shard_memory --model medium --block-size 32 --batch-size 2 --steps 8

For each mode, ``torchrun --nproc_per_node 2`` runs this file as a rank: the built-in GPT from
one seed, wrapped in DDP or sharded as ``atoll join --shard fsdp`` shards it
(``node.diloco.sharding.shard_model``), AdamW over it, Atoll's allocator settings
(``tune_allocator``, ``bound_for_model`` as ``build_workload`` calls them), then ``--steps`` inner
steps (``node.run.train.inner_step``) on random bytes. Each rank reports its bytes of parameters
and AdamW state held and its peak RSS after building and after the steps; the JSON printed last
holds them and each FSDP rank's ratio to the DDP rank of the same rank. What the swarm adds on
rank 0 (its node, its island's copy of the global fragments) is the same for both kinds of
island and is left out here (``bench.island_memory`` measures whole islands).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MB = 1 << 20


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rank_main(args: argparse.Namespace) -> None:
    """One rank: build, step, write ``OUT/<mode>.rank<r>.json``."""
    import torch
    import torch.distributed as dist

    from node.config import RunConfig
    from node.diloco.allocator import bound_for_model, tune_allocator
    from node.diloco.inner import make_inner_optimizer
    from node.diloco.sharding import held_bytes, shard_model
    from node.run.train import inner_step
    from node.workload.baseline import train_config_for
    from node.workload.model import GPT, GPTConfig

    tune_allocator()  # as `atoll` does at start
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = GPT(GPTConfig.preset(args.model, block_size=args.block_size), seed=0)
    bound_for_model(4 * model.num_params(), sharded=args.mode == "fsdp")
    stepper: torch.nn.Module
    if args.mode == "fsdp":
        stepper = shard_model(model, model.h)
    else:
        from torch.nn.parallel import DistributedDataParallel

        stepper = DistributedDataParallel(model)
    tcfg = train_config_for(RunConfig(model="tiny"))
    optimizer = make_inner_optimizer(model, tcfg)
    built = _peak_mb()
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randint(0, 256, (args.batch_size, args.block_size), generator=g)
        y = torch.randint(0, 256, (args.batch_size, args.block_size), generator=g)
        inner_step(stepper, optimizer, tcfg, step, x, y)
    out = {
        "held_mb": round(held_bytes(model, optimizer) / MB, 1),
        "peak_rss_built_mb": round(built, 1),
        "peak_rss_mb": round(_peak_mb(), 1),
        "n_params": model.num_params(),
    }
    (Path(args.out) / f"{args.mode}.rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mode", choices=("ddp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:
        rank_main(args)
        return
    result: dict[str, Any] = {"model": args.model, "steps": args.steps}
    same = [f"--model={args.model}", f"--block-size={args.block_size}"]
    same += [f"--batch-size={args.batch_size}", f"--steps={args.steps}"]
    with tempfile.TemporaryDirectory(prefix="shard-memory-") as tmp:
        for mode in ("ddp", "fsdp"):
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                + ["--nproc_per_node", "2", __file__, *same, f"--mode={mode}", f"--out={tmp}"],
                check=True,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            )
            result[mode] = [
                json.loads((Path(tmp) / f"{mode}.rank{r}.json").read_text()) for r in (0, 1)
            ]
    result["fsdp_over_ddp"] = [
        {k: round(f[k] / d[k], 3) for k in ("held_mb", "peak_rss_mb")}
        for f, d in zip(result["fsdp"], result["ddp"], strict=True)
    ]
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
