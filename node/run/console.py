"""What a person at a terminal sees of a peer, and what a log collector reads.

``ProgressLine``   one line on a terminal, rewritten in place with ``\\r``; log records and
                   milestones print above it
``JoinView``       a peer's events (``node.run.train``: listening, joined, progress, done) as that
                   line and a plain line per milestone; optionally also as the JSON event lines
``JsonFormatter``  ``--json-logs``: one JSON object per log record (time, level, logger, message,
                   and the record's extra fields)
``setup_logging``  the root logger on stderr: plain, JSON, or above a progress line
``render_status``  ``atoll status``'s tables, from a peer's ``GET /v1/status``
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = ["JoinView", "JsonFormatter", "ProgressLine", "render_status", "setup_logging"]


class ProgressLine:
    """A line at the bottom of a terminal. ``show`` rewrites it; ``above`` prints lines above it.
    Thread-safe: the training thread shows progress while the node's thread logs."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.text = ""
        self._lock = threading.Lock()

    def show(self, text: str) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        with self._lock:
            self.text = text[: max(width - 1, 20)]
            self._draw()

    def above(self, text: str) -> None:
        with self._lock:
            self.stream.write("\r\033[K" + text.rstrip("\n") + "\n")
            self._draw()

    def clear(self) -> None:
        """Take the progress line off the screen (until the next ``show``)."""
        with self._lock:
            self.text = ""
            self._draw()

    def close(self) -> None:
        """Leave the last progress line on the screen and move below it."""
        with self._lock:
            if self.text:
                self.stream.write("\n")
                self.stream.flush()
            self.text = ""

    def _draw(self) -> None:
        self.stream.write("\r\033[K" + self.text)
        self.stream.flush()


class _AboveLine(logging.Handler):
    """Log records printed above a ``ProgressLine``."""

    def __init__(self, line: ProgressLine) -> None:
        super().__init__()
        self.line = line

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.line.above(self.format(record))
        except Exception:  # logging must never take the peer down
            self.handleError(record)


_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
}


# the standard names, whatever another library renamed them to (hivemind renames WARNING "WARN")
_LEVELS = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARNING",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "CRITICAL",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    every field passed as ``extra=``, and ``exception`` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": _LEVELS.get(record.levelno, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(
            (k, v)
            for k, v in vars(record).items()
            if k not in _RECORD_FIELDS and not k.startswith("_")
        )
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(
    level: str, stream: TextIO, *, json_logs: bool = False, line: ProgressLine | None = None
) -> None:
    """The root logger at ``level`` with one handler on ``stream``: JSON lines with ``json_logs``,
    above ``line`` when there is one, else plain lines."""
    handler: logging.Handler = (
        _AboveLine(line) if line is not None else logging.StreamHandler(stream)
    )
    handler.setFormatter(
        JsonFormatter()
        if json_logs
        else logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def _versions(vs: Sequence[int]) -> str:
    return ",".join(str(v) for v in vs) or "-"


class JoinView:
    """A peer's events for a person (the progress line, a line per milestone); with
    ``json_events`` each event also goes to stdout as its JSON line, as under a launcher."""

    def __init__(self, line: ProgressLine | None, *, json_events: bool, steps: int) -> None:
        from node.peer import emit  # the launchers' JSON event lines

        self.line = line
        self.json_events = json_events
        self.steps = steps
        self._emit = emit

    def __call__(self, event: str, **fields: Any) -> None:
        if self.json_events:
            self._emit(event, **fields)
        text = self.describe(event, fields)
        if text is None:
            return
        if self.line is not None:
            if event == "done":
                self.line.clear()
            (self.line.show if event == "progress" else self.line.above)(text)
        elif not self.json_events and event != "progress":
            print(text, flush=True)

    def describe(self, event: str, f: dict[str, Any]) -> str | None:
        """The line for one event, or None for those a person need not see."""
        if event == "listening":
            return f"listening at {f['url']} (peer {str(f['peer_id'])[:12]})"
        if event == "resumed":
            return f"resumed from the checkpoint at step {f['step']}, versions {_versions(f['versions'])}"
        if event == "schedule":
            return (
                f"the swarm's learners are at step {f['step']}/{f['steps']} (median of {f['learners']}): "
                f"training from there, the learning rate warmed up again"
            )
        if event == "joined":
            return (
                f"joined: {len(f['synced'])} fragments synced from their owners, "
                f"versions {_versions(f['versions'])}; training"
            )
        if event == "progress":
            return (
                f"step {f['step']}/{self.steps}  {_loss(f['loss'])}  versions {_versions(f['versions'])}  "
                f"sent {f['bytes_sent'] / 1e6:.1f} MB  received {f.get('bytes_received', 0) / 1e6:.1f} MB  "
                f"peers {f.get('peers', '?')}"
            )
        if event == "done":
            r = f["result"]
            return (
                f"done: {r['steps']} steps, {_eval_span(r)}, "
                f"versions {_versions(r['global_versions'])}, {r['bytes_sent'] / 1e6:.1f} MB sent"
            )
        return None


def _loss(loss: float | None) -> str:
    """A progress line's loss; None with stand-in compute, which measures none."""
    return "loss not measured (stand-in)" if loss is None else f"loss {loss:.3f}"


def _eval_span(result: dict[str, Any]) -> str:
    start, end = result.get("eval_loss_start"), result.get("eval_loss_end")
    if start is None or end is None:
        return "loss not measured (stand-in compute)"
    return f"eval loss {start:.3f} -> {end:.3f}"


# --- atoll status ----------------------------------------------------------------------------------
def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    return [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [list(header), *rows]
    ]


def _yes(value: object) -> str:
    return "yes" if value else "no"


def render_status(status: dict[str, Any]) -> str:
    """A peer's (or a bootstrap node's) ``/v1/status`` as a few lines and two tables: the members
    (roles, lab, reachability, step) and the fragments (the version this peer holds, the owner)."""
    adm = status.get("admission") or {}
    swarm = (
        f"swarm {adm.get('name')!r} ({adm.get('id')}), {adm.get('admission')}, manifest v{adm.get('version')}"
        if adm
        else f"swarm {status['swarm']}"
        if status.get("swarm")
        else "no swarm manifest (DHT only)"
    )
    me = str(status.get("peer_id", "?"))
    if status.get("role") == "bootstrap":
        return "\n".join(
            [
                f"bootstrap node {me[:12]} at {status.get('url')}; {swarm}",
                f"DHT contacts {status.get('dht_contacts', 0)}, keys {status.get('dht_keys', 0)}",
                *_admission_lines(adm),
            ]
        )
    lines = [
        f"peer {me[:12]} at {status.get('url')}; {swarm}",
        f"step {status.get('step', 0)}, {'learning' if status.get('learning') else 'not learning'}, "
        f"{'reachable' if status.get('reachable') else 'not reachable (learner only)'}",
        "",
    ]
    members = sorted(status.get("members", []), key=lambda m: str(m.get("url") or ""))
    lines += _table(
        ["MEMBER", "URL", "LAB", "ROLES", "REACHABLE", "LEARNING", "STEP"],
        [
            [
                m["peer_id"][:12] + ("*" if m["peer_id"] == me else ""),
                m.get("url") or "-",
                m.get("lab") or "-",
                ",".join(m.get("roles", [])) or "-",
                _yes(m.get("reachable")),
                _yes(m.get("learning")),
                str(m.get("step", 0)),
            ]
            for m in members
        ],
    )
    lines.append("")
    versions = status.get("versions", [])
    rows = []
    for p, o in sorted(status.get("owners", {}).items(), key=lambda kv: int(kv[0])):
        held = str(versions[int(p)]) if int(p) < len(versions) else "-"
        owner = "(none)" if o is None else o["peer_id"][:12] + ("*" if o["peer_id"] == me else "")
        rows.append([p, held, owner, o["url"] if o else "-"])
    lines += _table(["FRAGMENT", "VERSION", "OWNER", "OWNER URL"], rows)
    lines.append("")
    lines.append(
        f"bytes sent {status.get('bytes_sent', 0) / 1e6:.1f} MB, received "
        f"{status.get('bytes_received', 0) / 1e6:.1f} MB; members {len(members)}, refused "
        f"{len(status.get('refused_members', {}))}; remote errors "
        f"{sum(status.get('remote_errors', {}).values())}; version jumps refused "
        f"{status.get('version_jumps_refused', 0)}"
    )
    lines += _admission_lines(adm)
    lines.append("* this peer")
    return "\n".join(lines)


def _admission_lines(adm: dict[str, Any]) -> list[str]:
    if not adm:
        return []
    refused = adm.get("refused", {})
    why = ", ".join(f"{k}: {v}" for k, v in sorted(refused.items(), key=lambda kv: -kv[1])[:3])
    return [
        f"requests admitted {adm.get('admitted', 0)}, refused {sum(refused.values())}"
        + (f" ({why})" if why else "")
    ]
