"""Owner checkpoints: the state of every fragment this peer owns, on disk, so a peer killed with
``kill -9`` resumes its ownership with the versions (and outer momentum) it held.

One file per fragment, ``owner-fragment<p>.safetensors``, written with ``save_checkpoint``
(temporary file, fsync, rename; never pickle): the global fragment and the Nesterov buffer, and
in its JSON the swarm, fragment, epoch, version, the version's digest and the work merged into it
(``ReplicaState`` on disk), with the merger's clip reference (``norm_history``) and the
standing per sender key (``standing``: [peer id hex, score] pairs), so an owner that resumes
does not start without them; either malformed is refused alone (the state is still taken). A write happens after a publication, at most once per ``min_gap_s``
per fragment (the newest state wins; a publication inside the gap is written when the gap ends),
off the event loop.

At start the peer loads them as if its own replica had been handed them: an owner starts from
a loaded state only when it is not behind the newest version the swarm serves (``_start_owner``),
so a checkpoint can never take the model back. A truncated, corrupt or foreign file is refused
with the reason and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from node.diloco.replica import Carried, Handed
from node.state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from protocol.diloco.reference import HandedNorm, as_history
from protocol.wire.messages import MAX_NORM_HISTORY, MAX_STANDING, PEER_ID_BYTES

__all__ = ["OwnerCheckpoints"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"owner-fragment(\d{1,6})\.safetensors")
MIN_GAP_S = 5.0


def _is_count(value: object) -> bool:
    """A JSON integer a version or epoch can be (not a bool, a float, or past 2^63)."""
    return type(value) is int and 0 <= value < 1 << 63


def _count(meta: dict[str, object], name: str) -> int:
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"{name} {str(value)[:40]!r} is not an integer in [0, 2^63)")
    return value


def _carried(meta: dict[str, object], path: Path) -> Carried:
    """The clip reference and standing a checkpoint holds (absent in older ones). Either that is
    malformed is refused alone, with the reason logged: the state itself is still good."""
    norms: tuple[HandedNorm, ...] = ()
    peers: tuple[bytes, ...] = ()
    scores: tuple[float, ...] = ()
    raw = meta.get("norm_history", [])
    # each norm's sender in hex ("": anonymous); absent in older checkpoints: all anonymous
    senders = meta.get("norm_senders", [""] * len(raw) if isinstance(raw, list) else None)
    if (
        isinstance(raw, list)
        and len(raw) <= MAX_NORM_HISTORY
        and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in raw)
        and isinstance(senders, list)
        and len(senders) == len(raw)
        and all(
            isinstance(p, str) and re.fullmatch(f"|[0-9a-f]{{{2 * PEER_ID_BYTES}}}", p)
            for p in senders
        )
    ):
        norms = tuple(
            (bytes.fromhex(p) or None, float(x)) for p, x in zip(senders, raw, strict=True)
        )
    else:
        log.warning(
            "owner checkpoint %s: norm_history refused (not a list of at most %d finite norms >= 0, "
            "with as many senders); "
            "the owner measures its reference instead",
            path,
            MAX_NORM_HISTORY,
        )
    raw = meta.get("standing", [])
    try:
        if not isinstance(raw, list) or len(raw) > MAX_STANDING:
            raise ValueError(f"not a list of at most {MAX_STANDING} entries")
        pairs = [
            (bytes.fromhex(e[0]), float(e[1]))
            for e in raw
            if isinstance(e, list)
            and len(e) == 2
            and isinstance(e[0], str)
            and type(e[1]) in (int, float)
        ]
        if len(pairs) != len(raw) or not all(
            len(k) == PEER_ID_BYTES and math.isfinite(v) for k, v in pairs
        ):
            raise ValueError("entries must be [peer id hex, finite score]")
        peers, scores = tuple(k for k, _ in pairs), tuple(v for _, v in pairs)
    except (ValueError, OverflowError) as exc:
        log.warning(
            "owner checkpoint %s: standing refused (%s); the owner starts with none", path, exc
        )
    return norms, (peers, scores)


class OwnerCheckpoints:
    """Writes and reads the owner checkpoints of one peer in ``folder``."""

    def __init__(
        self,
        folder: Path,
        swarm: str,
        numels: Sequence[int],
        *,
        min_gap_s: float = MIN_GAP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder, self.swarm, self.numels = Path(folder), swarm, list(numels)
        self.min_gap_s, self.clock = min_gap_s, clock
        self.folder.mkdir(parents=True, exist_ok=True)
        self._last: dict[int, float] = {}
        self._pending: dict[int, Handed] = {}
        self._waiting: set[int] = set()
        self.written = 0
        self.failed = 0

    def path(self, p: int) -> Path:
        return self.folder / f"owner-fragment{p}.safetensors"

    def offer(self, state: Handed) -> None:
        """Note a newly published state; it is written now or when this fragment's gap ends
        (call from the event loop)."""
        p = state.fragment
        self._pending[p] = state
        if p in self._waiting:
            return
        self._waiting.add(p)
        delay = max(0.0, self._last.get(p, -1e18) + self.min_gap_s - self.clock())
        asyncio.get_running_loop().call_later(delay, lambda: asyncio.ensure_future(self._write(p)))

    async def _write(self, p: int) -> None:
        self._waiting.discard(p)
        state = self._pending.pop(p, None)
        if state is None:
            return
        self._last[p] = self.clock()
        try:
            await asyncio.to_thread(self.save, state)
        except (OSError, ValueError) as exc:  # a full disk stops checkpoints, never the owner
            self.failed += 1
            log.warning("fragment %d: owner checkpoint not written: %s", p, exc)

    def save(self, state: Handed) -> Path:
        """Write one fragment's state now (blocking)."""
        tensors = {"theta": state.theta.detach().float().contiguous()}
        if state.momentum is not None:
            tensors["momentum"] = state.momentum.detach().float().contiguous()
        meta = {
            "kind": "atoll-owner",
            "swarm": self.swarm,
            "fragment": state.fragment,
            "epoch": state.epoch,
            "version": state.version,
            "digest": state.digest.hex(),
            "merged": [[peer.hex(), base] for peer, base in state.merged.items()],
            "norm_history": [x for _, x in as_history(state.norms)],
            "norm_senders": [p.hex() if p else "" for p, _ in as_history(state.norms)],
            "standing": [[peer.hex(), score] for peer, score in zip(*state.standing, strict=True)],
        }
        path = self.path(state.fragment)
        save_checkpoint(path, tensors, meta)
        self.written += 1
        return path

    def load(self) -> dict[int, Handed]:
        """Every valid owner checkpoint in the folder (refused ones are logged and skipped)."""
        found: dict[int, Handed] = {}
        for path in sorted(self.folder.iterdir()):
            m = _NAME.fullmatch(path.name)
            if m is None:
                continue
            try:
                found[int(m.group(1))] = self._load(path, int(m.group(1)))
            except (
                CheckpointError,
                ValueError,
                KeyError,
                TypeError,
                OverflowError,
                AttributeError,
                RecursionError,
                OSError,
            ) as exc:  # any parse error of a file we did not write: skip it, never fail to start
                log.warning(
                    "owner checkpoint %s refused: %s; this fragment starts from the swarm's version",
                    path,
                    exc,
                )
        return found

    def _load(self, path: Path, p: int) -> Handed:
        if not 0 <= p < len(self.numels):
            raise ValueError(
                f"fragment {p} is not in this swarm's plan ({len(self.numels)} fragments)"
            )
        tensors, meta = load_checkpoint(path)
        if (
            meta.get("kind") != "atoll-owner"
            or meta.get("swarm") != self.swarm
            or meta.get("fragment") != p
        ):
            raise ValueError(
                f"written for swarm {meta.get('swarm')!r} fragment {meta.get('fragment')!r}, "
                f"not {self.swarm!r} fragment {p}"
            )
        theta, momentum = tensors.get("theta"), tensors.get("momentum")
        if set(tensors) - {"theta", "momentum"} or theta is None:
            raise ValueError(f"holds tensors {sorted(tensors)}, expected theta (and momentum)")
        for name, t in (("theta", theta), ("momentum", momentum)):
            if t is not None and (t.dtype != torch.float32 or t.shape != (self.numels[p],)):
                raise ValueError(
                    f"{name} is {t.dtype} {tuple(t.shape)}, expected float32 ({self.numels[p]},)"
                )
        epoch, version = _count(meta, "epoch"), _count(meta, "version")
        digest = bytes.fromhex(meta["digest"]) if isinstance(meta.get("digest"), str) else b""
        if len(digest) != 32:
            raise ValueError(f"digest of {len(digest)} bytes, expected 32 in hex")
        pairs = meta.get("merged")
        if not isinstance(pairs, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and _is_count(e[1])
            for e in pairs
        ):
            raise ValueError("merged must be a list of [peer id hex, base version] pairs")
        merged = {bytes.fromhex(peer): int(base) for peer, base in pairs}
        norms, standing = _carried(meta, path)
        return Handed(
            p, epoch, version, digest, theta, momentum, b"", merged, norms=norms, standing=standing
        )
