"""Memory per rank of a two-process island, DDP against FSDP, each beside a one-process island.

    python -m bench.island_memory --model medium --block-size 32 --batch-size 2 --steps 20

For each of ``--shards`` (default ``ddp fsdp``) one swarm, as ``tests/integration/test_join_fsdp.py``
runs it: a bootstrap node, a one-process island and ``atoll join --nproc 2 --shard S``, both
with ``--final-sync``. Each island's "done" event says, per rank, the bytes of parameters and
AdamW state it holds and its peak RSS (``ranks``); the JSON printed last holds them in MB, each
FSDP rank's ratio to the DDP rank of the same rank, whether both islands ended on one model,
and the load average it ran under.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cli_swarm import Proc, make_swarm, start_bootstrap

MB = 1 << 20


def _per_rank(result: dict[str, Any]) -> list[dict[str, float]]:
    return [
        {
            "held_mb": round(r["held_bytes"] / MB, 1),
            "peak_rss_mb": round(r["max_rss_bytes"] / MB, 1),
        }
        for r in result["ranks"]
    ]


def one_swarm(root: Path, shard: str, recipe: list[str], steps: int) -> dict[str, Any]:
    """A bootstrap, a one-process island and a two-process ``--shard`` island; their results."""
    files = make_swarm(
        root / "swarm", name=f"mem-{shard}", admission="open", labs=("lab",), recipe=recipe
    )
    for peer in ("solo", "pair"):
        files.certify(peer, lab="lab")
    train = [
        *("--steps", str(steps), "--corpus-max-bytes", "300000", "--eval-every", "1000000"),
        *("--eval-batches", "2", "--threads", "1", "--validate-windows", "0", "--final-sync"),
        *("--listen", "127.0.0.1:0", "--wait-members", "2"),
    ]
    procs: list[Proc] = []
    t0 = time.monotonic()
    try:
        url = start_bootstrap(root, procs, timeout=120)
        join = ["join", "--initial-peers", url]
        solo = Proc(
            [*join, *files.args("solo"), *train, "--serve-after-s", "120"], root / "solo.log"
        )
        pair = Proc(
            [*join, "--nproc", "2", "--shard", shard, *files.args("pair"), *train]
            + ["--serve-after-s", "5"],
            root / "pair.log",
        )
        procs += [solo, pair]
        two = pair.wait_event("done", 1200)["result"]
        one = solo.wait_event("done", 300)["result"]
    finally:
        for p in procs:
            p.stop()
    return {
        "two_process_ranks": _per_rank(two),
        "one_process": _per_rank(one)[0],
        "one_model": two["final_param_hash"] == one["final_param_hash"],
        "most_fragments_gathered": two["most_fragments_gathered"],
        "n_params": two["n_params"],
        "seconds": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shards", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    args = parser.parse_args()
    recipe = ["--model", args.model, "--block-size", str(args.block_size)]
    recipe += ["--batch-size", str(args.batch_size), "--fragments", "2", "--inner-steps", "5"]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="island-memory-") as tmp:
        for shard in args.shards:
            runs[shard] = one_swarm(Path(tmp) / shard, shard, recipe, args.steps)
            print(f"{shard}: {runs[shard]}", flush=True)
    out: dict[str, Any] = {"model": args.model, "recipe": recipe, "steps": args.steps, **runs}
    if "ddp" in runs and "fsdp" in runs:
        pairs = zip(
            runs["fsdp"]["two_process_ranks"], runs["ddp"]["two_process_ranks"], strict=True
        )
        out["fsdp_over_ddp"] = [
            {k: round(f[k] / d[k], 3) for k in ("held_mb", "peak_rss_mb")} for f, d in pairs
        ]
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
