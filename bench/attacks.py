"""One malicious member in a local swarm, each attack in turn, against a clean run of the same swarm.

    python -m bench.attacks [--peers 8] [--steps 200] [--attacker 3] [--kinds scale=1000,random,...]

Runs ``atoll local`` once clean and once per attack (``--attack PEER:KIND``), all with the same
config (equal tokens), and prints a table and, last, JSON: per run the global model's final
eval loss, its ratio to the clean run's, and what the merge did to the attacker's contributions
(the report's per-peer ``penalties``). The clean run is measured in the same invocation, so the
ratios hold on a noisy machine; the swarm's own run-to-run noise is in ``clean_repeat``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from node.config import RunConfig

KINDS = "scale=1000,random=10,signflip=3,stale,lie-tokens=1000"


def run(args: argparse.Namespace, attack: str | None, workdir: Path, name: str) -> dict[str, Any]:
    report = workdir / f"{name}.json"
    cmd = [sys.executable, "-m", "node", "local", "--quiet", "--report", str(report),
           "--model", args.model, "--peers", str(args.peers), "--steps", str(args.steps),
           "--fragments", str(args.fragments), "--inner-steps", str(args.inner_steps),
           "--corpus-max-bytes", str(args.corpus_max_bytes), "--eval-every", str(args.steps),
           "--quorum", str(args.quorum), "--aggregate", args.aggregate]
    if attack:
        cmd += ["--attack", f"{args.attacker}:{attack}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-2000:]}")
    data = json.loads(report.read_text())
    attacker = next(p for p in data["per_peer"] if p["index"] == args.attacker)
    return {"run": name, "attack": attack or "", "eval_loss_end": data["eval_loss"]["end"],
            "hashes_agree": data["hashes_agree"], "wall_s": round(data["wall_s"], 1),
            "attacker_penalties": attacker.get("penalties", {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--corpus-max-bytes", type=int, default=2_000_000)
    parser.add_argument("--attacker", type=int, default=3)
    parser.add_argument("--quorum", type=int, default=1, help="K: with K >= 3 an attacker is never alone in a merge")
    parser.add_argument("--kinds", default=KINDS)
    parser.add_argument("--aggregate", default=RunConfig().aggregate,
                        help="how owners combine contributions (rda, normed or mean): see atoll local --help")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        clean = run(args, None, work, "clean")
        rows = [clean]
        for kind in args.kinds.split(","):
            rows.append(run(args, kind, work, kind.split("=")[0]))
        rows.append(run(args, None, work, "clean_repeat"))
    base = clean["eval_loss_end"]
    for row in rows:
        row["vs_clean"] = row["eval_loss_end"] / base
    print(f"{'run':14} {'attack':18} {'eval loss':>9} {'vs clean':>8}  attacker's contributions")
    for row in rows:
        print(f"{row['run']:14} {row['attack']:18} {row['eval_loss_end']:9.3f} {row['vs_clean']:8.3f}  "
              + ", ".join(f"{k} {v}" for k, v in row["attacker_penalties"].items()))
    print(json.dumps({"peers": args.peers, "steps": args.steps, "model": args.model, "quorum": args.quorum, "aggregate": args.aggregate,
                      "attacker": args.attacker, "runs": rows}))


if __name__ == "__main__":
    main()
