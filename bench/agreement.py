"""How each sender's work agreed with its rounds' in a local run, from the owners' event logs.

    python -m bench.agreement REPORT [--attackers 3,5]

Reads every ``agreement`` record (``protocol.diloco.agreement``: per contribution of a published
merge, the median cosine with the other senders' work) that the owners of an ``atoll local``
run logged beside its report (``REPORT``'s ``<stem>-peers/peer*-events/*.jsonl``), names each
sender by its peer index from the report, and prints the quantiles of the medians for the honest
learners and for each attacker, of each round's level, and how many of each side dissented;
JSON last. This is what the thresholds of ``AgreementConfig`` were set from (docs/security.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


def quantiles(values: list[float]) -> dict[str, float]:
    """The ``QUANTILES`` of ``values`` (nearest rank), rounded; {} when there are none."""
    ordered = sorted(values)
    if not ordered:
        return {}
    return {f"q{round(q * 100)}": round(ordered[int(q * (len(ordered) - 1))], 3) for q in QUANTILES}


def collect(report: Path, attackers: set[int]) -> dict[str, Any]:
    """The medians, levels and dissent counts of every agreement record of ``report``'s run."""
    data = json.loads(report.read_text())
    index = {p["peer_id"]: int(p["index"]) for p in data["per_peer"] if p.get("peer_id")}
    folder = report.parent / f"{report.stem}-peers"
    medians: dict[str, list[float]] = {}
    levels: list[float] = []
    dissent: dict[str, int] = {}
    judged = 0
    for log in sorted(folder.glob("peer*-events/*.jsonl")):
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") != "agreement" or rec.get("level") is None:
                continue
            judged += 1
            levels.append(float(rec["level"]))
            for peer, value in zip(rec["peers"], rec["medians"], strict=True):
                who = index.get(peer, -1)
                side = f"attacker {who}" if who in attackers else "honest"
                if value is not None:
                    medians.setdefault(side, []).append(float(value))
            for peer in rec["dissent"]:
                who = index.get(peer, -1)
                side = f"attacker {who}" if who in attackers else "honest"
                dissent[side] = dissent.get(side, 0) + 1
    return {
        "report": str(report),
        "rounds_judged": judged,
        "level": quantiles(levels),
        "medians": {side: quantiles(v) for side, v in sorted(medians.items())},
        "contributions": {side: len(v) for side, v in sorted(medians.items())},
        "dissent": dict(sorted(dissent.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("report", type=Path, help="an atoll local run's report.json")
    parser.add_argument("--attackers", default="", help="attacking peer indices, comma-separated")
    args = parser.parse_args()
    out = collect(args.report, {int(x) for x in args.attackers.split(",") if x})
    print(f"{out['rounds_judged']} rounds judged; level {out['level']}")
    for side, q in out["medians"].items():
        print(
            f"{side:12} {out['contributions'][side]:4d} contributions, "
            f"{out['dissent'].get(side, 0):3d} dissent; medians {q}"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
