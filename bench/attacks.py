"""Malicious members in a local swarm, each attack in turn, alone and colluding, against a clean run.

    python -m bench.attacks [--peers 8] [--model tiny] [--steps 200] [--attacker 3] [--colluders 3,5]
                            [--kinds scale=1000,random,...] [--worst-seeds 3] [--validate-windows 16]

Runs ``atoll local`` once clean and, per attack kind, once with one attacker (``--attack 3:KIND``)
and once with colluding attackers (``--attack 3:KIND --attack 5:KIND``: 2 of 8 peers, a quarter
of the swarm), all with the same config (equal tokens). Then the kind that hurt most is run again
with ``--worst-seeds`` - 1 more seeds, each beside a clean run of the same seed. Prints a table
and, last, JSON: per run the global model's final eval loss and its ratio to the clean run's of
the same seed, what the owners did to the attackers' contributions (the report's ``penalties``:
clipped, hurt, refused_...), the attackers' standing against the honest learners' (the lowest
score any owner holds for each key at the end, ``protocol.diloco.standing``), how often honest
work was dropped as hurtful (``honest_hurt``: validation's false positives), how often each
side's work dissented from its round (``attacker_dissent``, ``honest_dissent``:
``protocol.diloco.agreement``), what ``atoll replay`` recomputed from the owners' event logs and
its mismatches (``replay``: must be 0), and what validated publication checked and cost. The clean run is measured in the same invocation, so the ratios
hold on a noisy machine; the swarm's own run-to-run noise is in ``clean_repeat``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from node.config import RunConfig

KINDS = "scale=1000,random=10,signflip=3,stale,lie-tokens=1000,alie,ipm,steps"


def run(
    args: argparse.Namespace,
    attackers: list[int],
    kind: str | None,
    workdir: Path,
    name: str,
    seed: int = 0,
) -> dict[str, Any]:
    report = workdir / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "node",
        "local",
        "--quiet",
        "--report",
        str(report),
        "--model",
        args.model,
        "--peers",
        str(args.peers),
        "--steps",
        str(args.steps),
        "--fragments",
        str(args.fragments),
        "--inner-steps",
        str(args.inner_steps),
        "--corpus-max-bytes",
        str(args.corpus_max_bytes),
        "--eval-every",
        str(args.steps),
        "--quorum",
        str(args.quorum),
        "--aggregate",
        args.aggregate,
        "--seed",
        str(seed),
        "--validate-windows",
        str(args.validate_windows),
    ]
    for peer in attackers if kind else []:
        cmd += ["--attack", f"{peer}:{kind}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-2000:]}")
    data = json.loads(report.read_text())
    replayed = _replayed(workdir / f"{name}-peers")
    bad = set(attackers) if kind else set()
    peers = data["per_peer"]
    honest = [
        p.get("standing") for p in peers if p["index"] not in bad and p.get("standing") is not None
    ]
    checks = [p.get("validation") or {} for p in peers]
    return {
        "run": name,
        "attack": kind or "",
        "attackers": sorted(bad),
        "seed": seed,
        "eval_loss_end": data["eval_loss"]["end"],
        "hashes_agree": data["hashes_agree"],
        "wall_s": round(data["wall_s"], 1),
        "attacker_penalties": {
            str(p["index"]): p.get("penalties", {}) for p in peers if p["index"] in bad
        },
        "attacker_standing": {
            str(p["index"]): p.get("standing") for p in peers if p["index"] in bad
        },
        "honest_standing_min": min(honest) if honest else None,
        "honest_standing_median": statistics.median(honest) if honest else None,
        # validation's false positives: honest work scored alone and dropped as hurtful
        "honest_hurt": sum(
            int(p.get("penalties", {}).get("hurt", 0)) for p in peers if p["index"] not in bad
        ),
        # how often each side's work agreed with none of its round's (protocol.diloco.agreement)
        "attacker_dissent": sum(
            int(p.get("penalties", {}).get("dissent", 0)) for p in peers if p["index"] in bad
        ),
        "honest_dissent": sum(
            int(p.get("penalties", {}).get("dissent", 0)) for p in peers if p["index"] not in bad
        ),
        "replay": replayed,
        "validation": {
            "checks": sum(c.get("checks", 0) for c in checks),
            "rejected": sum(c.get("rejected", 0) for c in checks),
            "seconds": round(sum(c.get("seconds", 0.0) for c in checks), 2),
        },
    }


def _replayed(folder: Path) -> dict[str, Any]:
    """``atoll replay`` over a run's event logs: what it recomputed, and the mismatches (must be 0)."""
    proc = subprocess.run(
        [sys.executable, "-m", "node", "replay", str(folder), "--json"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": proc.stderr[-500:]}
    return {
        "decisions": out["decisions"],
        "versions": out["versions"],
        "agreements": out.get("agreements", 0),
        "mismatches": len(out["mismatches"]),
    }


def _below_honest(row: dict[str, Any]) -> bool | None:
    """Whether every attacker's standing is below the lowest honest learner's (None: not reported)."""
    scores = [s for s in row["attacker_standing"].values() if s is not None]
    if not scores or row["honest_standing_min"] is None:
        return None
    return max(scores) < row["honest_standing_min"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--corpus-max-bytes", type=int, default=2_000_000)
    parser.add_argument("--attacker", type=int, default=3, help="the lone attacker")
    parser.add_argument(
        "--colluders", default="3,5", help="the colluding attackers (comma-separated peers)"
    )
    parser.add_argument(
        "--quorum", type=int, default=1, help="K: with K >= 3 an attacker is never alone in a merge"
    )
    parser.add_argument("--kinds", default=KINDS)
    parser.add_argument(
        "--worst-seeds",
        type=int,
        default=3,
        help="seeds the kind that hurt most is run with (beside a clean run each)",
    )
    parser.add_argument(
        "--validate-windows",
        type=int,
        default=RunConfig().validate_windows,
        help="validated publication's windows a check (0: off)",
    )
    parser.add_argument(
        "--aggregate",
        default=RunConfig().aggregate,
        help="how owners combine contributions (rda, normed or mean): see atoll local --help",
    )
    args = parser.parse_args()
    colluders = [int(x) for x in args.colluders.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        clean = {0: run(args, [], None, work, "clean")}
        rows = [clean[0]]
        for kind in args.kinds.split(","):
            name = kind.split("=")[0]
            rows.append(run(args, [args.attacker], kind, work, name))
            rows.append(run(args, colluders, kind, work, f"{name}_x{len(colluders)}"))
        for row in rows:
            row["vs_clean"] = row["eval_loss_end"] / clean[0]["eval_loss_end"]
        worst = max(rows[1:], key=lambda r: r["vs_clean"]) if len(rows) > 1 else None
        if worst is not None:
            for seed in range(1, args.worst_seeds):
                clean[seed] = run(args, [], None, work, f"clean_s{seed}", seed)
                again = run(
                    args, worst["attackers"], worst["attack"], work, f"{worst['run']}_s{seed}", seed
                )
                for row in (clean[seed], again):
                    row["vs_clean"] = row["eval_loss_end"] / clean[seed]["eval_loss_end"]
                rows += [clean[seed], again]
        repeat = run(args, [], None, work, "clean_repeat")
        repeat["vs_clean"] = repeat["eval_loss_end"] / clean[0]["eval_loss_end"]
        rows.append(repeat)
    for row in rows:
        row["attackers_below_honest"] = _below_honest(row)
    print(
        f"{'run':16} {'attack':16} {'seed':>4} {'eval loss':>9} {'vs clean':>8} {'standing':>17} "
        f"{'honest hurt':>11} {'dissent a/h':>11} {'replay':>6}  attackers' contributions"
    )
    for row in rows:
        att = [s for s in row["attacker_standing"].values() if s is not None]
        standing = (
            f"{min(att):.2f} vs {row['honest_standing_min']:.2f}"
            if att and row["honest_standing_min"] is not None
            else ""
        )
        pens = "; ".join(
            f"{i}: " + ", ".join(f"{k} {v}" for k, v in p.items())
            for i, p in row["attacker_penalties"].items()
        )
        print(
            f"{row['run']:16} {row['attack']:16} {row['seed']:4d} {row['eval_loss_end']:9.3f} "
            f"{row['vs_clean']:8.3f} {standing:>17} {row['honest_hurt']:11d} "
            f"{row['attacker_dissent']:5d}/{row['honest_dissent']:<5d} "
            f"{row['replay'].get('mismatches', '?')!s:>6}  {pens}"
        )
    print(
        json.dumps(
            {
                "peers": args.peers,
                "steps": args.steps,
                "model": args.model,
                "quorum": args.quorum,
                "aggregate": args.aggregate,
                "validate_windows": args.validate_windows,
                "attacker": args.attacker,
                "colluders": colluders,
                "worst": worst["run"] if worst is not None else None,
                "runs": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
