"""``atoll join --nproc 2`` start to exit, N times: how many runs of the island end non-zero.

    python -m bench.join_nproc --runs 6 --steps 30

Each run is ``tests/integration/test_join_nproc.py``'s swarm (a bootstrap node, a one-process
island, a two-process island under torchrun), with ``--steps`` inner steps. A run counts as
failed when the two-process island reports no result or exits non-zero (the exit code and the
tail of its log are kept in the JSON). Run it beside a CPU load to see start-up and teardown hold
under contention; the JSON printed last says the load average it ran under.
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

RECIPE = ["--model", "tiny", "--fragments", "2", "--inner-steps", "10"]


def _train(steps: int) -> list[str]:
    return [
        *("--steps", str(steps), "--corpus-max-bytes", "300000", "--eval-every", "1000000"),
        *("--threads", "1", "--serve-after-s", "0", "--listen", "127.0.0.1:0"),
    ]


def one_run(root: Path, steps: int) -> dict[str, Any]:
    """One swarm; the two-process island's exit code (or why it has none) and its time."""
    files = make_swarm(root / "swarm", name="nproc", admission="open", labs=("lab",), recipe=RECIPE)
    for peer in ("solo", "pair"):
        files.certify(peer, lab="lab")
    procs: list[Proc] = []
    t0 = time.monotonic()
    try:
        url = start_bootstrap(root, procs, timeout=120)
        args = ["join", "--initial-peers", url]
        procs.append(Proc([*args, *files.args("solo"), *_train(steps)], root / "solo.log"))
        pair = Proc([*args, "--nproc", "2", *files.args("pair"), *_train(steps)], root / "pair.log")
        procs.append(pair)
        try:
            pair.wait_event("done", 600)
            code: int | str = pair.proc.wait(timeout=120)
        except (AssertionError, TimeoutError, OSError) as exc:
            code = f"no end: {exc}"
    finally:
        for p in procs:
            p.stop()
    out: dict[str, Any] = {"exit": code, "seconds": round(time.monotonic() - t0, 1)}
    if code != 0:
        out["log_tail"] = (root / "pair.log").read_text(errors="replace")[-2000:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="join-nproc-") as tmp:
        for i in range(args.runs):
            runs.append(one_run(Path(tmp) / str(i), args.steps))
            print(f"run {i}: {runs[-1]['exit']} in {runs[-1]['seconds']} s", flush=True)
    print(
        json.dumps(
            {
                "runs": len(runs),
                "failed": sum(r["exit"] != 0 for r in runs),
                "steps": args.steps,
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "per_run": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
