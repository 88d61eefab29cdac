"""Writing one checkpoint file atomically: hashed as it is written, then fsynced and renamed.

``save_checkpoint`` writes the tensors under a hidden temporary name, each in <= ``CHUNK``
slices hashed as they go, then the header (with the digest) into the space reserved for it,
fsyncs, renames over the final name and fsyncs the directory (the format and the crash
guarantees: ``node.state.checkpoint``).
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
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import torch

from node.state.checkpoint_format import _DTYPES, _SHA, CHUNK, FORMAT_VERSION, _digest

__all__ = ["save_checkpoint"]


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


def _header(items: list[_Item], created: str, meta: str, digest: str) -> bytes:
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
            "data_offsets": [offset, offset + it.data.nbytes],
        }
        offset += it.data.nbytes
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
    if sys.byteorder != "little":
        raise RuntimeError("checkpoints are written on little-endian hosts only")
    path = Path(path)
    created = datetime.fromtimestamp(time.time() if now is None else now, UTC).isoformat()
    meta_json = json.dumps(dict(meta), sort_keys=True, allow_nan=False)
    items = [_item(name, t) for name, t in tensors.items()]
    items.sort(key=lambda it: (-it.width, it.name))  # widest first keeps every tensor aligned
    _remove_temps(path.parent, f".{glob.escape(path.name)}.*.tmp")
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        _write_file(tmp, items, created, meta_json)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_file(tmp: Path, items: list[_Item], created: str, meta_json: str) -> None:
    placeholder = _header(items, created, meta_json, "0" * 64)  # same length as the real one
    with open(tmp, "xb", buffering=0) as f:
        f.seek(len(placeholder))
        parts = [(it.name, it.code, it.shape, _write_hashed(f, it.data)) for it in items]
        digest = _digest(created, meta_json, parts)
        f.seek(0)
        _write_all(f, memoryview(_header(items, created, meta_json, digest)))
        os.fsync(f.fileno())
