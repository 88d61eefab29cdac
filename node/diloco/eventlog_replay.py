"""Reading a merger log back: ``replay`` re-runs its events through a fresh ``FragmentMerger``,
recomputes its versions from the payload folder, and refuses a damaged log in one line
(``LogError``, ``EmptyLog``). The log itself is written by ``node.diloco.eventlog``."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from node.diloco.eventlog_format import FORMAT, _decision, payload_dir
from node.diloco.flat import encode_flat, flat_digest, flat_from_tensors
from node.diloco.validation import recheck
from protocol.diloco.agreement import AgreementConfig, gram, judge, medians
from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig
from protocol.diloco.outer import OuterConfig, merge_update
from protocol.diloco.updates import encode_update
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.wire.codec import decode
from protocol.wire.messages import Contribution
from protocol.wire.tensors import CODECS, UPDATE_CODECS

__all__ = ["EmptyLog", "LogError", "ReplayResult", "replay"]

MAX_PAYLOAD_MESSAGE = 1 << 31
MAX_REPLAY_THREADS = (
    1024  # a log's thread count past this is damage (10**6 ran libgomp out of memory)
)
MAX_UINT = (1 << 64) - 1  # the wire's integers (msgpack uint64): versions, tokens, steps
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")


@dataclasses.dataclass
class ReplayResult:
    decisions: int = 0
    versions: list[dict[str, Any]] = dataclasses.field(
        default_factory=list
    )  # {version, digest, merged, replayed}
    mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unchecked: str | None = None  # why version contents were not (all) recomputed
    validations: int = 0  # candidate checks recomputed (``node.diloco.validation.recheck``)
    agreements: int = 0  # agreement verdicts recomputed (``protocol.diloco.agreement``)

    @property
    def contents_checked(self) -> int:
        return sum(v["replayed"] is not None for v in self.versions)

    def to_json(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "versions": self.versions,
            "contents_checked": self.contents_checked,
            "validations": self.validations,
            "agreements": self.agreements,
            "unchecked": self.unchecked,
            "mismatches": self.mismatches,
        }


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
                    raise LogError(
                        f"{path}:{n}: not a JSON line ({why}); the log is damaged"
                    ) from None
                if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
                    what = "a record without a kind" if isinstance(rec, dict) else _kind(rec)
                    raise LogError(
                        f"{path}:{n}: {what}, not a merger log record; the log is damaged"
                    )
                yield n, rec


def _kind(value: object) -> str:
    """A JSON value's kind, as JSON names it."""
    kinds = (
        (bool, "a boolean"),
        (int | float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    )
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


def _learners(value: object) -> frozenset[bytes] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"learners is {_kind(value)}, not a list of peer ids")
    return frozenset(_peer(p, "learners") for p in value)


class _Contents:
    """Recomputes a log's versions from its payload folder, with the owner's own merge code."""

    def __init__(self, folder: Path, spec: object) -> None:
        """Raises ``ValueError`` (or ``LocalProtocolError``, ``TypeError`` from the outer step's
        config) naming the field of ``spec`` that is not as an owner writes it."""
        if not isinstance(spec, dict):
            raise ValueError(f"content is {_kind(spec)}, not an object")
        self.folder = folder
        shapes = spec.get("shapes")
        if not (
            isinstance(shapes, list)
            and all(isinstance(s, list) and all(_is_uint(d) for d in s) for s in shapes)
        ):
            raise ValueError(
                "content.shapes is not a list of tensor shapes (lists of integers >= 0)"
            )
        self.shapes = [tuple(s) for s in shapes]
        codec, embedding = spec.get("codec"), spec.get("embedding")
        if codec not in CODECS or not isinstance(embedding, bool):
            raise ValueError(
                f"content.codec must be one of {', '.join(CODECS)} and content.embedding true "
                f"or false, got {_shown(codec)} and {_shown(embedding)}"
            )
        self.codec, self.embedding = str(codec), embedding
        self.update_codec = spec.get("update_codec")
        if self.update_codec is not None and self.update_codec not in UPDATE_CODECS:
            raise ValueError(
                f"content.update_codec must be null or one of {', '.join(UPDATE_CODECS)}, "
                f"got {_shown(self.update_codec)}"
            )
        self.block_size = spec.get("block_size", 64)
        if not _is_uint(self.block_size) or self.block_size < 1:
            raise ValueError(
                f"content.block_size must be an integer >= 1, got {_shown(self.block_size)}"
            )
        self.residual: torch.Tensor | None = None  # the owner's error feedback (updates)
        outer = spec.get("outer")
        if not isinstance(outer, dict):
            raise ValueError(f"content.outer is {_kind(outer)}, not an object")
        self.outer = OuterConfig(**outer)
        self.numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
        self.theta: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None
        self.pending: dict[
            int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None
        ] = {}
        self.missing: str | None = None  # set once something needed is not in the folder

    def _file(self, name: object) -> Path | None:
        """The payload folder's file ``name`` (None, and why in ``missing``, when it is not there);
        raises ``ValueError`` for a name that is not a file name there (a path, ``..``)."""
        if name is None:  # the owner kept nothing: the folder was full, or the disk
            self.missing = self.missing or "the payload folder stopped growing at its size cap"
            return None
        if (
            not isinstance(name, str)
            or not name
            or name.startswith(".")
            or "/" in name
            or "\\" in name
            or "\0" in name
        ):
            raise ValueError(
                f"blob {_shown(name)} is not a file name in the payload folder (a path, or not "
                "a name at all): refused, nothing read; the log is damaged or edited"
            )
        path = self.folder / name
        if not path.is_file():
            self.missing = self.missing or f"{path} is missing"
            return None
        return path

    def load_state(self, name: object) -> None:
        path = self._file(name)
        self.theta = self.buffer = self.residual = (
            None  # an owner starting a state starts with no residual
        )
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
            msg = decode(
                bytearray(path.read_bytes()), max_size=MAX_PAYLOAD_MESSAGE
            )  # writable: tensors view it
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
            update = merge_update(
                self.theta,
                self.buffer,
                [p for p in payloads if isinstance(p, torch.Tensor)],
                [e.weight for e in decision.entries],
                [e.clip for e in decision.entries],
                self.outer,
                embedding=self.embedding,
                scale=decision.scale,
                aggregate=decision.aggregate(self.outer.aggregate),
            )
        except Exception:  # the owner failed this merge too; the log's merge_failed line follows
            self.pending = {version: None}
            return
        theta, residual = update.theta, self.residual
        if self.update_codec is not None:  # as the owner published it: the state its update gives
            _, theta, residual = encode_update(
                theta,
                self.theta,
                self.residual,
                self.shapes,
                self.update_codec,
                block_size=self.block_size,
            )
        self.pending = {version: (theta, update.buffer, residual)}

    def digest(self, version: int) -> str | None:
        """The digest of ``version`` as recomputed (None when the contents are not all there)."""
        if version in self.pending:
            merged = self.pending.pop(version)
            self.theta, self.buffer, self.residual = (
                merged if merged is not None else (None, None, None)
            )
        if self.theta is None:
            return None
        return flat_digest(
            flat_from_tensors(encode_flat(self.theta, self.shapes, self.codec), self.shapes)
        ).hex()


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
        raise EmptyLog(
            f"{path} holds no records: an owner's log starts with a start line; is this a merger log?"
        )
    result, contents = run.result, run.contents
    if contents is not None and contents.missing is not None:
        result.unchecked = contents.missing
    return result


_EVENTS = ("contribution", "tick", "expect", "published", "merge_failed", "rebase", "hold", "drop")
# what a damaged record makes the replay raise: checked fields say what is wrong themselves; the
# rest (a merger refusing an event, a payload that does not fit) is named with the line
_DAMAGE = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    RuntimeError,
    LocalProtocolError,
    RemoteProtocolError,
)


class _Replay:
    """One log's replay: a fresh merger fed each record (``feed``), what it decided, and the contents."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = 0
        self.result = ReplayResult()
        self.merger: FragmentMerger | None = None
        self.learners: frozenset[bytes] | None = None  # the expected learners as last logged
        self.contents: _Contents | None = None
        self.merged_at: dict[int, list[list[Any]]] = {}
        self.last_merge: tuple[int, list[tuple[bytes, object]]] | None = None  # version, work

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
            return (
                f"{kind} record: the replayed merger refuses it ({text}); the replay diverged from the log "
                f"at line {first}: the log was edited, or written by another Atoll version"
            )
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
        elif kind == "reference":  # a history handed over or measured at the owner's start
            norms = rec.get("norms")
            senders = rec.get("senders", [""] * len(norms) if isinstance(norms, list) else None)
            if (
                self.merger is None
                or not isinstance(norms, list)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in norms)
                or not isinstance(senders, list)
                or len(senders) != len(norms)
                or not all(
                    isinstance(p, str) and re.fullmatch(r"([0-9a-f]{2})*", p) for p in senders
                )
            ):
                raise ValueError(
                    "a reference record needs a start line before it, a list of numbers and "
                    "as many senders (hex, or empty)"
                )
            # older logs name no senders: every norm was anonymous then
            self.merger.seed_reference(
                [(bytes.fromhex(p) or None, float(x)) for p, x in zip(senders, norms, strict=True)]
            )
        elif kind == "validation":  # a candidate's check: the same windows and verdict again
            self.result.validations += 1
            for what in recheck(rec):
                self.result.mismatches.append({"line": n, "event": "validation", "what": what})
        elif kind == "agreement":  # who dissented: from the logged medians, and from the contents
            self.result.agreements += 1
            for what in recheck_agreement(rec, self.last_merge):
                self.result.mismatches.append({"line": n, "event": "agreement", "what": what})
        elif kind == "truncated":
            self.result.mismatches.append(
                {"line": n, "what": "the log was truncated at its size cap"}
            )
            return False
        elif kind in _EVENTS:
            if self.merger is None:
                raise LogError(
                    f"{self.path}:{n}: event before the log's start line; is this a merger log?"
                )
            self._event(n, kind, rec, self.merger)
        elif kind != "payloads_full":
            raise LogError(
                f"{self.path}:{n}: unknown event {kind[:40]!r}; the log is damaged, or from a newer Atoll"
            )
        return True

    def _start(self, n: int, rec: dict[str, Any]) -> None:
        if rec.get("format") != FORMAT:
            raise LogError(
                f"{self.path}:{n}: log format {_shown(rec.get('format'))}, this Atoll reads {FORMAT}"
            )
        config = rec.get("config")
        if not isinstance(config, dict):
            raise ValueError(f"config is {_kind(config)}, not an object")
        self.merger = FragmentMerger(
            _uint(rec, "fragment"),
            MergeConfig(**config),
            version=_uint(rec, "version"),
            now=_finite(rec, "now"),
        )
        if "content" in rec:
            self.contents = _Contents(payload_dir(self.path), rec["content"])
            threads = rec["content"].get("threads")
            if not (_is_uint(threads) and 1 <= threads <= MAX_REPLAY_THREADS):
                raise ValueError(
                    f"content.threads must be an integer in 1..{MAX_REPLAY_THREADS}, "
                    f"got {_shown(threads)}"
                )
            torch.set_num_threads(threads)  # same reduction order
        else:
            self.result.unchecked = "the log has no contents (written without them)"

    def _version(self, n: int, rec: dict[str, Any]) -> None:
        v, digest = _uint(rec, "version"), rec.get("digest")
        if not isinstance(digest, str):
            raise ValueError(f"digest is {_kind(digest)}, not a string")
        replayed = self.contents.digest(v) if self.contents is not None else None
        self.result.versions.append(
            {
                "version": v,
                "digest": digest,
                "merged": self.merged_at.get(v, []),
                "replayed": replayed,
            }
        )
        if replayed is not None and replayed != digest:
            self.result.mismatches.append(
                {
                    "line": n,
                    "event": "version",
                    "what": f"version {v}'s content differs",
                    "logged": {"reason": digest},
                    "replayed": {"reason": replayed},
                }
            )

    def _event(self, n: int, kind: str, rec: dict[str, Any], merger: FragmentMerger) -> None:
        now, logged = _finite(rec, "now"), rec.get("decision")
        if not isinstance(logged, dict):
            raise ValueError(f"decision is {_kind(logged)}, not an object")
        if kind == "contribution":
            peer, norm = _peer(rec.get("peer"), "peer"), _finite(rec, "norm", optional=True)
            fields = {k: _uint(rec, k) for k in ("base_version", "tokens", "steps")}
            step_time = _finite(rec, "step_time")
            payload = (
                self.contents.payload(rec.get("payload")) if self.contents is not None else None
            )
            last = rec.get("last", False)
            if not isinstance(last, bool):
                raise ValueError(f"last is {_kind(last)}, not a boolean")
            d = merger.on_contribution(
                peer,
                **fields,
                step_time=step_time,
                payload=payload,
                now=now,
                norm=None if math.isnan(norm) else norm,
                last=last,
            )
        elif kind == "tick":
            d = merger.on_tick(now)
        elif kind == "expect":
            expected = None if rec.get("n") is None else _uint(rec, "n")
            if "learners" in rec:  # absent: unchanged since the last expect record that had it
                self.learners = _learners(rec.get("learners"))
            d = merger.set_expected(
                expected, now=now, finished=_uint(rec, "finished", 0), learners=self.learners
            )
        elif kind == "published":
            d = merger.on_published(
                _uint(rec, "version"), sync_time=_finite(rec, "sync_time"), now=now
            )
        elif kind == "merge_failed":
            reason, discard = rec.get("reason"), rec.get("discard")
            if not isinstance(reason, str) or not isinstance(discard, list):
                raise ValueError("reason must be a string and discard a list of peer ids")
            d = merger.on_merge_failed(
                reason, now=now, discard=[_peer(p, "discard") for p in discard]
            )
        elif kind == "hold":
            d = merger.hold_until(_finite(rec, "until"), now=now)
        elif kind == "drop":
            reason = rec.get("reason")
            if not isinstance(reason, str):
                raise ValueError(f"reason is {_kind(reason)}, not a string")
            d = merger.drop_round(reason, now=now)
        else:  # rebase
            d = merger.rebase(_uint(rec, "version"), now=now)
        self.result.decisions += 1
        got = _decision(d)
        if got != logged:
            self.result.mismatches.append(
                {"line": n, "event": kind, "logged": logged, "replayed": got}
            )
        if d.kind == "merge":
            self.merged_at[d.version + 1] = got["entries"]
            self.last_merge = (d.version + 1, [(e.peer, e.payload) for e in d.entries])
            if self.contents is not None:
                self.contents.merge(d.version + 1, d)


AGREEMENT_TOLERANCE = 1e-6  # a recomputed cosine may differ in its last bits (BLAS threads)


def recheck_agreement(
    rec: dict[str, Any], last_merge: tuple[int, list[tuple[bytes, object]]] | None
) -> list[str]:
    """What differs between a logged agreement verdict and the one recomputed: from the logged
    medians under the logged config, and, when the replayed merge of that version has every
    contribution's contents, the medians themselves. Raises ``ValueError`` for a damaged record."""
    config = rec.get("config")
    peers, values, dissent = rec.get("peers"), rec.get("medians"), rec.get("dissent")
    if not (
        isinstance(config, dict)
        and isinstance(peers, list)
        and isinstance(values, list)
        and isinstance(dissent, list)
        and len(peers) == len(values)
        and all(
            v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values
        )
    ):
        raise ValueError("an agreement record needs a config, and as many peers as medians")
    ids = [_peer(p, "peers") for p in peers]
    verdict = judge(ids, values, AgreementConfig(**config))
    out = []
    if sorted(p.hex() for p in verdict.dissent) != sorted(dissent):
        out.append(f"version {rec.get('version')}: dissent recomputed as {verdict.reason}")
    if last_merge is None or last_merge[0] != rec.get("version"):
        return out
    work = last_merge[1]
    if [p for p, _ in work] != ids or not all(isinstance(t, torch.Tensor) for _, t in work):
        return out  # contents not all kept: the medians are checked from the log only
    if all(v is None for v in values):
        return out  # too few senders: none were measured
    again = medians(ids, gram([t for _, t in work if isinstance(t, torch.Tensor)]))
    for peer, logged, got in zip(ids, values, again, strict=True):
        if (logged is None) != (got is None) or (
            logged is not None and got is not None and abs(logged - got) > AGREEMENT_TOLERANCE
        ):
            out.append(
                f"version {rec.get('version')}: {peer.hex()[:8]}'s median cosine recomputed as "
                f"{got}, logged {logged}"
            )
    return out
