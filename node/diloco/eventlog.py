"""An owner's merger events, logged as they happen and replayed through ``protocol/`` later.

``FragmentMerger`` (``protocol.diloco.merge``) is pure: given the same events at the same times
it makes the same decisions. ``LoggedMerger`` wraps an owner's merger and writes one JSON line per
call — the event (a contribution's sender, base version, tokens, steps, step time and norm; a
tick; the number of expected learners; a publication; a failed merge; a rebase), its ``now`` and
the decision it got (kind, reason, accepted, refusal, and the merged entries with their weights,
staleness and clip factors) — plus each published version's content digest. Payloads are not
logged: no decision depends on them, only on their norms.

``replay`` feeds a log back into a fresh ``FragmentMerger`` and compares every decision with the
one logged: the tool for "why was my contribution late?" (``atoll replay LOG``).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import IO, Any

from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig

__all__ = ["LoggedMerger", "ReplayResult", "replay"]

FORMAT = "atoll-merger-log/1"
MAX_LOG_BYTES = 256 << 20  # a log stops growing here (a line says so); the run goes on


def _decision(d: Decision) -> dict[str, Any]:
    return {"kind": d.kind, "reason": d.reason, "version": d.version, "accepted": d.accepted,
            "refusal": d.refusal,
            "entries": [[e.peer.hex(), e.weight, e.staleness, e.clip] for e in d.entries]}


class LoggedMerger:
    """A ``FragmentMerger`` whose every call is written to ``path`` (JSON lines)."""

    def __init__(self, merger: FragmentMerger, path: Path, *, fragment: int, config: MergeConfig,
                 version: int, now: float) -> None:
        self.merger = merger
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = path.open("a", encoding="utf-8")
        self._written = 0
        self._lock = threading.Lock()
        self._write({"kind": "start", "format": FORMAT, "fragment": fragment, "version": version, "now": now,
                     "config": dataclasses.asdict(config)})

    def __getattr__(self, name: str) -> Any:  # phase, count, deadline(), ... of the merger itself
        return getattr(self.merger, name)

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._file is None:
                return
            line = json.dumps(record, separators=(",", ":")) + "\n"
            if self._written + len(line) > MAX_LOG_BYTES:
                self._file.write(json.dumps({"kind": "truncated"}) + "\n")
                self._file.close()
                self._file = None
                return
            self._file.write(line)
            self._file.flush()
            self._written += len(line)

    def _log(self, event: dict[str, Any], decision: Decision) -> Decision:
        self._write({**event, "decision": _decision(decision)})
        return decision

    def on_contribution(self, peer: bytes, *, base_version: int, tokens: int, steps: int, step_time: float,
                        payload: object, now: float, norm: float | None = None) -> Decision:
        d = self.merger.on_contribution(peer, base_version=base_version, tokens=tokens, steps=steps,
                                        step_time=step_time, payload=payload, now=now, norm=norm)
        return self._log({"kind": "contribution", "peer": peer.hex(), "base_version": base_version,
                          "tokens": tokens, "steps": steps, "step_time": step_time, "norm": norm, "now": now}, d)

    def on_tick(self, now: float) -> Decision:
        return self._log({"kind": "tick", "now": now}, self.merger.on_tick(now))

    def set_expected(self, n: int | None, *, now: float) -> Decision:
        return self._log({"kind": "expect", "n": n, "now": now}, self.merger.set_expected(n, now=now))

    def on_published(self, new_version: int, *, sync_time: float, now: float) -> Decision:
        d = self.merger.on_published(new_version, sync_time=sync_time, now=now)
        return self._log({"kind": "published", "version": new_version, "sync_time": sync_time, "now": now}, d)

    def on_merge_failed(self, reason: str, *, now: float, discard: Collection[bytes] = ()) -> Decision:
        d = self.merger.on_merge_failed(reason, now=now, discard=discard)
        return self._log({"kind": "merge_failed", "reason": reason, "discard": sorted(p.hex() for p in discard),
                          "now": now}, d)

    def rebase(self, version: int, *, now: float) -> Decision:
        return self._log({"kind": "rebase", "version": version, "now": now}, self.merger.rebase(version, now=now))

    def note_version(self, version: int, digest: bytes) -> None:
        """The content digest of a version this owner published (or took over)."""
        self._write({"kind": "version", "version": version, "digest": digest.hex()})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclasses.dataclass
class ReplayResult:
    decisions: int = 0
    versions: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {version, digest, merged}
    mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "versions": self.versions, "mismatches": self.mismatches}


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg}); the log is damaged") from None


def replay(path: Path) -> ReplayResult:
    """Re-run every event of ``path`` through a fresh merger; report what differs.

    Raises ``ValueError`` for a file that is not a merger log (with what to do)."""
    result = ReplayResult()
    merger: FragmentMerger | None = None
    merged_at: dict[int, list[list[Any]]] = {}
    for n, rec in _records(path):
        kind = rec.get("kind")
        if kind == "start":
            if rec.get("format") != FORMAT:
                raise ValueError(f"{path}:{n}: log format {rec.get('format')!r}, this Atoll reads {FORMAT}")
            merger = FragmentMerger(int(rec["fragment"]), MergeConfig(**rec["config"]),
                                    version=int(rec["version"]), now=float(rec["now"]))
            continue
        if kind == "version":
            result.versions.append({"version": rec["version"], "digest": rec["digest"],
                                    "merged": merged_at.get(int(rec["version"]), [])})
            continue
        if kind == "truncated":
            result.mismatches.append({"line": n, "what": "the log was truncated at its size cap"})
            break
        if merger is None:
            raise ValueError(f"{path}:{n}: event before the log's start line; is this a merger log?")
        now = float(rec["now"])
        if kind == "contribution":
            d = merger.on_contribution(bytes.fromhex(rec["peer"]), base_version=rec["base_version"],
                                       tokens=rec["tokens"], steps=rec["steps"], step_time=rec["step_time"],
                                       payload=None, now=now, norm=rec["norm"])
        elif kind == "tick":
            d = merger.on_tick(now)
        elif kind == "expect":
            d = merger.set_expected(rec["n"], now=now)
        elif kind == "published":
            d = merger.on_published(rec["version"], sync_time=rec["sync_time"], now=now)
        elif kind == "merge_failed":
            d = merger.on_merge_failed(rec["reason"], now=now, discard=[bytes.fromhex(p) for p in rec["discard"]])
        elif kind == "rebase":
            d = merger.rebase(rec["version"], now=now)
        else:
            raise ValueError(f"{path}:{n}: unknown event {kind!r}")
        result.decisions += 1
        got, logged = _decision(d), rec["decision"]
        if got != logged:
            result.mismatches.append({"line": n, "event": kind, "logged": logged, "replayed": got})
        if d.kind == "merge":
            merged_at[d.version + 1] = got["entries"]
    return result
