"""An owner's merger events, logged as they happen and replayed through ``protocol/`` later.

``FragmentMerger`` (``protocol.diloco.merge``) is pure: given the same events at the same times
it makes the same decisions. ``LoggedMerger`` wraps an owner's merger and writes one JSON line per
call — the event (a contribution's sender, base version, tokens, steps, step time and norm; a
tick; the number of expected learners; a publication; a failed merge; a rebase), its ``now`` and
the decision it got (kind, reason, accepted, refusal, and the merged entries with their weights,
staleness and clip factors) — plus each published version's content digest.

Contents are logged too, in a folder beside the log (``<log>.payloads/``, content-addressed):
every contribution as it arrived (the encoded message) and every state the owner started from
or took over (global fragment and momentum, safetensors). ``replay`` then recomputes every merge
with the owner's own function (``protocol.diloco.outer.merge_update``) and checks each
version's digest: the same decisions *and* the same bits. The folder stops growing at
``MAX_PAYLOAD_BYTES`` (the log says so; versions after that are replayed by decision only).

``replay`` feeds a log back into a fresh ``FragmentMerger`` and compares every decision with the
one logged: the tool for "why was my contribution late?" (``atoll replay LOG``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import threading
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeGuard

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from node.diloco.flat import encode_flat, flat_digest, flat_from_tensors
from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig
from protocol.diloco.outer import OuterConfig, merge_update
from protocol.diloco.updates import encode_update
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.wire.codec import decode, encode
from protocol.wire.messages import Contribution
from protocol.wire.tensors import CODECS, UPDATE_CODECS

__all__ = ["Content", "EmptyLog", "LogError", "LoggedMerger", "ReplayResult", "payload_dir", "replay"]

log = logging.getLogger(__name__)

FORMAT = "atoll-merger-log/2"
MAX_LOG_BYTES = 256 << 20  # a log stops growing here (a line says so); the run goes on
MAX_PAYLOAD_BYTES = 1 << 30  # and its payload folder here (replay then checks decisions only)
MAX_PAYLOAD_MESSAGE = 1 << 31
MAX_REPLAY_THREADS = 1024  # a log's thread count past this is damage (10**6 ran libgomp out of memory)
MAX_UINT = (1 << 64) - 1  # the wire's integers (msgpack uint64): versions, tokens, steps
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")


@dataclasses.dataclass(frozen=True)
class Content:
    """What ``replay`` needs to recompute a fragment's versions: its tensors' shapes, the codec
    versions are published with, the outer step and whether it is an embedding fragment."""

    shapes: Sequence[tuple[int, ...]]
    download_codec: str
    outer: OuterConfig
    embedding: bool
    update_codec: str | None = None  # versions published as updates with error feedback
    block_size: int = 64


def payload_dir(log: Path) -> Path:
    """The folder that holds a log's contributions and states."""
    return log.with_name(log.name.removesuffix(".jsonl") + ".payloads")


def _decision(d: Decision) -> dict[str, Any]:
    return {"kind": d.kind, "reason": d.reason, "version": d.version, "accepted": d.accepted,
            "refusal": d.refusal,
            "entries": [[e.peer.hex(), e.weight, e.staleness, e.clip] for e in d.entries], "scale": d.scale}


class LoggedMerger:
    """A ``FragmentMerger`` whose every call is written to ``path`` (JSON lines)."""

    def __init__(self, merger: FragmentMerger, path: Path, *, fragment: int, config: MergeConfig,
                 version: int, now: float, content: Content | None = None) -> None:
        """With ``content``, contributions and states are kept too (see the module docstring)."""
        self.merger = merger
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = path.open("a", encoding="utf-8")
        self._written = 0
        self._lock = threading.Lock()
        self._payloads = payload_dir(path) if content is not None else None
        self._payload_bytes = 0
        self._next_payload: str | None = None
        start: dict[str, Any] = {"kind": "start", "format": FORMAT, "fragment": fragment, "version": version,
                                 "now": now, "config": dataclasses.asdict(config)}
        if content is not None:
            start["content"] = {"shapes": [list(s) for s in content.shapes], "codec": content.download_codec,
                                "outer": dataclasses.asdict(content.outer), "embedding": content.embedding,
                                "update_codec": content.update_codec, "block_size": content.block_size,
                                "threads": torch.get_num_threads()}
        self._write(start)

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

    def _keep(self, name: str, write: Any, size: int) -> str | None:
        """Store one content-addressed file in the payload folder; None once the folder is full."""
        if self._payloads is None:
            return None
        if self._payload_bytes + size > MAX_PAYLOAD_BYTES:
            if self._payload_bytes <= MAX_PAYLOAD_BYTES:
                self._write({"kind": "payloads_full"})
                self._payload_bytes = MAX_PAYLOAD_BYTES + 1
            return None
        target = self._payloads / name
        try:
            self._payloads.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                write(target)
                self._payload_bytes += size
        except OSError as exc:  # a full disk stops the keeping, never the owner
            log.warning("event log: cannot keep %s (%s); contents are no longer logged", target, exc)
            self._payloads = None
            self._write({"kind": "payloads_full"})
            return None
        return name

    def note_payload(self, msg: Contribution) -> None:
        """Keep the contribution about to be fed to ``on_contribution`` (as it arrived, encoded)."""
        encoded = encode(msg)
        h = hashlib.sha256()
        for part in encoded.parts:
            h.update(part)
        self._next_payload = self._keep(h.hexdigest() + ".msg", lambda t: t.write_bytes(encoded.tobytes()),
                                        encoded.size)

    def note_state(self, theta: torch.Tensor, momentum: torch.Tensor | None) -> None:
        """The global fragment (and momentum) this owner starts from or takes over now."""
        tensors = {"theta": theta.detach().float().contiguous()}
        if momentum is not None:
            tensors["momentum"] = momentum.detach().float().contiguous()
        h = hashlib.sha256()
        for key, t in tensors.items():
            h.update(key.encode())
            h.update(flat_digest(t))
        name = self._keep(h.hexdigest() + ".safetensors", lambda t: save_file(tensors, str(t)),
                          sum(t.numel() * 4 for t in tensors.values()))
        self._write({"kind": "state", "blob": name})

    def on_contribution(self, peer: bytes, *, base_version: int, tokens: int, steps: int, step_time: float,
                        payload: object, now: float, norm: float | None = None) -> Decision:
        d = self.merger.on_contribution(peer, base_version=base_version, tokens=tokens, steps=steps,
                                        step_time=step_time, payload=payload, now=now, norm=norm)
        kept, self._next_payload = self._next_payload, None
        return self._log({"kind": "contribution", "peer": peer.hex(), "base_version": base_version,
                          "tokens": tokens, "steps": steps, "step_time": step_time, "norm": norm, "now": now,
                          "payload": kept}, d)

    def on_tick(self, now: float) -> Decision:
        return self._log({"kind": "tick", "now": now}, self.merger.on_tick(now))

    def set_expected(self, n: int | None, *, now: float, finished: int = 0) -> Decision:
        rec: dict[str, Any] = {"kind": "expect", "n": n, "now": now}
        if finished:  # absent in logs written before learners that finished were counted
            rec["finished"] = finished
        return self._log(rec, self.merger.set_expected(n, now=now, finished=finished))

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
    versions: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {version, digest, merged, replayed}
    mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unchecked: str | None = None  # why version contents were not (all) recomputed

    @property
    def contents_checked(self) -> int:
        return sum(v["replayed"] is not None for v in self.versions)

    def to_json(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "versions": self.versions, "contents_checked": self.contents_checked,
                "unchecked": self.unchecked, "mismatches": self.mismatches}


class LogError(ValueError):
    """A merger log that cannot be replayed: damaged, edited, or no merger log at all. One line:
    the log, the line number and what is wrong there."""


class EmptyLog(LogError):
    """A log that holds no records."""


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8", errors="replace") as f:  # binary: not JSON, said so
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as exc:
                    why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
                    raise LogError(f"{path}:{n}: not a JSON line ({why}); the log is damaged") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
                    what = "a record without a kind" if isinstance(rec, dict) else _kind(rec)
                    raise LogError(f"{path}:{n}: {what}, not a merger log record; the log is damaged")
                yield n, rec


def _kind(value: object) -> str:
    """A JSON value's kind, as JSON names it."""
    kinds = ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array"), (dict, "an object"))
    return next((name for cls, name in kinds if isinstance(value, cls)), "null")


def _shown(value: object) -> str:
    """A logged value as JSON, cut short."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_uint(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_UINT


def _uint(rec: dict[str, Any], key: str, default: int | None = None) -> int:
    """``rec[key]``, an integer the wire could carry (0 .. 2**64 - 1); ``ValueError`` if not."""
    value = rec.get(key, default)
    if not _is_uint(value):
        raise ValueError(f"{key} must be an integer in 0..2**64-1, got {_shown(value)}")
    return value


def _finite(rec: dict[str, Any], key: str, *, optional: bool = False) -> float:
    """``rec[key]``, a finite number (None allowed with ``optional``: then NaN is returned)."""
    value = rec.get(key)
    if value is None and optional:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {_shown(value)}")
    return float(value)


def _peer(value: object, key: str) -> bytes:
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        raise ValueError(f"{key} must be a peer id in hex, got {_shown(value)}")
    return bytes.fromhex(value)


class _Contents:
    """Recomputes a log's versions from its payload folder, with the owner's own merge code."""

    def __init__(self, folder: Path, spec: object) -> None:
        """Raises ``ValueError`` (or ``LocalProtocolError``, ``TypeError`` from the outer step's
        config) naming the field of ``spec`` that is not as an owner writes it."""
        if not isinstance(spec, dict):
            raise ValueError(f"content is {_kind(spec)}, not an object")
        self.folder = folder
        shapes = spec.get("shapes")
        if not (isinstance(shapes, list) and all(isinstance(s, list) and all(_is_uint(d) for d in s) for s in shapes)):
            raise ValueError("content.shapes is not a list of tensor shapes (lists of integers >= 0)")
        self.shapes = [tuple(s) for s in shapes]
        codec, embedding = spec.get("codec"), spec.get("embedding")
        if codec not in CODECS or not isinstance(embedding, bool):
            raise ValueError(f"content.codec must be one of {', '.join(CODECS)} and content.embedding true "
                             f"or false, got {_shown(codec)} and {_shown(embedding)}")
        self.codec, self.embedding = str(codec), embedding
        self.update_codec = spec.get("update_codec")
        if self.update_codec is not None and self.update_codec not in UPDATE_CODECS:
            raise ValueError(f"content.update_codec must be null or one of {', '.join(UPDATE_CODECS)}, "
                             f"got {_shown(self.update_codec)}")
        self.block_size = spec.get("block_size", 64)
        if not _is_uint(self.block_size) or self.block_size < 1:
            raise ValueError(f"content.block_size must be an integer >= 1, got {_shown(self.block_size)}")
        self.residual: torch.Tensor | None = None  # the owner's error feedback (updates)
        outer = spec.get("outer")
        if not isinstance(outer, dict):
            raise ValueError(f"content.outer is {_kind(outer)}, not an object")
        self.outer = OuterConfig(**outer)
        self.numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
        self.theta: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None] = {}
        self.missing: str | None = None  # set once something needed is not in the folder

    def _file(self, name: object) -> Path | None:
        """The payload folder's file ``name`` (None, and why in ``missing``, when it is not there);
        raises ``ValueError`` for a name that is not a file name there (a path, ``..``)."""
        if name is None:  # the owner kept nothing: the folder was full, or the disk
            self.missing = self.missing or "the payload folder stopped growing at its size cap"
            return None
        if (not isinstance(name, str) or not name or name.startswith(".") or "/" in name or "\\" in name
                or "\0" in name):
            raise ValueError(f"blob {_shown(name)} is not a file name in the payload folder (a path, or not "
                             "a name at all): refused, nothing read; the log is damaged or edited")
        path = self.folder / name
        if not path.is_file():
            self.missing = self.missing or f"{path} is missing"
            return None
        return path

    def load_state(self, name: object) -> None:
        path = self._file(name)
        self.theta = self.buffer = self.residual = None  # an owner starting a state starts with no residual
        if path is None:
            return
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path}: not a state (safetensors): {exc}") from None
        theta = tensors.get("theta")
        if theta is None or theta.numel() != self.numel:
            raise ValueError(f"{path}: not a state of this fragment ({self.numel} values)")
        self.theta, self.buffer = theta.float(), tensors.get("momentum")

    def payload(self, name: object) -> torch.Tensor | None:
        if name is None:
            self.missing = self.missing or "a contribution's payload was not kept"
            return None
        path = self._file(name)
        if path is None:
            return None
        try:
            msg = decode(bytearray(path.read_bytes()), max_size=MAX_PAYLOAD_MESSAGE)  # writable: tensors view it
        except RemoteProtocolError as exc:
            raise ValueError(f"{path}: not a contribution ({exc})") from None
        if not isinstance(msg, Contribution):
            raise ValueError(f"{path}: a {type(msg).__name__}, not a contribution")
        return flat_from_tensors(msg.tensors, self.shapes)

    def merge(self, version: int, decision: Decision) -> None:
        payloads = [e.payload for e in decision.entries]
        if self.theta is None or any(p is None for p in payloads):
            self.pending = {version: None}  # this version's contents, and all after it, are unknown
            return
        try:
            update = merge_update(self.theta, self.buffer, [p for p in payloads if isinstance(p, torch.Tensor)],
                                  [e.weight for e in decision.entries], [e.clip for e in decision.entries],
                                  self.outer, embedding=self.embedding, scale=decision.scale)
        except Exception:  # the owner failed this merge too; the log's merge_failed line follows
            self.pending = {version: None}
            return
        theta, residual = update.theta, self.residual
        if self.update_codec is not None:  # as the owner published it: the state its update gives
            _, theta, residual = encode_update(theta, self.theta, self.residual, self.shapes,
                                               self.update_codec, block_size=self.block_size)
        self.pending = {version: (theta, update.buffer, residual)}

    def digest(self, version: int) -> str | None:
        """The digest of ``version`` as recomputed (None when the contents are not all there)."""
        if version in self.pending:
            merged = self.pending.pop(version)
            self.theta, self.buffer, self.residual = merged if merged is not None else (None, None, None)
        if self.theta is None:
            return None
        return flat_digest(flat_from_tensors(encode_flat(self.theta, self.shapes, self.codec), self.shapes)).hex()


def replay(path: Path) -> ReplayResult:
    """Re-run every event of ``path`` through a fresh merger; report what differs. With the
    log's payload folder, every merge is recomputed too and each version's digest checked.

    Raises ``LogError`` (a ``ValueError``) for a file that is not a merger log, or a record an
    owner does not write: the line, what is wrong and what to do; ``EmptyLog`` for an empty file."""
    run = _Replay(path)
    threads = torch.get_num_threads()
    try:
        for n, rec in _records(path):
            run.records += 1
            try:
                if not run.feed(n, rec):
                    break
            except LogError:
                raise
            except _DAMAGE as exc:
                raise LogError(f"{path}:{n}: {run.why(rec['kind'], exc)}") from None
    finally:
        torch.set_num_threads(threads)
    if not run.records:
        raise EmptyLog(f"{path} holds no records: an owner's log starts with a start line; is this a merger log?")
    result, contents = run.result, run.contents
    if contents is not None and contents.missing is not None:
        result.unchecked = contents.missing
    return result


_EVENTS = ("contribution", "tick", "expect", "published", "merge_failed", "rebase")
# what a damaged record makes the replay raise: checked fields say what is wrong themselves; the
# rest (a merger refusing an event, a payload that does not fit) is named with the line
_DAMAGE = (ValueError, TypeError, KeyError, IndexError, OverflowError, RuntimeError, LocalProtocolError,
           RemoteProtocolError)


class _Replay:
    """One log's replay: a fresh merger fed each record (``feed``), what it decided, and the contents."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = 0
        self.result = ReplayResult()
        self.merger: FragmentMerger | None = None
        self.contents: _Contents | None = None
        self.merged_at: dict[int, list[list[Any]]] = {}

    def why(self, kind: str, exc: BaseException) -> str:
        """What is wrong at a line, in one line; where a merger refuses an event, where the replay
        diverged from the log before (an edited contribution is decided otherwise, then the log's
        next events do not fit the replayed merger)."""
        text = exc.reason if isinstance(exc, RemoteProtocolError) else str(exc)
        if isinstance(exc, KeyError):
            text = f"no {text} field"
        text = " ".join(text.split())[:300]
        first = next((m["line"] for m in self.result.mismatches if "line" in m), None)
        if isinstance(exc, LocalProtocolError) and first is not None:
            return (f"{kind} record: the replayed merger refuses it ({text}); the replay diverged from the log "
                    f"at line {first}: the log was edited, or written by another Atoll version")
        return f"{kind} record: {text}; the log is damaged or edited"

    def feed(self, n: int, rec: dict[str, Any]) -> bool:
        """Replay one record; False once the log says it was truncated."""
        kind = rec["kind"]
        if kind == "start":
            self._start(n, rec)
        elif kind == "version":
            self._version(n, rec)
        elif kind == "state":
            if self.contents is not None:
                self.contents.load_state(rec.get("blob"))
        elif kind == "truncated":
            self.result.mismatches.append({"line": n, "what": "the log was truncated at its size cap"})
            return False
        elif kind in _EVENTS:
            if self.merger is None:
                raise LogError(f"{self.path}:{n}: event before the log's start line; is this a merger log?")
            self._event(n, kind, rec, self.merger)
        elif kind != "payloads_full":
            raise LogError(f"{self.path}:{n}: unknown event {kind[:40]!r}; the log is damaged, or from a newer Atoll")
        return True

    def _start(self, n: int, rec: dict[str, Any]) -> None:
        if rec.get("format") != FORMAT:
            raise LogError(f"{self.path}:{n}: log format {_shown(rec.get('format'))}, this Atoll reads {FORMAT}")
        config = rec.get("config")
        if not isinstance(config, dict):
            raise ValueError(f"config is {_kind(config)}, not an object")
        self.merger = FragmentMerger(_uint(rec, "fragment"), MergeConfig(**config), version=_uint(rec, "version"),
                                     now=_finite(rec, "now"))
        if "content" in rec:
            self.contents = _Contents(payload_dir(self.path), rec["content"])
            threads = rec["content"].get("threads")
            if not (_is_uint(threads) and 1 <= threads <= MAX_REPLAY_THREADS):
                raise ValueError(f"content.threads must be an integer in 1..{MAX_REPLAY_THREADS}, "
                                 f"got {_shown(threads)}")
            torch.set_num_threads(threads)  # same reduction order
        else:
            self.result.unchecked = "the log has no contents (written without them)"

    def _version(self, n: int, rec: dict[str, Any]) -> None:
        v, digest = _uint(rec, "version"), rec.get("digest")
        if not isinstance(digest, str):
            raise ValueError(f"digest is {_kind(digest)}, not a string")
        replayed = self.contents.digest(v) if self.contents is not None else None
        self.result.versions.append({"version": v, "digest": digest, "merged": self.merged_at.get(v, []),
                                     "replayed": replayed})
        if replayed is not None and replayed != digest:
            self.result.mismatches.append({"line": n, "event": "version", "what": f"version {v}'s content differs",
                                           "logged": {"reason": digest}, "replayed": {"reason": replayed}})

    def _event(self, n: int, kind: str, rec: dict[str, Any], merger: FragmentMerger) -> None:
        now, logged = _finite(rec, "now"), rec.get("decision")
        if not isinstance(logged, dict):
            raise ValueError(f"decision is {_kind(logged)}, not an object")
        if kind == "contribution":
            peer, norm = _peer(rec.get("peer"), "peer"), _finite(rec, "norm", optional=True)
            fields = {k: _uint(rec, k) for k in ("base_version", "tokens", "steps")}
            step_time = _finite(rec, "step_time")
            payload = self.contents.payload(rec.get("payload")) if self.contents is not None else None
            d = merger.on_contribution(peer, **fields, step_time=step_time, payload=payload, now=now,
                                       norm=None if math.isnan(norm) else norm)
        elif kind == "tick":
            d = merger.on_tick(now)
        elif kind == "expect":
            expected = None if rec.get("n") is None else _uint(rec, "n")
            d = merger.set_expected(expected, now=now, finished=_uint(rec, "finished", 0))
        elif kind == "published":
            d = merger.on_published(_uint(rec, "version"), sync_time=_finite(rec, "sync_time"), now=now)
        elif kind == "merge_failed":
            reason, discard = rec.get("reason"), rec.get("discard")
            if not isinstance(reason, str) or not isinstance(discard, list):
                raise ValueError("reason must be a string and discard a list of peer ids")
            d = merger.on_merge_failed(reason, now=now, discard=[_peer(p, "discard") for p in discard])
        else:  # rebase
            d = merger.rebase(_uint(rec, "version"), now=now)
        self.result.decisions += 1
        got = _decision(d)
        if got != logged:
            self.result.mismatches.append({"line": n, "event": kind, "logged": logged, "replayed": got})
        if d.kind == "merge":
            self.merged_at[d.version + 1] = got["entries"]
            if self.contents is not None:
                self.contents.merge(d.version + 1, d)
