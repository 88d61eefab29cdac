"""Does the swarm slow an island down? Median inner-step time in the swarm over alone, one run.

Every peer of a local swarm alternates blocks of ``--block`` inner steps trained detached (no
adoption, no shipping: an island alone) and in the swarm (contributions compressed, signed and
sent, versions fetched and adopted, owners merging). Both kinds of block run in the same
processes, interleaved, under the same CPU contention from the other peers, so the ratio
isolates what the swarm costs an island. Goal: <= 1.05.

    python -m bench.overlap --json [--peers 3 --steps 600 --block 50 --model small]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from node.config import RunConfig
from node.run.local import LocalSwarm


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--model", default="small")
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    args = parser.parse_args(argv)
    cfg = RunConfig(
        peers=args.peers,
        steps=args.steps,
        model=args.model,
        overlap_block=args.block,
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        eval_every=10**9,
        corpus_max_bytes=4_000_000,
    )
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(LocalSwarm(cfg, Path(tmp), quiet=True).run())
    per_peer = []
    for r in sorted(results, key=lambda r: r["index"]):
        on, off = r["median_step_s"], r["median_step_s_detached"]
        per_peer.append(
            {
                "index": r["index"],
                "median_step_s_swarm": on,
                "median_step_s_alone": off,
                "ratio": on / off if off else None,
            }
        )
    ratios = [p["ratio"] for p in per_peer if p["ratio"]]
    out: dict[str, object] = {
        "benchmark": "overlap",
        "config": {
            "peers": args.peers,
            "steps": args.steps,
            "block": args.block,
            "model": args.model,
            "inner_steps": args.inner_steps,
            "fragments": args.fragments,
        },
        "per_peer": per_peer,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "max_ratio": max(ratios) if ratios else None,
        "goal": 1.05,
        "versions": results[0]["global_versions"] if results else None,
    }
    if not args.json:
        for p in per_peer:
            print(
                f"peer {p['index']}: swarm {1e3 * p['median_step_s_swarm']:.1f} ms/step, alone "
                f"{1e3 * p['median_step_s_alone']:.1f} ms/step, ratio {p['ratio']:.3f}",
                file=sys.stderr,
            )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
