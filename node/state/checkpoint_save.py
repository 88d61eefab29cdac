"""Writing one checkpoint file atomically: hashed as it is written, then fsynced and renamed.

``save_checkpoint`` writes the tensors under a hidden temporary name, each in <= ``CHUNK``
slices hashed as they go, then the header (with the digest) into the space reserved for it,
fsyncs, renames over the final name and fsyncs the directory (the format and the crash
guarantees: ``node.state.checkpoint``).

``begin_checkpoint`` splits that in two for a writer that runs beside the code changing the
tensors (an island's checkpoint while it trains): the tensors named ``now`` are written into the
temporary file at once, in the caller's thread, instead of being copied in memory (at 124M
parameters a snapshot of the model was a whole model's fp32 bytes held for the seconds the write
took; written into the file they cost no more than that copy did, docs/scale.md); the rest, the
hashes (read back from the file for those written early) and the rename are ``finish``, in any
thread. The file is the same either way.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import secrets
import struct
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import torch

from node.state.checkpoint_format import _DTYPES, _SHA, CHUNK, FORMAT_VERSION, _digest

__all__ = ["PendingCheckpoint", "begin_checkpoint", "save_checkpoint"]


@dataclass(frozen=True, slots=True)
class _Item:
    name: str
    code: str  # safetensors dtype, e.g. "F32"
    shape: list[int]
    width: int  # bytes per element
    data: memoryview  # flat bytes of a contiguous CPU tensor (or of its copy), not copied


def _item(name: str, tensor: torch.Tensor) -> _Item:
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise ValueError(f"cannot store a tensor under the name {name!r}")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise TypeError(f"{name!r} is not a dense torch.Tensor")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"{name!r} has dtype {tensor.dtype}, which a checkpoint cannot store")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # copies only if it must
    data = flat.view(torch.uint8).numpy().data
    return _Item(name, _DTYPES[tensor.dtype], list(tensor.shape), tensor.element_size(), data)


@dataclass(frozen=True, slots=True)
class _Laid:
    """A tensor's place in the file, without its data."""

    name: str
    code: str
    shape: list[int]
    nbytes: int

    @classmethod
    def of(cls, it: _Item) -> _Laid:
        return cls(it.name, it.code, it.shape, it.data.nbytes)


def _header(items: list[_Laid], created: str, meta: str, digest: str) -> bytes:
    """The length-prefixed, space-padded JSON header; ``items`` are in data order."""
    entries: dict[str, Any] = {
        "__metadata__": {
            "atoll_format": str(FORMAT_VERSION),
            "atoll_created": created,
            "atoll_meta": meta,
            _SHA: digest,
        }
    }
    offset = 0
    for it in items:
        entries[it.name] = {
            "dtype": it.code,
            "shape": it.shape,
            "data_offsets": [offset, offset + it.nbytes],
        }
        offset += it.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_all(f: BinaryIO, view: memoryview) -> None:
    while view:
        view = view[f.write(view) :]


def _write_hashed(f: BinaryIO, data: memoryview) -> str:
    h = hashlib.sha256()
    for start in range(0, data.nbytes, CHUNK):
        piece = data[start : start + CHUNK]
        h.update(piece)
        _write_all(f, piece)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_temps(folder: Path, pattern: str) -> None:
    for stale in folder.glob(pattern):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def save_checkpoint(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    now: float | None = None,
) -> None:
    """Write ``tensors`` and ``meta`` to ``path`` atomically (temporary file, fsync, rename).

    ``meta`` must be JSON (no NaN); ``now`` is the creation time (default: the clock).
    Raises ValueError/TypeError for a name, tensor or meta that cannot be stored, OSError
    from the disk; on any error the previous file at ``path`` is untouched.
    """
    begin_checkpoint(path, tensors, meta, now=now).finish()


def begin_checkpoint(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    now: float | None = None,
    write_now: Collection[str] = (),
) -> PendingCheckpoint:
    """Start writing ``save_checkpoint``'s file: the tensors named in ``write_now`` are in the
    temporary file when this returns (the caller may change them from then on); the others are
    read, and must stay as they are, until ``PendingCheckpoint.finish``. Raises as
    ``save_checkpoint``; on any error no temporary file is left and ``path`` is untouched."""
    if sys.byteorder != "little":
        raise RuntimeError("checkpoints are written on little-endian hosts only")
    unknown = set(write_now) - set(tensors)
    if unknown:
        raise ValueError(f"write_now names tensors not in the checkpoint: {sorted(unknown)[:3]}")
    path = Path(path)
    created = datetime.fromtimestamp(time.time() if now is None else now, UTC).isoformat()
    meta_json = json.dumps(dict(meta), sort_keys=True, allow_nan=False)
    items = [_item(name, t) for name, t in tensors.items()]
    items.sort(key=lambda it: (-it.width, it.name))  # widest first keeps every tensor aligned
    _remove_temps(path.parent, f".{glob.escape(path.name)}.*.tmp")
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    pending = PendingCheckpoint(path, tmp, items, created, meta_json)
    try:
        pending.write_early(set(write_now))
    except BaseException:
        pending.abandon()
        raise
    return pending


class PendingCheckpoint:
    """A checkpoint file being written (``begin_checkpoint``): ``finish`` completes it, once."""

    def __init__(
        self, path: Path, tmp: Path, items: list[_Item], created: str, meta_json: str
    ) -> None:
        self.path, self.tmp, self.created, self.meta_json = path, tmp, created, meta_json
        self._items: list[_Item | None] = list(items)  # None: written early, read back to hash
        self._layout = [_Laid.of(it) for it in items]  # for the header: no data held
        self._header_len = len(_header(self._layout, created, meta_json, "0" * 64))
        self._file: BinaryIO | None = open(tmp, "xb+", buffering=0)  # noqa: SIM115 (closed by finish/abandon)

    def write_early(self, names: set[str]) -> None:
        """Write the tensors named ``names`` at their places now, unhashed."""
        assert self._file is not None
        offset = self._header_len
        for i, it in enumerate(self._items):
            if it is not None and it.name in names:
                self._file.seek(offset)
                for start in range(0, it.data.nbytes, CHUNK):
                    _write_all(self._file, it.data[start : start + CHUNK])
                self._items[i] = None  # the live tensor (or its host copy) is not held any more
            offset += self._layout[i].nbytes

    def finish(self) -> None:
        """Write the rest, hash everything, write the header, fsync and rename over ``path``
        (then fsync the directory). Raises OSError from the disk, leaving ``path`` untouched."""
        try:
            self._complete()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abandon()
            raise
        _fsync_dir(self.path.parent)

    def abandon(self) -> None:
        """Give up: close and remove the temporary file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tmp.unlink(missing_ok=True)

    def _complete(self) -> None:
        f = self._file
        assert f is not None, "a pending checkpoint is finished once"
        offset, parts = self._header_len, []
        for it, laid in zip(self._items, self._layout, strict=True):
            f.seek(offset)
            digest = _read_hashed(f, laid.nbytes) if it is None else _write_hashed(f, it.data)
            parts.append((laid.name, laid.code, laid.shape, digest))
            offset += laid.nbytes
        digest = _digest(self.created, self.meta_json, parts)
        f.seek(0)
        _write_all(f, memoryview(_header(self._layout, self.created, self.meta_json, digest)))
        os.fsync(f.fileno())
        f.close()
        self._file = None


def _read_hashed(f: BinaryIO, nbytes: int) -> str:
    """The SHA-256 of the next ``nbytes`` of ``f``, read in ``CHUNK`` slices into one buffer."""
    h, buf = hashlib.sha256(), bytearray(min(CHUNK, nbytes))
    view, left = memoryview(buf), nbytes
    while left:
        got = os.readv(f.fileno(), [view[: min(CHUNK, left)]])
        if not got:
            raise OSError(f"checkpoint temporary file ended {left} bytes early")
        h.update(view[:got])
        left -= got
    return h.hexdigest()
