"""The merger log's format, shared by its writer (``eventlog``) and its reader (``eventlog_replay``):
the format's name, where a log's contents are kept, and how a decision is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.diloco.merge import Decision

__all__ = ["FORMAT", "payload_dir"]

FORMAT = "atoll-merger-log/2"


def payload_dir(log: Path) -> Path:
    """The folder that holds a log's contributions and states."""
    return log.with_name(log.name.removesuffix(".jsonl") + ".payloads")


def _decision(d: Decision) -> dict[str, Any]:
    return {
        "kind": d.kind,
        "reason": d.reason,
        "version": d.version,
        "accepted": d.accepted,
        "refusal": d.refusal,
        "entries": [[e.peer.hex(), e.weight, e.staleness, e.clip] for e in d.entries],
        "scale": d.scale,
    }
