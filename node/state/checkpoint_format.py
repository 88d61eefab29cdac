"""The checkpoint format both sides agree on: its version, dtype codes, digest and error.

The format itself (layout, header, what ``atoll_sha256`` covers) is described in
``node.state.checkpoint``. This module holds what writing (``node.state.checkpoint_save``) and
reading (``node.state.checkpoint_load``) share: the format version and size limits, the
safetensors dtype codes, the digest over a checkpoint's contents, and ``CheckpointError``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

__all__ = ["CHUNK", "FORMAT_VERSION", "MAX_HEADER", "CheckpointError", "Expected"]

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


def _digest(created: str, meta: str, parts: list[tuple[str, str, list[int], str]]) -> str:
    """SHA-256 over the format, time, meta and (name, dtype, shape, data digest) in name order."""
    blob = json.dumps(
        [_DOMAIN, FORMAT_VERSION, created, meta, sorted(parts)], separators=(",", ":")
    )
    return hashlib.sha256(blob.encode()).hexdigest()
