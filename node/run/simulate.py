"""``atoll simulate``: expected goodput under failures, from protocol/'s own merger on a virtual clock.

Two uses:

- ``atoll simulate --peers 40 --mtbf 6h --repair 20m --step-time 1.2s --sync-time 5s``: a
  user's swarm; prints goodput and uptime for Decoupled DiLoCo, synchronous DiLoCo, elastic and
  non-elastic data-parallel.
- ``atoll simulate --paper-table [--json] [--png PATH]``: the paper's Table 1 grid (150k ... 2.4M
  chips, M = 2 ... 16) next to the paper's numbers, with the constants and their calibration
  (``protocol.sim.paper``); ``--calibrate`` reruns the calibration searches.

The simulation is ``protocol.sim`` (sans-IO, deterministic for a seed); this module parses
arguments, prints and plots.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.sim.config import Outcome
    from protocol.sim.paper import Cell

__all__ = ["add_simulate_arguments", "parse_duration", "simulate_main"]

_UNITS = {
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "y": 365 * 86400.0,
}
DEFAULT_PNG = Path("runs/simulate/paper-table.png")
_LABELS = {
    "decoupled": "Decoupled DiLoCo",
    "sync-diloco": "synchronous DiLoCo",
    "elastic": "elastic data-parallel",
    "data-parallel": "data-parallel",
}


def parse_duration(text: str) -> float:
    """``"1.2s"``, ``"20m"``, ``"6h"``, ``"2d"``, ``"1y"``, ``"500ms"`` or plain seconds -> seconds.

    Raises ``argparse.ArgumentTypeError`` for anything else (or a negative duration).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s|min|m|h|d|y)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"bad duration {text!r}: expected e.g. 1.2s, 20m, 6h, 2d or seconds"
        )
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--paper-table",
        action="store_true",
        help="simulate the paper's Table 1 grid (150k..2.4M chips, M = 2..16) next to its numbers",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="rerun the grid searches that chose the paper-table constants (a few minutes)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the result as JSON (last line of stdout)"
    )
    p.add_argument(
        "--png",
        type=Path,
        default=None,
        help=f"where to write the paper-table plot (default {DEFAULT_PNG})",
    )
    p.add_argument(
        "--failures",
        type=int,
        default=None,
        help="expected failures per simulated cell (paper table: 2000; swarm: 400)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="random seed (runs are deterministic for a seed)"
    )
    swarm = p.add_argument_group("your swarm (each peer is a learner and fails as a unit)")
    swarm.add_argument("--peers", type=int, default=None, help="number of peers (learners)")
    swarm.add_argument(
        "--mtbf",
        type=parse_duration,
        default=None,
        help="mean time between a peer's failures, e.g. 6h",
    )
    swarm.add_argument(
        "--repair",
        type=parse_duration,
        default=parse_duration("20m"),
        help="mean time until a failed peer is back (exponentiated Weibull, see --repair-shape)",
    )
    swarm.add_argument(
        "--repair-shape", type=float, default=1.0, help="Weibull shape k of the repair time"
    )
    swarm.add_argument(
        "--repair-power", type=float, default=1.0, help="exponent a of the repair time's CDF"
    )
    swarm.add_argument(
        "--step-time", type=parse_duration, default=parse_duration("1s"), help="one inner step"
    )
    swarm.add_argument(
        "--sync-time",
        type=parse_duration,
        default=parse_duration("5s"),
        help="merge plus transfer of the model (also data-parallel's exchange per step)",
    )
    swarm.add_argument(
        "--dp-sync-time",
        type=parse_duration,
        default=None,
        help="data-parallel's non-overlapped communication per step (default: --sync-time)",
    )
    swarm.add_argument(
        "--inner-steps", type=int, default=100, help="H: inner steps between contributions"
    )
    swarm.add_argument(
        "--detect",
        type=parse_duration,
        default=parse_duration("30s"),
        help="time to notice a failure and reconfigure (the owner's and data-parallel's)",
    )
    swarm.add_argument(
        "--rejoin",
        type=parse_duration,
        default=parse_duration("60s"),
        help="a returning peer's restart: download the model and resync",
    )
    swarm.add_argument(
        "--horizon",
        type=parse_duration,
        default=None,
        help="simulated time (default: about --failures peer failures, at least 50 intervals)",
    )
    swarm.add_argument("--quorum", type=int, default=1, help="K: the merger's minimum quorum")
    swarm.add_argument(
        "--late-policy",
        choices=("carry", "drop"),
        default="carry",
        help="late contributions: carried into the next merge, or refused (resync)",
    )
    swarm.add_argument(
        "--staleness-bound", type=int, default=2, help="S: oldest base version accepted"
    )


def simulate_main(args: argparse.Namespace) -> int:
    # protocol.sim imports torch: imported here, not when the CLI builds its parser
    from protocol.errors import LocalProtocolError

    try:
        if args.calibrate:
            return _calibrate()
        if args.paper_table:
            return _paper_table(args)
        if args.peers is None or args.mtbf is None:
            print(
                "atoll simulate: give --paper-table, or your swarm's --peers and --mtbf "
                "(e.g. --peers 40 --mtbf 6h --repair 20m --step-time 1.2s)",
                file=sys.stderr,
            )
            return 2
        return _swarm(args)
    except LocalProtocolError as exc:
        print(f"atoll simulate: {exc}", file=sys.stderr)
        return 2


# -- your swarm ----------------------------------------------------------------------------------


def _swarm(args: argparse.Namespace) -> int:
    from protocol.diloco.merge import MergeConfig
    from protocol.sim.swarm import Swarm, compare, swarm_config

    swarm = Swarm(
        peers=args.peers,
        mtbf_s=args.mtbf,
        repair_s=args.repair,
        step_s=args.step_time,
        sync_s=args.sync_time,
        inner_steps=args.inner_steps,
        repair_shape=args.repair_shape,
        repair_power=args.repair_power,
        reconfig_s=args.detect,
        restart_s=args.rejoin,
        dp_sync_s=args.dp_sync_time,
        horizon_s=args.horizon,
        failures=args.failures or 400,
        seed=args.seed,
    )
    merge = MergeConfig(
        quorum=args.quorum, late_policy=args.late_policy, staleness_bound=args.staleness_bound
    )
    cfg = swarm_config(swarm, merge)
    started = time.perf_counter()
    outcomes = compare(cfg)
    seconds = time.perf_counter() - started
    print(
        f"{swarm.peers} peers, MTBF {_human(swarm.mtbf_s)}, repair {_human(swarm.repair_s)}, step "
        f"{_human(swarm.step_s)}, sync {_human(swarm.sync_s)}, H = {swarm.inner_steps}; "
        f"{_human(cfg.horizon_s)} simulated in {seconds:.1f} s"
    )
    print(f"{'method':<24}{'goodput':>9}{'uptime':>9}{'failures':>10}  refused by the merger")
    for name, out in outcomes.items():
        refused = ", ".join(f"{n} {k}" for k, n in out.refusals) or "-"
        print(
            f"{_LABELS[name]:<24}{100 * out.goodput:>8.1f}%{100 * out.uptime:>8.1f}%{out.failures:>10}  {refused}"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "swarm": asdict(swarm),
                    "horizon_s": cfg.horizon_s,
                    "seconds": round(seconds, 2),
                    "methods": {k: _outcome_json(o) for k, o in outcomes.items()},
                }
            )
        )
    return 0


def _outcome_json(out: Outcome) -> dict[str, object]:
    return {
        "goodput": round(out.goodput, 4),
        "uptime": round(out.uptime, 4),
        "failures": out.failures,
        "versions": out.versions,
        "refusals": dict(out.refusals),
        "lost_fraction": round(out.lost_fraction, 4),
    }


# -- the paper's table ---------------------------------------------------------------------------


def _paper_table(args: argparse.Namespace) -> int:
    from protocol.sim.paper import paper_grid

    started = time.perf_counter()
    cells = paper_grid(failures=args.failures or 2000, seed=args.seed)
    seconds = time.perf_counter() - started
    worst = max(abs(c.sim - c.paper) for c in cells)
    _print_table(cells)
    print(f"largest deviation {worst:.2f} points; {len(cells)} cells in {seconds:.1f} s")
    print("constants: " + _constants_line())
    png = args.png or DEFAULT_PNG
    plot_grid(cells, png)
    print(f"plot: {png}")
    if args.json:
        print(
            json.dumps(
                {
                    "cells": [
                        {
                            "chips": c.chips,
                            "M": c.learners,
                            "method": c.method,
                            "paper": c.paper,
                            "sim": round(c.sim, 2),
                        }
                        for c in cells
                    ],
                    "max_abs_deviation": round(worst, 2),
                    "seconds": round(seconds, 2),
                    "png": str(png),
                }
            )
        )
    return 0


def _label(method: str, learners: int) -> str:
    return f"decoupled M={learners}" if method == "decoupled" else method


def _print_table(cells: list[Cell]) -> None:
    from protocol.sim.paper import CHIPS

    print(f"{'goodput % (sim / paper)':<24}" + "".join(f"{_chips(c):>15}" for c in CHIPS))
    rows: dict[str, list[Cell]] = {}
    for c in cells:
        rows.setdefault(_label(c.method, c.learners), []).append(c)
    for label, row in rows.items():
        print(f"{label:<24}" + "".join(f"{c.sim:>8.1f} / {c.paper:<4.0f}" for c in row))


def _constants_line() -> str:
    from protocol.sim.paper import PAPER_CONSTANTS, PAPER_MERGE, PAPER_TIMING

    hw, tm = PAPER_CONSTANTS, PAPER_TIMING
    rep = hw.repair
    return (
        f"slice {hw.chips_per_slice} chips, chip MTBI {hw.mtbi_s / 86400:.0f} d, repair ExpWeibull(scale "
        f"{rep.scale_s:g} s, shape {rep.shape:g}, power {rep.power:g}; mean {rep.mean():.0f} s), reconfiguration "
        f"{hw.reconfig_s:g} s, rejoin wait {hw.rejoin_wait_s:g} s, data-parallel restart {hw.restart_s:g} s "
        f"+ {100 * hw.spare_fraction:g} % hot spares, step {tm.step_s:g} s, H = {tm.inner_steps}, sync "
        f"{tm.sync_s:g} s, merger K = {PAPER_MERGE.quorum}, late policy {PAPER_MERGE.late_policy}, "
        f"staleness bound {PAPER_MERGE.staleness_bound}"
    )


def _chips(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n // 1000}k"


def plot_grid(cells: list[Cell], path: Path) -> None:
    """Goodput against chips, simulated (solid) and the paper's (dashed), one colour per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from protocol.sim.paper import CHIPS

    fig, ax = plt.subplots(figsize=(8, 5.5))
    rows: dict[str, list[Cell]] = {}
    for c in cells:
        rows.setdefault(_label(c.method, c.learners), []).append(c)
    for i, (label, row) in enumerate(rows.items()):
        colour = f"C{i}"
        xs = [c.chips for c in row]
        ax.plot(xs, [c.sim for c in row], "o-", color=colour, label=f"{label} (sim)")
        ax.plot(
            xs,
            [c.paper for c in row],
            "s--",
            color=colour,
            mfc="none",
            alpha=0.7,
            label=f"{label} (paper)",
        )
    ax.set_xscale("log")
    ax.set_xticks(list(CHIPS), [_chips(c) for c in CHIPS])
    ax.minorticks_off()
    ax.set_xlabel("chips (chip MTBI 1 year)")
    ax.set_ylabel("goodput %")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title("Goodput: atoll simulate (solid) vs the paper's Table 1 (dashed)")
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _calibrate() -> int:
    from protocol.sim.paper import calibrate_data_parallel, calibrate_groups

    print("data-parallel row: restart_s x spare_fraction (largest deviation, best first)")
    for worst, restart, spare in calibrate_data_parallel(
        range(16, 25, 2), [0.06, 0.08, 0.09, 0.10, 0.11, 0.12]
    )[:5]:
        print(f"  {worst:5.2f}  restart {restart:g} s, spares {100 * spare:g} %")
    print(
        "elastic groups (elastic row and every decoupled learner, chips / M): reconfig_s x rejoin_wait_s"
    )
    for worst, reconfig, wait in calibrate_groups(
        [19.5, 20.0, 20.5, 21.0, 21.5], [80, 100, 120, 140, 160]
    )[:5]:
        print(f"  {worst:5.2f}  reconfiguration {reconfig:g} s, rejoin wait {wait:g} s")
    print("now: " + _constants_line())
    return 0


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g}{unit}"
    return f"{seconds:.3g}s"
