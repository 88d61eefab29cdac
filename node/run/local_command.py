"""The ``atoll local`` command: run a ``LocalSwarm`` end to end, then its report and comparisons.

``run_local`` launches the swarm (``node.run.local``), folds the peers' results and the
launcher's own accounting (chaos, uptime, versions published with two contents) into the
report, trains the comparisons asked for (``--baseline``: synchronous data-parallel at equal
tokens; ``--alone``: one island without the swarm), writes the JSON and the plot, and prints
the summary. Torch is imported only by the comparisons, after the peers have stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from node.config import RunConfig
from node.run.chaos import ChaosSpec
from node.run.local import ENDLESS_STEPS, LaunchPlan, LocalSwarm
from node.run.report import build_report, summary_lines, write_report

__all__ = [
    "baseline_for",
    "contents_by_version",
    "island_alone_for",
    "run_local",
    "version_accounting",
]


def contents_by_version(
    published: Iterable[tuple[int, int, str]],
) -> dict[tuple[int, int], set[str]]:
    """Every (fragment, version) announced, with the contents (digests) it was published with:
    more than one is a version published with two contents."""
    contents: dict[tuple[int, int], set[str]] = {}
    for fragment, version, digest in published:
        contents.setdefault((fragment, version), set()).add(digest)
    return contents


def version_accounting(published: list[tuple[int, int, str, int]]) -> dict[str, Any]:
    """``version_conflicts``: (fragment, version) pairs published with more than one content
    (must be 0), from every owner's announcements, killed peers' included;
    ``versions_published``: distinct pairs."""
    contents = contents_by_version((f, v, digest) for f, v, digest, _index in published)
    conflicts = sorted(k for k, v in contents.items() if len(v) > 1)
    return {
        "version_conflicts": len(conflicts),
        "version_conflict_list": [
            {"fragment": f, "version": v, "digests": sorted(contents[(f, v)])}
            for f, v in conflicts[:20]
        ],
        "versions_published": len(contents),
    }


def run_local(
    cfg: RunConfig,
    *,
    report_path: Path | None,
    baseline: bool = False,
    alone: bool = False,
    quiet: bool = False,
    kill_at: dict[int, int] | None = None,
    extra_peer_args: dict[int, list[str]] | None = None,
    attacks: dict[int, str] | None = None,
    admission: str = "open",
    chaos: ChaosSpec | None = None,
    duration_s: float | None = None,
    spawn: str = "fork",
) -> dict[str, Any]:
    """Run a local swarm end to end, write the report and plot, print the summary. With
    ``duration_s`` the peers train until that many seconds after launch instead of ``cfg.steps``.
    Raises ``RuntimeError`` (told in one line) for ``baseline`` or ``alone`` with stand-in
    compute, which measures no loss to compare."""
    if cfg.standin is not None and (baseline or alone):
        raise RuntimeError(
            "--baseline and --alone compare losses, which --compute standin does not measure: "
            "leave them out, or use --compute real"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report_path = report_path or Path("runs") / stamp / "report.json"
    run_dir = report_path.parent / f"{report_path.stem}-peers"
    if duration_s is not None:
        cfg = dataclasses.replace(cfg, steps=ENDLESS_STEPS)
    plan = LaunchPlan(
        admission=admission,
        extra_peer_args=extra_peer_args or {},
        kill_at=kill_at or {},
        chaos=chaos,
        duration_s=duration_s,
        spawn=spawn,
    )
    swarm = LocalSwarm(cfg, run_dir, plan, quiet=quiet)
    t0 = time.monotonic()
    length = f"{duration_s:g} s" if duration_s is not None else f"{cfg.steps} steps"
    print(
        f"atoll local: {cfg.peers} peers, {length}, model {cfg.model}, "
        f"{cfg.fragments} fragments, H={cfg.inner_steps}, codec {cfg.codec}"
        + (f", compute {cfg.compute} (loss not measured)" if cfg.standin else "")
        + (f", chaos {chaos.text}" if chaos else "")
        + f"; logs in {run_dir}",
        flush=True,
    )
    try:
        results = asyncio.run(swarm.run())
    except KeyboardInterrupt:
        print("interrupted: peers stopped", file=sys.stderr)
        raise
    config = dict(json.loads(cfg.to_json()))
    if duration_s is not None:  # "steps": the most any island trained
        config["steps"] = max((int(r.get("steps", 0)) for r in results), default=0)
    report = build_report(config, results, time.monotonic() - t0)
    report.update(swarm.accounting(results))
    report["attacks"] = {str(i): a for i, a in sorted((attacks or {}).items())}
    report["killed_peers"] = swarm.killed
    report.update(version_accounting(swarm.published))
    if swarm.forged:  # issue 48: versions published whose content an attacker forged (must be 0)
        report["attacker_versions_published"] = sum(
            1 for _f, _v, d, _i in swarm.published if d in swarm.forged
        )
        report["forged_states"] = len(swarm.forged)
        # a forged state a peer took becomes its version once it owns the fragment: must be 0 too
        report["forged_states_taken"] = len(swarm.handed & swarm.forged)
    report["event_logs"] = sorted(str(p) for p in run_dir.glob("peer*-events/*.jsonl"))
    if baseline:
        print("training the synchronous data-parallel baseline at equal tokens ...", flush=True)
        report["baseline"] = baseline_for(cfg)
        end = report["baseline"]["eval_loss_end"]
        report["eval_loss_gap_rel"] = (report["eval_loss"]["end"] - end) / end
    if alone:
        print(
            "training peer 0's island alone (same model, shard and steps, no swarm) ...", flush=True
        )
        report.update(island_alone_for(cfg, report["eval_loss"]["end"]))
    png = write_report(report, report_path)
    for line in summary_lines(report):
        print(line)
    print(f"report: {report_path}  plot: {png}")
    return report


def island_alone_for(cfg: RunConfig, swarm_eval_end: float, index: int = 0) -> dict[str, Any]:
    """The report's ``island_alone`` (island ``index`` trained alone) and ``merge_gain`` (its final
    eval loss minus the swarm's global model's: positive when merging helped)."""
    import torch

    from node.run.alone import train_island_alone

    torch.set_num_threads(max(1, cfg.threads))
    island = train_island_alone(cfg, index)
    return {"island_alone": island, "merge_gain": island["eval_loss_end"] - swarm_eval_end}


def baseline_for(cfg: RunConfig) -> dict[str, Any]:
    """Synchronous data-parallel training of the same model on the same shards and tokens."""
    import torch

    from node.workload.baseline import train_config_for, train_data_parallel
    from node.workload.corpus import load_corpus, split_corpus

    torch.set_num_threads(2)
    data = load_corpus(Path(cfg.corpus) if cfg.corpus else None, max_bytes=cfg.corpus_max_bytes)
    train, heldout = split_corpus(data)
    tcfg = train_config_for(cfg)
    if cfg.baseline_lr:
        tcfg = dataclasses.replace(tcfg, lr=cfg.baseline_lr)
    result = train_data_parallel(tcfg, cfg.peers, train, heldout, log=None)
    return {**result, "lr": tcfg.lr}
