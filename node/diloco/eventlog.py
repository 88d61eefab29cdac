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
import threading
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from safetensors.torch import load_file, save_file

from node.diloco.flat import encode_flat, flat_digest, flat_from_tensors
from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig
from protocol.diloco.outer import OuterConfig, merge_update
from protocol.diloco.updates import encode_update
from protocol.errors import RemoteProtocolError
from protocol.wire.codec import decode, encode
from protocol.wire.messages import Contribution

__all__ = ["Content", "LoggedMerger", "ReplayResult", "payload_dir", "replay"]

log = logging.getLogger(__name__)

FORMAT = "atoll-merger-log/2"
MAX_LOG_BYTES = 256 << 20  # a log stops growing here (a line says so); the run goes on
MAX_PAYLOAD_BYTES = 1 << 30  # and its payload folder here (replay then checks decisions only)
MAX_PAYLOAD_MESSAGE = 1 << 31


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


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg}); the log is damaged") from None


class _Contents:
    """Recomputes a log's versions from its payload folder, with the owner's own merge code."""

    def __init__(self, folder: Path, spec: dict[str, Any]) -> None:
        self.folder = folder
        self.shapes = [tuple(int(d) for d in s) for s in spec["shapes"]]
        self.codec, self.embedding = str(spec["codec"]), bool(spec["embedding"])
        update_codec = spec.get("update_codec")
        self.update_codec = str(update_codec) if update_codec is not None else None
        self.block_size = int(spec.get("block_size", 64))
        self.residual: torch.Tensor | None = None  # the owner's error feedback (updates)
        self.outer = OuterConfig(**spec["outer"])
        self.numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
        self.theta: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None] = {}
        self.missing: str | None = None  # set once something needed is not in the folder

    def _file(self, name: object) -> Path | None:
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            self.missing = self.missing or "the payload folder stopped growing at its size cap"
            return None
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
        tensors = load_file(str(path))
        theta = tensors.get("theta")
        if theta is None or theta.numel() != self.numel:
            raise ValueError(f"{path}: not a state of this fragment ({self.numel} values)")
        self.theta, self.buffer = theta.float(), tensors.get("momentum")

    def payload(self, name: object) -> torch.Tensor | None:
        path = self._file(name) if name is not None else None
        if path is None:
            if name is None:
                self.missing = self.missing or "a contribution's payload was not kept"
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

    Raises ``ValueError`` for a file that is not a merger log (with what to do)."""
    result = ReplayResult()
    merger: FragmentMerger | None = None
    contents: _Contents | None = None
    merged_at: dict[int, list[list[Any]]] = {}
    threads = torch.get_num_threads()
    try:
        for n, rec in _records(path):
            kind = rec.get("kind")
            if kind == "start":
                if rec.get("format") != FORMAT:
                    raise ValueError(f"{path}:{n}: log format {rec.get('format')!r}, this Atoll reads {FORMAT}")
                merger = FragmentMerger(int(rec["fragment"]), MergeConfig(**rec["config"]),
                                        version=int(rec["version"]), now=float(rec["now"]))
                if "content" in rec:
                    contents = _Contents(payload_dir(path), rec["content"])
                    torch.set_num_threads(int(rec["content"]["threads"]))  # same reduction order
                else:
                    result.unchecked = "the log has no contents (written without them)"
                continue
            if kind == "version":
                v = int(rec["version"])
                replayed = contents.digest(v) if contents is not None else None
                result.versions.append({"version": v, "digest": rec["digest"], "merged": merged_at.get(v, []),
                                        "replayed": replayed})
                if replayed is not None and replayed != rec["digest"]:
                    result.mismatches.append({"line": n, "event": "version", "what": f"version {v}'s content differs",
                                              "logged": {"reason": rec["digest"]}, "replayed": {"reason": replayed}})
                continue
            if kind == "state":
                if contents is not None:
                    contents.load_state(rec["blob"])
                continue
            if kind == "payloads_full":
                continue
            if kind == "truncated":
                result.mismatches.append({"line": n, "what": "the log was truncated at its size cap"})
                break
            if merger is None:
                raise ValueError(f"{path}:{n}: event before the log's start line; is this a merger log?")
            now = float(rec["now"])
            if kind == "contribution":
                payload = contents.payload(rec.get("payload")) if contents is not None else None
                d = merger.on_contribution(bytes.fromhex(rec["peer"]), base_version=rec["base_version"],
                                           tokens=rec["tokens"], steps=rec["steps"], step_time=rec["step_time"],
                                           payload=payload, now=now, norm=rec["norm"])
            elif kind == "tick":
                d = merger.on_tick(now)
            elif kind == "expect":
                d = merger.set_expected(rec["n"], now=now, finished=rec.get("finished", 0))
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
                if contents is not None:
                    contents.merge(d.version + 1, d)
    finally:
        torch.set_num_threads(threads)
    if contents is not None and contents.missing is not None:
        result.unchecked = contents.missing
    return result
