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
one logged: the tool for "why was my contribution late?" (``atoll replay LOG``). It lives in
``node.diloco.eventlog_replay`` (the format both share in ``eventlog_format``) and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from safetensors.torch import save_file

from node.diloco.eventlog_format import FORMAT, _decision, payload_dir
from node.diloco.eventlog_replay import EmptyLog, LogError, ReplayResult, replay
from node.diloco.flat import flat_digest
from protocol.diloco.agreement import Agreement, AgreementConfig
from protocol.diloco.merge import Decision, FragmentMerger, MergeConfig
from protocol.diloco.outer import OuterConfig
from protocol.diloco.reference import HandedNorm, as_history
from protocol.wire.codec import encode
from protocol.wire.messages import Contribution

__all__ = [
    "Content",
    "EmptyLog",
    "LogError",
    "LoggedMerger",
    "ReplayResult",
    "payload_dir",
    "replay",
]

log = logging.getLogger(__name__)

MAX_LOG_BYTES = 256 << 20  # a log stops growing here (a line says so); the run goes on
MAX_PAYLOAD_BYTES = 1 << 30  # and its payload folder here (replay then checks decisions only)


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


class LoggedMerger:
    """A ``FragmentMerger`` whose every call is written to ``path`` (JSON lines)."""

    def __init__(
        self,
        merger: FragmentMerger,
        path: Path,
        *,
        fragment: int,
        config: MergeConfig,
        version: int,
        now: float,
        content: Content | None = None,
    ) -> None:
        """With ``content``, contributions and states are kept too (see the module docstring)."""
        self.merger = merger
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = path.open("a", encoding="utf-8")
        self._written = 0
        self._lock = threading.Lock()
        self._payloads = payload_dir(path) if content is not None else None
        self._payload_bytes = 0
        self._next_payload: str | None = None
        self._learners: frozenset[bytes] | None = None  # as last logged: written when it changes
        start: dict[str, Any] = {
            "kind": "start",
            "format": FORMAT,
            "fragment": fragment,
            "version": version,
            "now": now,
            "config": dataclasses.asdict(config),
        }
        if content is not None:
            start["content"] = {
                "shapes": [list(s) for s in content.shapes],
                "codec": content.download_codec,
                "outer": dataclasses.asdict(content.outer),
                "embedding": content.embedding,
                "update_codec": content.update_codec,
                "block_size": content.block_size,
                "threads": torch.get_num_threads(),
            }
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
            log.warning(
                "event log: cannot keep %s (%s); contents are no longer logged", target, exc
            )
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
        self._next_payload = self._keep(
            h.hexdigest() + ".msg", lambda t: t.write_bytes(encoded.tobytes()), encoded.size
        )

    def note_state(self, theta: torch.Tensor, momentum: torch.Tensor | None) -> None:
        """The global fragment (and momentum) this owner starts from or takes over now."""
        tensors = {"theta": theta.detach().float().contiguous()}
        if momentum is not None:
            tensors["momentum"] = momentum.detach().float().contiguous()
        h = hashlib.sha256()
        for key, t in tensors.items():
            h.update(key.encode())
            h.update(flat_digest(t))
        name = self._keep(
            h.hexdigest() + ".safetensors",
            lambda t: save_file(tensors, str(t)),
            sum(t.numel() * 4 for t in tensors.values()),
        )
        self._write({"kind": "state", "blob": name})

    def on_contribution(
        self,
        peer: bytes,
        *,
        base_version: int,
        tokens: int,
        steps: int,
        step_time: float,
        payload: object,
        now: float,
        norm: float | None = None,
        last: bool = False,
    ) -> Decision:
        d = self.merger.on_contribution(
            peer,
            base_version=base_version,
            tokens=tokens,
            steps=steps,
            step_time=step_time,
            payload=payload,
            now=now,
            norm=norm,
            last=last,
        )
        kept, self._next_payload = self._next_payload, None
        rec: dict[str, Any] = {
            "kind": "contribution",
            "peer": peer.hex(),
            "base_version": base_version,
            "tokens": tokens,
            "steps": steps,
            "step_time": step_time,
            "norm": norm,
            "now": now,
            "payload": kept,
        }
        if last:  # absent in logs written before learners marked their last contribution
            rec["last"] = True
        return self._log(rec, d)

    def on_tick(self, now: float) -> Decision:
        return self._log({"kind": "tick", "now": now}, self.merger.on_tick(now))

    def set_expected(
        self,
        n: int | None,
        *,
        now: float,
        finished: int = 0,
        learners: frozenset[bytes] | None = None,
    ) -> Decision:
        rec: dict[str, Any] = {"kind": "expect", "n": n, "now": now}
        if finished:  # absent in logs written before learners that finished were counted
            rec["finished"] = finished
        d = self.merger.set_expected(n, now=now, finished=finished, learners=learners)
        if learners != self._learners:  # absent: as the last expect record that had it (or None)
            rec["learners"] = None if learners is None else sorted(p.hex() for p in learners)
            self._learners = learners
        return self._log(rec, d)

    def on_published(self, new_version: int, *, sync_time: float, now: float) -> Decision:
        d = self.merger.on_published(new_version, sync_time=sync_time, now=now)
        return self._log(
            {"kind": "published", "version": new_version, "sync_time": sync_time, "now": now}, d
        )

    def on_merge_failed(
        self, reason: str, *, now: float, discard: Collection[bytes] = ()
    ) -> Decision:
        d = self.merger.on_merge_failed(reason, now=now, discard=discard)
        return self._log(
            {
                "kind": "merge_failed",
                "reason": reason,
                "discard": sorted(p.hex() for p in discard),
                "now": now,
            },
            d,
        )

    def rebase(self, version: int, *, now: float) -> Decision:
        return self._log(
            {"kind": "rebase", "version": version, "now": now}, self.merger.rebase(version, now=now)
        )

    def hold_until(self, until: float, *, now: float) -> Decision:
        return self._log(
            {"kind": "hold", "until": until, "now": now}, self.merger.hold_until(until, now=now)
        )

    def drop_round(self, reason: str, *, now: float) -> Decision:
        return self._log(
            {"kind": "drop", "reason": reason, "now": now}, self.merger.drop_round(reason, now=now)
        )

    def seed_reference(self, norms: Collection[HandedNorm | float]) -> None:
        """``FragmentMerger.seed_reference``, logged so that replay starts from the same history
        (``senders``: each norm's sender in hex, "" when anonymous)."""
        self.merger.seed_reference(norms)
        pairs = as_history(norms)
        self._write(
            {
                "kind": "reference",
                "norms": [x for _, x in pairs],
                "senders": [p.hex() if p else "" for p, _ in pairs],
            }
        )

    def note_version(self, version: int, digest: bytes) -> None:
        """The content digest of a version this owner published (or took over)."""
        self._write({"kind": "version", "version": version, "digest": digest.hex()})

    def note_validation(self, record: dict[str, Any]) -> None:
        """A check of a candidate version (``node.diloco.validation.Check.record``): replay redraws
        its windows from the logged seed and recomputes its verdict from the logged losses."""
        self._write(record)

    def note_agreement(self, version: int, verdict: Agreement, config: AgreementConfig) -> None:
        """How each contribution of the merge to be published as ``version`` agreed with the
        round's others (``protocol.diloco.agreement``): replay recomputes the dissent from the
        logged medians and, from the kept contributions, the medians."""
        self._write(
            {
                "kind": "agreement",
                "version": version,
                "peers": [p.hex() for p in verdict.peers],
                "medians": list(verdict.medians),
                "level": verdict.level,
                "dissent": sorted(p.hex() for p in verdict.dissent),
                "config": dataclasses.asdict(config),
            }
        )

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
