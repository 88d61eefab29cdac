"""Reading one checkpoint file, trusting nothing until it is verified.

``load_checkpoint`` parses the header, checks the format version and that the data is all
there, re-hashes every tensor against ``atoll_sha256``, then checks the tensors against what the
caller expected and for NaN/Inf. Every refusal is a ``CheckpointError`` that says what is wrong
and what to do (the format: ``node.state.checkpoint``): a crafted file (JSON nested deep enough to
exhaust the parser's recursion, numbers past Python's digit limit, NaN or Infinity, values of the
wrong type) is refused like a damaged one, never an exception of another kind, so a peer skips
it and starts without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from node.state.checkpoint_format import (
    _CODES,
    _FRESH,
    _SHA,
    CHUNK,
    FORMAT_VERSION,
    MAX_HEADER,
    CheckpointError,
    Expected,
    _digest,
)
from protocol.diloco.norms import all_finite

__all__ = ["load_checkpoint"]


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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")  # NaN/Infinity: save_checkpoint never writes them


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e99999 parses to inf
        raise ValueError(f"{text[:24]} is not a finite number")
    return value


def _parse_json(path: Path, raw: bytes | str, what: str) -> Any:
    """``raw`` parsed, or a ``CheckpointError`` naming ``what`` for any failure: bad syntax,
    nesting past the parser's recursion limit (``RecursionError``), a number past the digit
    limit or past a float's range, NaN or Infinity."""
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise _corrupt(path, f"{what} is nested too deeply to parse") from None
    except ValueError:
        raise _corrupt(path, f"{what} is not valid JSON") from None


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the number of data bytes after it."""
    raw, n, size = _read_raw_header(path)
    if len(raw) < n:
        raise _corrupt(path, "the header runs past the end of the file")
    if not raw.startswith(b"{"):
        raise _foreign(path, "no safetensors header")
    header = _parse_json(path, raw, "the header")
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
    except (
        SafetensorError,
        ValueError,
        TypeError,
        OverflowError,
        RuntimeError,
    ) as e:  # a crafted header
        raise _corrupt(path, f"safetensors: {str(e)[:200]}") from None


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
    return all(
        all_finite(piece.float() if piece.element_size() == 1 else piece)
        for piece in t.reshape(-1).split(CHUNK)
    )


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
    meta = _parse_json(path, record["atoll_meta"], "the meta record")
    if not isinstance(meta, dict):
        raise _corrupt(path, f"the meta record is a JSON {type(meta).__name__}, not an object")
    if expected is not None:
        _check_expected(path, tensors, expected)
    if not allow_nonfinite:
        _check_finite(path, tensors)
    return tensors, meta
