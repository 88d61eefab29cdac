"""Strict msgpack framing of messages, with large buffers kept out of the header.

Theory of operation. An encoded message is::

    MAGIC (4) | FORMAT_VERSION (1) | header length (u32 BE) | header | pad | blob 0 | pad | blob 1 …

The header is msgpack of ``[type_code, {field: value}, [blob lengths]]``. Fields are walked in
schema order (see ``messages``): a nested struct is ``[struct_code, {field: value}]``, a tuple is
an array, and every ``Blob`` field (tensor data and scales) is replaced by its index in the blob
list. The blobs follow the header raw, each starting at a multiple of ``ALIGN`` bytes (zero
padding), so ``encode`` returns zero-copy views of the caller's buffers and ``decode`` returns
zero-copy, aligned ``memoryview`` slices of the received buffer. The message ends exactly after
its last blob: truncation and trailing bytes are both errors.

This module is the import point and holds ``encode``; the rest lives beside it:

- ``framing``: the frame constants, ``header_length``, ``byte_view``, ``chunk_views`` and
  ``Encoded``.
- ``decoding``: ``decode``, strict: every failure is a ``RemoteProtocolError`` (``DecodeError``
  or ``Oversize``), size caps checked before anything is allocated.
- ``body_reader``: ``BodyReader``, the sans-IO receiving side for streamed bodies.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.errors import DecodeError, LocalProtocolError
from protocol.wire.body_reader import BodyReader
from protocol.wire.decoding import decode
from protocol.wire.framing import (
    ALIGN,
    FORMAT_VERSION,
    FRAME_PREFIX,
    MAGIC,
    Buffer,
    Encoded,
    byte_view,
    chunk_views,
    header_length,
    pad_length,
)
from protocol.wire.messages import (
    CAPS,
    MESSAGE_TYPES,
    Blob,
    Kind,
    Maybe,
    Message,
    Scalar,
    TupleOf,
    check_value,
    schema_of,
    struct_code,
)

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "BodyReader",
    "Buffer",
    "Encoded",
    "byte_view",
    "chunk_views",
    "decode",
    "encode",
    "header_length",
]

_ZEROS = memoryview(bytes(ALIGN))


# ── encode ───────────────────────────────────────────────────────────────────────────────────
def encode(msg: Message) -> Encoded:
    """Encode a registered message; raises LocalProtocolError if it cannot be (unregistered
    class, a value of the wrong type, a header over the cap)."""
    cls = type(msg)
    code = getattr(cls, "TYPE_CODE", None)
    if code is None or MESSAGE_TYPES.get(code) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a registered message")
    try:
        fields, blobs = _fields_of(msg)
        header = msgpack.packb(
            [code, fields, [b.nbytes for b in blobs]], use_bin_type=True, strict_types=True
        )
    except DecodeError as e:
        raise LocalProtocolError(f"cannot encode: {e.reason}") from e
    if len(header) > CAPS.max_header:
        raise LocalProtocolError(f"header of {len(header)} bytes exceeds {CAPS.max_header}")
    return _frame(header, blobs)


def _frame(header: bytes, blobs: list[memoryview]) -> Encoded:
    head = FRAME_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    parts = [memoryview(head)]
    size = len(head)
    for blob in blobs:
        pad = pad_length(size)
        if pad:
            parts.append(_ZEROS[:pad])
        parts.append(blob)
        size += pad + blob.nbytes
    return Encoded(parts=parts, size=size, blobs=tuple(blobs))


def _fields_of(msg: Message) -> tuple[dict[str, Any], list[memoryview]]:
    """``msg``'s encoded fields and its blobs. No place names are built on the way that passes;
    a failure is encoded again to name its place (outside the handler: no chained first error)."""
    blobs: list[memoryview] = []
    try:
        return _encode_fields(msg, blobs, None), blobs
    except (DecodeError, LocalProtocolError):
        pass
    blobs = []
    return _encode_fields(msg, blobs, type(msg).__name__), blobs


def _encode_fields(obj: object, blobs: list[memoryview], where: str | None) -> dict[str, Any]:
    added: frozenset[str] = getattr(
        type(obj), "ADDED", frozenset()
    )  # fields added later: left out when empty, as before them
    return {
        name: _encode_value(
            kind, getattr(obj, name), blobs, None if where is None else f"{where}.{name}"
        )
        for name, kind in schema_of(type(obj))
        if name not in added or getattr(obj, name) != ()
    }


def _encode_value(kind: Kind, value: object, blobs: list[memoryview], where: str | None) -> object:
    if isinstance(kind, Blob):
        check_value(kind, value, "" if where is None else where)
        blobs.append(byte_view(value))  # type: ignore[arg-type]  # checked bytes-like above
        return len(blobs) - 1
    if isinstance(kind, Maybe):
        return None if value is None else _encode_value(kind.inner, value, blobs, where)
    if isinstance(kind, TupleOf):
        if type(value) is not tuple or len(value) > CAPS.max_tuple:
            raise LocalProtocolError(f"{where}: expected a tuple of <= {CAPS.max_tuple} items")
        if where is None:
            return [_encode_value(kind.inner, v, blobs, None) for v in value]
        return [_encode_value(kind.inner, v, blobs, f"{where}[{i}]") for i, v in enumerate(value)]
    value = check_value(kind, value, "" if where is None else where)
    if isinstance(kind, Scalar):
        return value
    return [struct_code(type(value)), _encode_fields(value, blobs, where)]
