"""``atoll replay LOG [--json]``: re-run an owner's merger log through ``protocol/`` and say what differs.

Each line of the log is one event the owner fed its merger and the decision it got
(``node.diloco.eventlog``). The replay feeds the same events at the same times to a fresh
``FragmentMerger``: with the same code it reproduces every decision, reason and merged entry, so
a log answers "why was my contribution late?" after the fact, and a mismatch names the event
whose decision changed (a log from another Atoll version, or edited). With the contributions and
states kept beside the log (``<log>.payloads/``), every merge is recomputed and each version's
digest compared with the one the owner published.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from node.diloco.eventlog import EmptyLog, LogError, ReplayResult, replay

__all__ = ["replay_main"]


def replay_main(args: argparse.Namespace) -> int:
    path: Path = args.log
    if path.is_dir():
        return _replay_folder(path, as_json=args.json)
    if not path.is_file():
        print(
            f"atoll replay: no log at {path}; owners write them with --event-log-dir",
            file=sys.stderr,
        )
        return 1
    try:
        result = replay(path)
    except (LogError, OSError) as exc:
        print(f"atoll replay: {_one_line(path, exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_json()))
        return 0 if not result.mismatches else 1
    print(
        f"{path}: {result.decisions} decisions replayed, {len(result.versions)} versions "
        f"({result.contents_checked} recomputed from the kept contents), {result.validations} validation checks "
        f"and {result.agreements} agreement verdicts recomputed, {len(result.mismatches)} mismatches"
    )
    if result.unchecked:
        print(f"  contents not all recomputed: {result.unchecked}")
    for v in result.versions:
        merged = ", ".join(
            f"{peer[:8]} w={w:.3g} stale={s} clip={c:.3g}" for peer, w, s, c in v["merged"]
        )
        print(
            f"  version {v['version']} {v['digest'][:12]}"
            + (f": merged {merged}" if merged else "")
        )
    for m in result.mismatches[:20]:
        print(
            f"  MISMATCH line {m.get('line')}: {m.get('event', m.get('what'))}: logged "
            f"{m.get('logged', {}).get('reason')!r}, replayed {m.get('replayed', {}).get('reason')!r}"
        )
    return 0 if not result.mismatches else 1


def _replay_folder(folder: Path, *, as_json: bool) -> int:
    """Every log under ``folder`` (a run's ``report-peers``, say): one line each, and the sums.
    With ``--json`` the last line is ``{"decisions", "versions", "mismatches", "logs"}``."""
    logs = sorted(folder.rglob("*.jsonl"))
    if not logs:
        print(f"atoll replay: no event logs (*.jsonl) under {folder}", file=sys.stderr)
        return 1
    decisions, versions, checked, agreements, mismatches, per_log = 0, 0, 0, 0, [], []
    for log in logs:
        try:
            result = replay(log)
        except EmptyLog:  # an owner killed as it opened its log: nothing to replay there
            result = ReplayResult()
        except (LogError, OSError) as exc:
            print(f"atoll replay: {_one_line(log, exc)}", file=sys.stderr)
            return 1
        decisions += result.decisions
        versions += len(result.versions)
        checked += result.contents_checked
        agreements += result.agreements
        mismatches += [{"log": str(log), **m} for m in result.mismatches]
        per_log.append(
            {
                "log": str(log),
                "decisions": result.decisions,
                "versions": len(result.versions),
                "contents_checked": result.contents_checked,
                "unchecked": result.unchecked,
                "mismatches": len(result.mismatches),
            }
        )
        if not as_json:
            print(
                f"{log}: {result.decisions} decisions, {len(result.versions)} versions "
                f"({result.contents_checked} recomputed), {len(result.mismatches)} mismatches"
                + (f"; contents not all recomputed: {result.unchecked}" if result.unchecked else "")
            )
    if as_json:
        print(
            json.dumps(
                {
                    "decisions": decisions,
                    "versions": versions,
                    "contents_checked": checked,
                    "agreements": agreements,
                    "mismatches": mismatches,
                    "logs": per_log,
                }
            )
        )
    else:
        print(
            f"{len(logs)} logs: {decisions} decisions replayed, {versions} versions ({checked} recomputed "
            f"from the kept contents), {agreements} agreement verdicts recomputed, "
            f"{len(mismatches)} mismatches"
        )
    return 0 if not mismatches else 1


def _one_line(path: Path, exc: BaseException) -> str:
    """Why ``path`` cannot be replayed, in one line that names it (a ``LogError`` names its line)."""
    if isinstance(exc, OSError):
        return f"{path}: cannot read it: {exc.strerror or exc}" + (
            f": {exc.filename}" if exc.filename else ""
        )
    return " ".join(str(exc).split())
