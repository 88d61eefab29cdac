"""A peer joining a running swarm late: on the swarm's learning-rate schedule, on its own, or not at all.

    python -m bench.late_join [--seeds 0 1 2] [--steps 1500] [--join-at 900] [--modes none,swarm,own]

    python -m bench.late_join --modes swarm --seeds 0 --model gpt2-124m --compute standin=0.5 \
        --link latency=50ms,bandwidth=100mbit --inner-steps 20 --steps 400 --join-at 40

Each run is a real swarm on 127.0.0.1 made with the command line: a bootstrap node and two
founding learners (``atoll join``, ``--steps`` each), then, once the first founder's status says
it has trained ``--join-at`` steps, a third peer joins with ``--schedule swarm`` (it starts at the
step the founders claim and warms up again) or ``--schedule own`` (its own warm-up and cosine from
step 0); ``none`` adds no one. What is compared is what the founders end with: the eval loss of
each one's global model after its last step, at equal founder tokens. Every mode of a seed runs
the same recipe (the seed is the manifest's), one run at a time. Prints a line per run and, last,
JSON: every run, and per mode the mean over seeds and founders.

Every run with a joiner also times it (``joiner``): seconds from launching it to its first inner
step and to its first accepted contribution, against ``1.2 × state bytes / link rate + 10 s``
(the model's fp32 bytes over ``--link``'s bandwidth; no bound without one). With ``--compute
standin=...`` (models this box cannot train) no loss is measured and only the timing is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cli_swarm import Proc, get_json, make_swarm, start_bootstrap
from node.wire.link import LinkProfile

MODES = ("none", "swarm", "own")


def run(mode: str, seed: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One swarm: two founders, and a late joiner on ``mode``'s schedule (none: no joiner)."""
    files = make_swarm(
        folder,
        name="late-join",
        admission="open",
        labs=("lab",),
        recipe=[
            "--model",
            args.model,
            "--fragments",
            str(args.fragments),
            "--inner-steps",
            str(args.inner_steps),
            "--seed",
            str(seed),
        ],
    )
    train = [
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.steps),
        "--threads",
        "1",
        "--serve-after-s",
        "30",
        "--listen",
        "127.0.0.1:0",
        "--compute",
        args.compute,
        *(["--link", args.link] if args.link else []),
    ]
    for name in ("f0", "f1", "late"):
        files.certify(name, lab="lab")
    peers: list[Proc] = []
    try:
        boot_url = start_bootstrap(folder, peers)
        founders = [
            Proc(
                ["join", "--initial-peers", boot_url, *files.args(f"f{i}"), *train],
                folder / f"f{i}.log",
            )
            for i in range(2)
        ]
        peers += founders
        first_url = founders[0].wait_event("listening", 120)["url"]
        late = None
        if mode != "none":
            while get_json(f"{first_url}/v1/status")["step"] < args.join_at:
                if founders[0].proc.poll() is not None:
                    raise RuntimeError(
                        f"founder 0 exited before step {args.join_at}: see {folder / 'f0.log'}"
                    )
                time.sleep(0.5)
            late = Proc(
                [
                    "join",
                    "--initial-peers",
                    boot_url,
                    *files.args("late"),
                    *train,
                    "--schedule",
                    mode,
                ],
                folder / "late.log",
            )
            peers.append(late)
            timing = time_joiner(late, args, launched=time.monotonic())
        ends = [f.wait_event("done", args.timeout)["result"]["eval_loss_end"] for f in founders]
        entered = next(
            (e["step"] for e in (late.events if late else []) if e.get("event") == "schedule"), 0
        )
    finally:
        for p in peers:
            p.stop()
    measured = all(x is not None for x in ends)  # None: stand-in compute measures no loss
    return {
        "mode": mode,
        "seed": seed,
        "founders_eval_loss_end": [round(x, 4) for x in ends] if measured else None,
        "mean": round(statistics.fmean(ends), 4) if measured else None,
        "joiner_started_at_step": entered if late else None,
        "joiner": timing if late else None,
    }


def time_joiner(late: Proc, args: argparse.Namespace, *, launched: float) -> dict[str, Any]:
    """Seconds from ``launched`` to the joiner's first inner step (its first progress event,
    said within a second of a step) and first accepted contribution (its status board), and
    the bound they are held to."""
    url = late.wait_event("listening", 300)["url"]
    first_step = first_accepted = None
    last_error: OSError | None = None
    deadline = launched + args.timeout
    while first_accepted is None and time.monotonic() < deadline:
        if late.proc.poll() is not None:
            late.log.flush()
            tail = Path(late.log.name).read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(
                f"the late joiner exited ({late.proc.returncode}) before its first accepted "
                f"contribution (last status error: {last_error!r}); its log ends:\n"
                + "\n".join(tail)
            )
        try:
            status = get_json(f"{url}/v1/status/board")  # the board carries the totals
        except OSError as exc:  # not serving its status yet (or busy): ask again
            status, last_error = {}, exc
        now = time.monotonic() - launched
        if first_step is None and any(e.get("event") == "progress" for e in late.events):
            first_step = now
        if _accepted(status) >= 1:
            first_accepted = now
        time.sleep(0.25)
    state_bytes = 4 * n_params(args.model)  # every fragment's fp32 state, synced at join
    rate = LinkProfile.parse(args.link).bandwidth_bps / 8 if args.link else 0.0
    bound = 1.2 * state_bytes / rate + 10 if rate else None
    return {
        "state_bytes": state_bytes,
        "link": args.link,
        "training_after_s": None if first_step is None else round(first_step, 1),
        "first_accepted_after_s": None if first_accepted is None else round(first_accepted, 1),
        "bound_s": None if bound is None else round(bound, 1),
        "within_bound": None if bound is None or first_step is None else first_step <= bound,
    }


def n_params(model: str) -> int:
    """The preset's parameter count (built on the meta device: no memory)."""
    import torch

    from node.workload.model import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig.preset(model)).num_params()


def _accepted(status: dict[str, Any]) -> int:
    """The contributions of this peer's island that owners accepted (the board's
    ``totals.island``; ``/v1/status`` has no totals)."""
    island = status.get("totals", {}).get("island", {})
    return int(island.get("contributions", {}).get("accepted", 0))


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per mode, the mean over every run's founders."""
    by_mode: dict[str, list[float]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).extend(r["founders_eval_loss_end"] or [])
    return {mode: round(statistics.fmean(losses), 4) for mode, losses in by_mode.items() if losses}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--steps", type=int, default=1500, help="inner steps of every peer's schedule"
    )
    parser.add_argument(
        "--join-at", type=int, default=900, help="the late peer joins once founder 0 is this far"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"a comma list of {', '.join(MODES)}"
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    parser.add_argument(
        "--compute", default="real", help="every peer's --compute (standin=S: no loss measured)"
    )
    parser.add_argument("--link", default="", help="every peer's emulated --link")
    parser.add_argument("--logs", default="", help="keep every peer's log in this folder")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown mode(s) {', '.join(unknown)}: use {', '.join(MODES)}")
    if not 0 < args.join_at < args.steps:
        parser.error(f"--join-at must be between 0 and --steps ({args.steps}), got {args.join_at}")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.logs or scratch
        for seed in args.seeds:
            for mode in modes:
                runs.append(run(mode, seed, args, Path(tmp) / f"{mode}-{seed}"))
                print(
                    f"[late_join] seed {seed} {mode:5s}: founders end at {runs[-1]['founders_eval_loss_end']}"
                    + (
                        f", joiner from step {runs[-1]['joiner_started_at_step']}"
                        if mode != "none"
                        else ""
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    print(
        json.dumps(
            {
                "bench": "late_join",
                "steps": args.steps,
                "join_at": args.join_at,
                "model": args.model,
                "inner_steps": args.inner_steps,
                "runs": runs,
                "mean_by_mode": summary(runs),
            }
        )
    )


if __name__ == "__main__":
    main()
