"""The scaling plot of ``bench.swarm_scale`` runs: control bytes, views, spread, owner agreement
and CPU per peer, per swarm size.

    python -m bench.swarm_scale_plot docs/scale_peers.png today=base.json bounded=new.json

Each ``LABEL=FILE`` is one run's JSON (the ``{"cases": [...]}`` line ``bench.swarm_scale``
prints last); several files may share a label (their cases are merged).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["load_series", "plot_cases"]

PANELS = (
    ("control_bytes_per_peer_s", "control bytes / peer / s"),
    ("member_view", "members in a peer's view (mean)"),
    ("spread_p99_s", "s until 99 % of learners hold a version (median)"),
    ("owner_agreement", "owner agreement (pairs naming the same owner)"),
    ("cpu_ms_per_peer_s", "CPU ms / peer / s (steady window)"),
)


def load_series(args: list[str]) -> dict[str, list[dict[str, Any]]]:
    """``LABEL=FILE`` arguments to label -> cases sorted by swarm size (a missing measurement
    leaves its point out; a case with a ``note`` is left out)."""
    series: dict[str, list[dict[str, Any]]] = {}
    for arg in args:
        label, _, path = arg.partition("=")
        if not path:
            raise SystemExit(f"expected LABEL=FILE, got {arg!r}")
        lines = Path(path).read_text().strip().splitlines()
        cases = json.loads(lines[-1])["cases"]
        # a case with a "note" was kept for the record, not for comparison (docs say why)
        series.setdefault(label, []).extend(c for c in cases if "note" not in c)
    return {k: sorted(v, key=lambda c: c["peers"]) for k, v in series.items()}


def plot_cases(series: dict[str, list[dict[str, Any]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 4))
    for ax, (field, title) in zip(axes, PANELS, strict=True):
        for label, cases in series.items():
            pts = [(c["peers"], c[field]) for c in cases if c.get(field) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("peers")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    plot_cases(load_series(sys.argv[2:]), Path(sys.argv[1]))
