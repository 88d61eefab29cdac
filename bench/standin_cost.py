"""What one stand-in step (``--compute standin``) costs the CPU, against the naive stand-in.

    python -m bench.standin_cost [--model gpt2-124m] [--steps 6] [--threads 1]

Builds the preset, then times ``--steps`` updates of ``node.workload.standin.StandinOptimizer``
(two in-place passes from seeded buffers, no sleep) and, in the same process on the same model,
as many naive stand-in steps (a fresh ``randn_like`` per tensor, added in place). Prints JSON
last: the medians and their ratio. Load: the box's load average is included (shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from node.config import StandinSpec
from node.workload.model import GPT, GPTConfig
from node.workload.standin import StandinOptimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = GPT(GPTConfig.preset(args.model))
    params = list(model.parameters())
    opt = StandinOptimizer(params, StandinSpec(0.0), lr=6e-3, run_seed=0, peer_seed=1)
    naive, ours = [], []
    with torch.no_grad():
        for _ in range(args.steps):
            t = time.perf_counter()
            for p in params:
                p.add_(torch.randn_like(p), alpha=1e-4)
            naive.append(time.perf_counter() - t)
            opt.step()
            ours.append(opt.update_s[-1])
    out = {
        "model": args.model,
        "params": sum(p.numel() for p in params),
        "threads": args.threads,
        "standin_update_s": round(statistics.median(ours), 4),
        "naive_randn_s": round(statistics.median(naive), 4),
        "naive_over_standin": round(statistics.median(naive) / statistics.median(ours), 1),
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
