"""Atomic, verified checkpoints: safetensors for the tensors, a small JSON for the rest.

Theory of operation. A checkpoint is ONE file in the safetensors format, so the whole of it
appears or disappears with a single ``os.replace``. ``save_checkpoint`` writes it under a hidden
temporary name in the same directory (``.NAME.<pid>-<random>.tmp``), fsyncs the file, renames
it over the final name and fsyncs the directory. A crash (``kill -9`` or a power cut) at any
point leaves either the previous checkpoint or the new one under the final name, never a mix,
and the new one is durable once ``save_checkpoint`` returns; at worst a temporary file is left
behind, which the next save of the same path (and ``Checkpointer``, for its whole folder)
removes. One process writes a given path.

On-disk format (version ``FORMAT_VERSION``)::

    u64 little-endian  N = length of the JSON header
    N bytes            JSON header, padded with spaces to a multiple of 8:
                       {"__metadata__": {"atoll_format": "1",
                                         "atoll_created": ISO-8601 UTC time,
                                         "atoll_meta": the caller's meta as a JSON string,
                                         "atoll_sha256": 64 hex digits},
                        NAME: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..}
    data               raw little-endian tensor bytes, widest dtype first (so every tensor is
                       aligned to its element size), then by name

Any safetensors reader loads the tensors. ``atoll_sha256`` is the SHA-256 of the compact JSON
``["atoll-checkpoint", 1, created, meta, [[name, dtype, shape, sha256(data) hex], ..]]`` with
the tensors in name order: it covers the format version, the creation time, the caller's meta
and every tensor's name, dtype, shape and bytes. The writer hashes each tensor in <= 1 MiB
slices of the very bytes it writes (one pass, no copy of a CPU tensor), writes the header last
into the space reserved for it, and the reader re-hashes before trusting anything, so a
truncated file, a flipped byte or a torn header is refused (``CheckpointError``) with a
message that says what is wrong and what to do. Nothing is ever pickled.

``Checkpointer`` keeps ``step-000123.safetensors`` files in one folder, prunes all but the
newest ``keep`` and finds the newest one that loads, skipping (with a warning) corrupt ones.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import secrets
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from protocol.diloco.norms import all_finite

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "Checkpointer",
    "Expected",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHUNK = 1 << 20  # bytes hashed and written per slice
MAX_HEADER = 100_000_000  # safetensors' own cap on the header length
_DOMAIN = "atoll-checkpoint"
_FRESH = "delete it to start fresh"
_SHA = "atoll_sha256"

Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _attr, _code in [
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
]:
    if hasattr(torch, _attr):
        _DTYPES[getattr(torch, _attr)] = _code
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted; the message says why and what to do."""


# ----------------------------------------------------------------------------- saving


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


def _digest(created: str, meta: str, parts: list[tuple[str, str, list[int], str]]) -> str:
    """SHA-256 over the format, time, meta and (name, dtype, shape, data digest) in name order."""
    blob = json.dumps(
        [_DOMAIN, FORMAT_VERSION, created, meta, sorted(parts)], separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()


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
    created = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).isoformat()
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


# ----------------------------------------------------------------------------- loading


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is truncated or corrupt ({why}); {_FRESH}")


def _foreign(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a checkpoint ({why}); pass a file from save_checkpoint")


def _read_raw_header(path: Path) -> tuple[bytes, int, int]:
    """The header bytes (possibly cut short), their announced length and the file size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"{size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER:
                raise _foreign(path, "no safetensors header")
            return f.read(n), n, size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise _foreign(path, "it is a directory") from None


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the number of data bytes after it."""
    raw, n, size = _read_raw_header(path)
    if len(raw) < n:
        raise _corrupt(path, "the header runs past the end of the file")
    if not raw.startswith(b"{"):
        raise _foreign(path, "no safetensors header")
    try:
        header = json.loads(raw)
    except ValueError:
        raise _corrupt(path, "the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    return header, size - 8 - n


def _record(path: Path, header: dict[str, Any]) -> dict[str, str]:
    """The ``__metadata__`` record, checked for our format version."""
    record = header.get("__metadata__")
    if not isinstance(record, dict) or "atoll_format" not in record:
        raise _foreign(path, "a safetensors file without atoll_format, not written by Atoll")
    version = record["atoll_format"]
    if version != str(FORMAT_VERSION):
        raise CheckpointError(
            f"checkpoint {path} was written by an incompatible format version {version!s:.20}"
            f" (this build reads version {FORMAT_VERSION}); load it with a matching Atoll, or {_FRESH}"
        )
    if not all(isinstance(record.get(k), str) for k in ("atoll_created", "atoll_meta", _SHA)):
        raise _corrupt(path, "the metadata record is incomplete")
    return record


def _entries(path: Path, header: dict[str, Any], data_len: int) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype code, shape), after checking that the data is all there."""
    out: dict[str, tuple[str, list[int]]] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (_, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            well_formed = code in _CODES and all(isinstance(d, int) for d in [*shape, stop])
        except (KeyError, TypeError, ValueError):
            well_formed = False
        if not well_formed:
            raise _corrupt(path, f"the header entry for {name!r} is malformed")
        out[name] = (code, shape)
        end = max(end, stop)
    if end != data_len:
        raise _corrupt(path, f"{data_len} data bytes where the header describes {end}")
    return out


def _data_digest(tensor: torch.Tensor) -> str:
    data = tensor.reshape(-1).view(torch.uint8).numpy().data
    h = hashlib.sha256()
    for start in range(0, data.nbytes, CHUNK):
        h.update(data[start : start + CHUNK])
    return h.hexdigest()


def _read_tensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:  # memory-mapped
            return {name: f.get_tensor(name) for name in names}
    except SafetensorError as e:
        raise _corrupt(path, f"safetensors: {e}") from None


def _check_expected(path: Path, tensors: Mapping[str, torch.Tensor], expected: Expected) -> None:
    other = "it was written for another model or configuration"
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            raise CheckpointError(
                f"checkpoint {path} is missing tensor {name!r}; {other}, {_FRESH}"
            )
        got = tensors[name]
        if tuple(got.shape) != tuple(shape) or got.dtype != dtype:
            raise CheckpointError(
                f"checkpoint {path}: tensor {name!r} has shape {tuple(got.shape)} and dtype {got.dtype},"
                f" expected shape {tuple(shape)} and dtype {dtype}; {other}, {_FRESH}"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(
            f"checkpoint {path} has unexpected tensor {extra[0]!r}; {other}, {_FRESH}"
        )


def _finite(t: torch.Tensor) -> bool:
    """No NaN or Inf (``all_finite``: a finite sum proves it cheaply), piece by piece: float8
    has no sum, so each of its pieces is widened first."""
    return all(all_finite(piece.float() if piece.element_size() == 1 else piece)
               for piece in t.reshape(-1).split(CHUNK))


def _check_finite(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    for name, t in sorted(tensors.items()):
        if t.is_floating_point() and not _finite(t):
            raise CheckpointError(
                f"checkpoint {path}: tensor {name!r} holds NaN or Inf; resume from an earlier"
                " checkpoint, or pass allow_nonfinite=True to load it anyway"
            )


def load_checkpoint(
    path: Path,
    *,
    expected: Expected | None = None,
    allow_nonfinite: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify a checkpoint written by ``save_checkpoint``: (tensors, meta).

    ``expected`` maps every tensor name to its (shape, dtype); missing, extra or different
    tensors are refused. Raises ``CheckpointError`` for a missing, foreign, truncated or
    corrupt file, another format version, a mismatch with ``expected``, or NaN/Inf in a
    floating tensor unless ``allow_nonfinite``. OSError (e.g. permissions) passes through.
    """
    path = Path(path)
    header, data_len = _read_header(path)
    record = _record(path, header)
    entries = _entries(path, header, data_len)
    tensors = _read_tensors(path, sorted(entries))
    parts = [
        (name, code, shape, _data_digest(tensors[name])) for name, (code, shape) in entries.items()
    ]
    if _digest(record["atoll_created"], record["atoll_meta"], parts) != record[_SHA]:
        raise _corrupt(path, "hash mismatch")
    meta = json.loads(record["atoll_meta"])
    if expected is not None:
        _check_expected(path, tensors, expected)
    if not allow_nonfinite:
        _check_finite(path, tensors)
    return tensors, meta


# ----------------------------------------------------------------------------- a folder of them

_STEP = re.compile(r"step-(\d{6,})\.safetensors")


class Checkpointer:
    """Numbered checkpoints in one folder: ``save`` and prune, ``latest`` valid one back.

    One process owns the folder. ``save(step, ...)`` writes ``step-000123.safetensors`` and
    deletes all but the newest ``keep`` at or below ``step``; files above it (left behind when
    a run resumed from an earlier step, e.g. past a corrupt one) stay until a save overwrites
    them. Leftover temporary files from a killed writer are removed on creation and each save.
    """

    def __init__(self, folder: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.folder = Path(folder)
        self.keep = keep
        self.folder.mkdir(parents=True, exist_ok=True)
        _remove_temps(self.folder, ".step-*.tmp")

    def path(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"step must be >= 0, not {step}")
        return self.folder / f"step-{step:06d}.safetensors"

    def steps(self) -> list[int]:
        """The steps with a checkpoint file, oldest first (valid or not)."""
        found = (_STEP.fullmatch(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
        """Write checkpoint ``step`` atomically, then prune; raises like ``save_checkpoint``."""
        path = self.path(step)
        _remove_temps(self.folder, ".step-*.tmp")
        save_checkpoint(path, tensors, meta)
        for old in [s for s in self.steps() if s <= step][: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                self.path(old).unlink()
        return path

    def latest(
        self, *, expected: Expected | None = None, allow_nonfinite: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The newest checkpoint that loads, or None; refused newer ones are logged and skipped."""
        for step in reversed(self.steps()):
            try:
                return load_checkpoint(
                    self.path(step), expected=expected, allow_nonfinite=allow_nonfinite
                )
            except CheckpointError as e:
                log.warning("skipping checkpoint step %d: %s", step, e)
        return None
