"""The GPU path end to end: a 2-peer swarm on one GPU for two minutes, JSON printed last.

Both peers train on ``cuda:0`` (the same device, as two islands of one machine would) with the
island's pseudo-gradients, their int8 quantisation and the adoption of versions on the device
(docs/gpu.md). The corpus is the Python standard library: nothing is downloaded. Every peer
alternates blocks of ``--block`` inner steps alone (detached: no adoption, no shipping) and in
the swarm, in the same processes, so ``overlap`` is measured, not assumed.

Per peer: inner steps per second in the swarm (1 / median step), stalled steps, ``overlap``
(the median step alone ÷ the median step in the swarm: the share of an in-swarm step that is
training; 1.0 when the network's work is entirely hidden behind it), the peak device memory
(``torch.cuda.max_memory_allocated``), and the final parameter hash; ``hashes_agree``: every
peer ended on one model.

    python -m bench.gpu_check                          # cuda, 120 s; < 5 min end to end on an H100
    python -m bench.gpu_check --device cpu --seconds 20 --model tiny   # dry run of this script

Without CUDA, ``--device cuda`` exits at once with code 2 and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NO_CUDA_EXIT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run)")
    p.add_argument(
        "--seconds",
        type=float,
        default=120.0,
        help="training time of the swarm, from the moment both peers have joined",
    )
    p.add_argument(
        "--model", default="auto", help="a GPT preset; auto: gpt2-124m if known, else medium"
    )
    p.add_argument("--batch-size", type=int, default=0, help="0: 16 on cuda, 4 on cpu")
    p.add_argument("--inner-steps", type=int, default=40, help="H")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--codec", default="int8")
    p.add_argument("--block", type=int, default=20, help="steps per alone / in-swarm block")
    return p


def cuda_problem(device: str) -> str | None:
    """Why ``device`` cannot run here (None: it can); imports torch only for a CUDA device."""
    if not device.startswith("cuda"):
        return None if device == "cpu" else f"--device {device!r}: use cuda or cpu"
    import torch

    if not torch.cuda.is_available():
        return (
            "bench.gpu_check: torch sees no CUDA device here (torch "
            f"{torch.__version__}); run it on a GPU machine, or --device cpu --seconds 20 "
            "for a dry run of the script"
        )
    return None


def _model(name: str) -> str:
    from node.workload.presets import PRESETS

    if name != "auto":
        return name
    return "gpt2-124m" if "gpt2-124m" in PRESETS else "medium"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the swarm; the JSON summary."""
    from node.config import RunConfig
    from node.run.local import ENDLESS_STEPS, LaunchPlan, LocalSwarm

    cuda = args.device.startswith("cuda")
    cfg = RunConfig(
        peers=2,
        steps=ENDLESS_STEPS,
        model=_model(args.model),
        device=args.device,
        batch_size=args.batch_size or (16 if cuda else 4),
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        codec=args.codec,
        overlap_block=args.block,
        eval_every=10**9,
        eval_batches=2,
        threads=2 if cuda else 1,
        corpus_max_bytes=8_000_000,
    )
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        swarm = LocalSwarm(cfg, Path(tmp), LaunchPlan(duration_s=args.seconds), quiet=True)
        results = asyncio.run(swarm.run())
    return summary(cfg, args.seconds, results, time.monotonic() - t0)


def summary(
    cfg: Any, seconds: float, results: list[dict[str, Any]], wall_s: float
) -> dict[str, Any]:
    """The benchmark's JSON from the peers' results (``PeerResult.as_dict``)."""
    per_peer = []
    for r in sorted(results, key=lambda r: r["index"]):
        on, alone = r["median_step_s"], r["median_step_s_detached"]
        per_peer.append(
            {
                "index": r["index"],
                "steps": r["steps"],
                "steps_per_s": round(1.0 / on, 3) if on else None,
                "steps_per_s_alone": round(1.0 / alone, 3) if alone else None,
                "stalled_steps": r["stalled_steps"],
                "overlap": round(alone / on, 3) if on and alone else None,
                "device_peak_mb": round(float(r.get("device_peak_mb", 0.0)), 1),
                "contributions_accepted": r["contributions_accepted"],
                "versions": r["global_versions"],
                "final_param_hash": r["final_param_hash"][:16],
            }
        )
    hashes = {r["final_param_hash"] for r in results}
    return {
        "benchmark": "gpu_check",
        "config": {
            "device": cfg.device,
            "model": cfg.model,
            "n_params": results[0]["n_params"] if results else None,
            "batch_size": cfg.batch_size,
            "inner_steps": cfg.inner_steps,
            "fragments": cfg.fragments,
            "codec": cfg.codec,
            "block": cfg.overlap_block,
            "seconds": seconds,
        },
        "per_peer": per_peer,
        "stalled_steps": sum(p["stalled_steps"] for p in per_peer),
        "overlap_min": min((p["overlap"] for p in per_peer if p["overlap"]), default=None),
        "median_steps_per_s": statistics.median(
            [p["steps_per_s"] for p in per_peer if p["steps_per_s"]] or [0.0]
        ),
        "hashes_agree": len(results) == cfg.peers and len(hashes) == 1,
        "wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = cuda_problem(args.device)
    if problem is not None:
        print(problem, file=sys.stderr)
        return NO_CUDA_EXIT
    out = run(args)
    print(json.dumps(out, indent=2))
    return 0 if out["hashes_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
