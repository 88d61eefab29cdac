"""The loss curves of ``bench.quality``'s main comparison: one panel per seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_curves"]

LABELS = {
    "decoupled": "Decoupled DiLoCo (global model)",
    "sync": "synchronous DiLoCo (global model)",
}


def plot_curves(main: dict[str, Any], png: Path) -> None:
    """Held-out loss against inner step (equal tokens at equal steps) for every method and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    seeds = main["per_seed"]
    fig, axes = plt.subplots(
        1, len(seeds), figsize=(5 * len(seeds), 4.2), squeeze=False, sharey=True
    )
    for ax, run in zip(axes[0], seeds, strict=True):
        for method, label in LABELS.items():
            curve = run.get(method, {}).get("eval_curve_global") or []
            if curve:  # (seconds, step, loss)
                ax.plot(
                    [c[1] for c in curve],
                    [c[2] for c in curve],
                    marker=".",
                    label=f"{label}: {run[method]['eval_loss_end']:.3f}",
                )
        dp = run["dp"]
        ax.plot(
            [c[0] for c in dp["eval_curve"]],
            [c[2] for c in dp["eval_curve"]],
            "--",
            color="black",
            label=f"data-parallel, lr {dp['lr']:g}: {dp['eval_loss_end']:.3f}",
        )
        ax.set_title(f"seed {run['seed']}")
        ax.set_xlabel("inner step per learner (equal tokens)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.1f"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%.1f"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("held-out loss (nats/byte)")
    fig.suptitle(f"bench.quality: {main['overrides']}", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
