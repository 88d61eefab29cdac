"""Eval-loss quality at equal tokens: Decoupled DiLoCo vs synchronous DiLoCo vs data-parallel.

For each seed it runs ``atoll local --mode decoupled`` and ``--mode sync`` with the same
settings, and the synchronous data-parallel baseline (``node.workload.baseline``, what
``atoll local --baseline`` trains) on the same model, shards and tokens, then reports relative
eval-loss gaps ``(a - b) / b`` of the final global models. Ablations run the decoupled swarm
with one thing changed (codec, outer lr and momentum, H, fragments, peers, RDA or mean,
adoption blend) on ``--ablation-seeds``. Every run's bytes reduction against fp32 ring all-reduce
(``bandwidth_reduction_vs_ddp`` of its report) is kept too.

The data-parallel baseline trains with the islands' inner optimizer and schedule at a batch N
times larger; ``--dp-lrs`` trains it at several peak learning rates and compares against the
best of them, so the baseline is tuned at least as well as the swarm.

    python -m bench.quality [--seeds 0,1,2] [--ablations codec,outer,H] [--set outer_lr=0.7 ...]
    python -m bench.quality --quick --seeds 0 --ablations codec:int4    # a tiny model, a minute

Progress goes to stderr, every run's result is appended to ``--journal``, one JSON object is
printed last on stdout. Runs whose report already exists under ``--out`` are read back with
``--resume``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.quality_runs import Runner, Setting

__all__ = ["ABLATIONS", "QUICK", "gap", "main", "parse_ablations", "parse_set"]

# The small model at 4 peers x 600 steps x 16 x 128 bytes: 4.9 M tokens, 25.7 per parameter.
# Pinned: issue 11's runs were on the small model at 600 steps and H = 30, atoll local's defaults
# until 2026-12-03 (its model until 2026-12-05).
FULL: dict[str, Any] = {"peers": 4, "model": "small", "steps": 600, "inner_steps": 30}
QUICK: dict[str, Any] = {
    "peers": 2,
    "model": "tiny",
    "steps": 40,
    "inner_steps": 10,
    "warmup_steps": 5,
    "eval_every": 20,
    "eval_batches": 2,
    "corpus_max_bytes": 1_000_000,
}

# group -> item name -> the RunConfig fields it sets (over the main setting)
ABLATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "codec": {
        "none": {"codec": "none"},
        "int8": {"codec": "int8"},
        "int4": {"codec": "int4"},
        "topk2": {"codec": "topk2"},
    },
    "outer": {
        "lr1.0-m0": {"outer_lr": 1.0, "outer_momentum": 0.0},
        "lr0.7-m0.9": {"outer_lr": 0.7, "outer_momentum": 0.9},
        "lr0.7-m0.5": {"outer_lr": 0.7, "outer_momentum": 0.5},
        "lr1.0-m0.3": {"outer_lr": 1.0, "outer_momentum": 0.3},
        "lr1.3-m0": {"outer_lr": 1.3, "outer_momentum": 0.0},
    },
    "H": {"H15": {"inner_steps": 15}, "H30": {"inner_steps": 30}, "H60": {"inner_steps": 60}},
    "fragments": {
        "P1": {"fragments": 1},
        "P2": {"fragments": 2},
        "P4": {"fragments": 4},
        "P8": {"fragments": 8},
    },
    "download": {
        "fp32": {"download_codec": "none", "update_codec": "none"},
        "bf16": {"download_codec": "bf16", "update_codec": "none"},
        # versions as updates over the one before (--update-codec), full fp32 states beside
        "int8-update": {"update_codec": "int8"},
        "int4-update": {"update_codec": "int4"},
    },
    "peers": {"M4": {"peers": 4}, "M8": {"peers": 8}},
    # the merge's aggregation (--aggregate): radial-directional averaging, the normed or the token-weighted mean
    "aggregate": {
        "rda": {"aggregate": "rda"},
        "mean": {"aggregate": "mean"},
        "normed": {"aggregate": "normed"},
        "rda-M8": {"peers": 8, "aggregate": "rda"},
        "mean-M8": {"peers": 8, "aggregate": "mean"},
    },
    # adoption: overwrite (--adopt-rebase 0), or the blend theta <- alpha*theta + (1-alpha)*global
    # (--adopt-alpha), against the default rebase (global + the work no contribution holds yet)
    "adopt": {
        "overwrite": {"adopt_rebase": 0},
        "a0.3": {"adopt_alpha": 0.3, "adopt_rebase": 0},
        "a0.5": {"adopt_alpha": 0.5, "adopt_rebase": 0},
    },
    # each learner's data (--sharding): one slice of the corpus, or stripes spanning all of it
    "sharding": {"contiguous": {"sharding": "contiguous"}, "striped": {"sharding": "striped"}},
}


def gap(a: float, b: float) -> float:
    """Relative eval-loss gap of ``a`` over ``b``: (a - b) / b."""
    return (a - b) / b


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["outer_lr=0.7", "codec=int4"]`` -> {"outer_lr": 0.7, "codec": "int4"} (numbers parsed)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(
                f"--set wants FIELD=VALUE (a RunConfig field, e.g. outer_lr=0.7), got {item!r}"
            )
        value: Any = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        out[key.replace("-", "_")] = value
    return out


def parse_ablations(spec: str) -> list[tuple[str, str]]:
    """``"codec,outer:lr0.7-m0.9"`` -> every (group, item) to run; "" or "none" -> none."""
    if spec in ("", "none"):
        return []
    chosen: list[tuple[str, str]] = []
    for part in spec.split(","):
        group, _, item = part.partition(":")
        if group not in ABLATIONS:
            raise ValueError(f"unknown ablation group {group!r}; choose from {sorted(ABLATIONS)}")
        if item and item not in ABLATIONS[group]:
            raise ValueError(
                f"unknown {group} ablation {item!r}; choose from {sorted(ABLATIONS[group])}"
            )
        chosen += [(group, name) for name in ABLATIONS[group] if not item or name == item]
    return chosen


# -----------------------------------------------------------------------------
# the comparisons


def best_baseline(runner: Runner, setting: Setting, dp_lrs: list[float]) -> dict[str, Any]:
    """The data-parallel run with the lowest final eval loss among ``dp_lrs``, with all of them
    (up to ``runner.dp_jobs`` of them at once)."""
    cfg = setting.config()
    runs = runner.baselines(cfg, list(dict.fromkeys(dp_lrs or [cfg.lr])))
    best = min(runs, key=lambda r: r["eval_loss_end"])
    return {**best, "tried": [{"lr": r["lr"], "eval_loss_end": r["eval_loss_end"]} for r in runs]}


def compare_seed(
    runner: Runner, setting: Setting, dp_lrs: list[float], methods: tuple[str, ...]
) -> dict[str, Any]:
    """One seed of one setting: each method's run, data-parallel, and the gaps between them."""
    cfg = setting.config()
    out: dict[str, Any] = {"seed": cfg.seed}
    for method in methods:
        run_setting = Setting(setting.name, (*setting.overrides, ("mode", method)))
        out[method] = runner.local(run_setting, run_setting.config(), method)
    out["dp"] = best_baseline(runner, setting, dp_lrs)
    for method in methods:
        out[f"gap_{method}_vs_dp"] = gap(out[method]["eval_loss_end"], out["dp"]["eval_loss_end"])
    if "decoupled" in methods and "sync" in methods:
        out["gap_decoupled_vs_sync"] = gap(
            out["decoupled"]["eval_loss_end"], out["sync"]["eval_loss_end"]
        )
    return out


def mean_gaps(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean (and spread) of every ``gap_*`` field over seeds, and of every method's bytes ratio."""
    out: dict[str, Any] = {}
    for key in sorted({k for s in per_seed for k in s if k.startswith("gap_")}):
        values = [s[key] for s in per_seed if key in s]
        out[key] = {
            "mean": statistics.fmean(values),
            "min": min(values),
            "max": max(values),
            "n": len(values),
        }
    for method in ("decoupled", "sync"):
        ratios = [s[method]["bandwidth_reduction_vs_ddp"] for s in per_seed if method in s]
        if ratios and all(r is not None for r in ratios):
            out[f"bandwidth_reduction_vs_ddp_{method}"] = statistics.fmean(ratios)
    return out


def run_setting(
    runner: Runner,
    name: str,
    overrides: dict[str, Any],
    seeds: list[int],
    dp_lrs: list[float],
    methods: tuple[str, ...],
) -> dict[str, Any]:
    """Every seed of one setting and the means over seeds."""
    per_seed = []
    for seed in seeds:
        setting = Setting(name, tuple(sorted({**overrides, "seed": seed}.items())))
        per_seed.append(compare_seed(runner, setting, dp_lrs, methods))
        done = {k: round(v, 4) for k, v in per_seed[-1].items() if k.startswith("gap_")}
        print(f"[quality] {name} seed {seed}: {done}", file=sys.stderr, flush=True)
    return {"name": name, "overrides": overrides, "per_seed": per_seed, "mean": mean_gaps(per_seed)}


# -----------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 2 peers, 40 steps (for tests)")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the main comparison (default: 0,1,2)")
    p.add_argument(
        "--ablations",
        default="",
        help=f"comma-separated groups or group:item from {sorted(ABLATIONS)} (default: none)",
    )
    p.add_argument("--ablation-seeds", default="0", help="seeds of each ablation (default: 0)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a RunConfig field of the main setting (repeatable), e.g. outer_momentum=0.5",
    )
    p.add_argument("--methods", default="decoupled,sync", help="main comparison's swarm modes")
    p.add_argument(
        "--dp-lrs",
        default="",
        help="peak lrs to train data-parallel at, best kept (default: the swarm's inner lr)",
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/quality/reports"), help="reports and logs go here"
    )
    p.add_argument(
        "--journal",
        type=Path,
        default=Path("runs/quality/results.jsonl"),
        help="every run's result is appended here as a JSON line",
    )
    p.add_argument(
        "--resume", action="store_true", help="read back runs whose report already exists"
    )
    p.add_argument(
        "--dp-jobs",
        type=int,
        default=1,
        help="data-parallel baselines (one torch thread each) trained at once (default: 1)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument(
        "--retries", type=int, default=1, help="times a failed run is tried again (default: 1)"
    )
    p.add_argument(
        "--plot", type=Path, default=None, help="write the main setting's loss curves here (PNG)"
    )
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison and the ablations; print progress to stderr and the JSON last."""
    args = _parser().parse_args(argv)
    base = {**(QUICK if args.quick else FULL), **parse_set(args.set)}
    methods = tuple(m for m in args.methods.split(",") if m)
    bad = [m for m in methods if m not in ("decoupled", "sync")]
    if bad or not methods:
        raise SystemExit(f"--methods takes decoupled and/or sync, got {args.methods!r}")
    dp_lrs = [float(x) for x in args.dp_lrs.split(",") if x.strip()]
    ablations = parse_ablations(args.ablations)
    runner = Runner(
        args.out,
        resume=args.resume,
        journal=args.journal,
        timeout_s=args.timeout,
        retries=args.retries,
        dp_jobs=args.dp_jobs,
    )
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "quality",
        "quick": args.quick,
        "base": base,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    result["main"] = run_setting(runner, "main", base, _ints(args.seeds), dp_lrs, methods)
    result["ablations"] = [
        {
            "group": group,
            "item": item,
            **run_setting(
                runner,
                f"{group}:{item}",
                {**base, **ABLATIONS[group][item]},
                _ints(args.ablation_seeds),
                dp_lrs,
                ("decoupled",),
            ),
        }
        for group, item in ablations
    ]
    result["wall_s"] = time.monotonic() - t0
    if args.plot:
        from bench.quality_plot import plot_curves

        plot_curves(result["main"], args.plot)
        result["plot"] = str(args.plot)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, RuntimeError) as exc:
        print(f"bench.quality: {exc}", file=sys.stderr)
        sys.exit(2)
