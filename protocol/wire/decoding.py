"""Decoding one message (``decode``), strictly.

Size caps are checked before anything is allocated, msgpack runs with every length limit set
and no ext types, duplicate map keys, unknown or missing fields and wrong types are refused, and
every failure is a ``RemoteProtocolError`` (``DecodeError`` or ``Oversize``). Blob fields come
back as zero-copy, aligned ``memoryview`` slices of the received buffer. The frame it reads is
told in ``protocol.wire.codec``, which re-exports ``decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from protocol.errors import DecodeError, LocalProtocolError, Oversize, RemoteProtocolError
from protocol.wire.framing import FRAME_PREFIX, Buffer, byte_view, header_length, pad_length
from protocol.wire.messages import (
    CAPS,
    MESSAGE_TYPES,
    STRUCT_TYPES,
    Blob,
    Kind,
    Maybe,
    Message,
    Scalar,
    TupleOf,
    check_value,
    schema_of,
)

__all__ = ["decode", "frame_parts"]

_MALFORMED = (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException)


class _Blobs:
    """The blobs of one message, handed out in order."""

    __slots__ = ("next", "views")

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.next = 0

    def take(self, index: object, where: str | None) -> memoryview:
        if type(index) is not int or index != self.next or index >= len(self.views):
            raise DecodeError(f"{where}: blob reference {index!r} out of order (next {self.next})")
        self.next += 1
        return self.views[index]


def decode(buf: Buffer, *, max_size: int) -> Message:
    """Decode one message; blob fields come back as zero-copy ``memoryview`` slices of ``buf``.

    Raises Oversize if ``buf`` exceeds ``max_size`` and DecodeError for anything malformed:
    bad framing, truncation, trailing bytes, bad msgpack, unknown type codes, unknown, missing
    or mistyped fields, values beyond the caps. Never raises anything else for bad input.
    """
    try:
        mv = byte_view(buf)
    except LocalProtocolError as e:
        raise DecodeError(e.args[0]) from e
    if mv.nbytes > max_size:
        raise Oversize(f"message of {mv.nbytes} bytes exceeds the cap of {max_size}")
    try:
        return _decode(mv)
    except RemoteProtocolError:
        raise
    except _MALFORMED as e:
        raise DecodeError(f"malformed message: {type(e).__name__}: {e}") from e


_LIMITS = {
    "max_str_len": CAPS.max_str,
    "max_bin_len": CAPS.max_bytes,
    "max_array_len": max(CAPS.max_tuple, CAPS.max_blobs),
    "max_map_len": CAPS.max_fields,
    "max_ext_len": 0,
}


def frame_parts(buf: Buffer) -> tuple[memoryview, list[memoryview]]:
    """The head (frame prefix and header) and the blobs of one encoded message, as zero-copy
    views of ``buf``: what a message digest covers (``protocol.wire.sealing.message_digest``;
    the zero padding between blobs is checked, not returned). Builds nothing from the fields.

    Raises DecodeError (or Oversize, a header over the cap) for anything ``decode`` would refuse
    in the frame: bad prefix, a header that is not ``[type_code, fields, blob_lengths]``, bad
    blob lengths, non-zero padding, truncation or trailing bytes.
    """
    try:
        mv = byte_view(buf)
        _, lengths, body_start = _read_header(mv)
        return mv[:body_start], _slice_blobs(mv, body_start, lengths)
    except RemoteProtocolError:
        raise
    except (*_MALFORMED, LocalProtocolError) as e:
        raise DecodeError(f"malformed message: {type(e).__name__}: {e}") from e


def _read_header(mv: memoryview) -> tuple[tuple[object, object], object, int]:
    """The header's ``(type_code, fields)``, its blob lengths and where the blobs start."""
    header, body_start = _read_prefix(mv)
    _check_whole(header)
    raw = msgpack.unpackb(
        header,
        raw=False,
        use_list=False,
        strict_map_key=True,
        object_pairs_hook=_strict_map,
        **_LIMITS,
    )
    if type(raw) is not tuple or len(raw) != 3:
        raise DecodeError("header is not [type_code, fields, blob_lengths]")
    return (raw[0], raw[1]), raw[2], body_start


def _decode(mv: memoryview) -> Message:
    (code, fields), lengths, body_start = _read_header(mv)
    cls = MESSAGE_TYPES.get(code) if type(code) is int else None
    if cls is None:
        raise DecodeError(f"unknown message type code {code!r}")
    views = _slice_blobs(mv, body_start, lengths)
    try:  # no place names are built on the way that passes...
        return _built(cls, fields, views, None)
    except DecodeError:
        pass
    return _built(cls, fields, views, cls.__name__)  # ...a failure is decoded again to name it


def _built(cls: type, fields: object, views: list[memoryview], where: str | None) -> Message:
    blobs = _Blobs(views)
    msg: Message = _build(cls, fields, blobs, where)
    if blobs.next != len(blobs.views):
        raise DecodeError(f"{len(blobs.views) - blobs.next} blobs not referenced by any field")
    return msg


def _read_prefix(mv: memoryview) -> tuple[memoryview, int]:
    header_len = header_length(mv)
    if header_len > CAPS.max_header:
        raise Oversize(f"header of {header_len} bytes exceeds the cap of {CAPS.max_header}")
    end = FRAME_PREFIX.size + header_len
    if end > mv.nbytes:
        raise DecodeError(f"truncated: header needs {end} bytes, have {mv.nbytes}")
    return mv[FRAME_PREFIX.size : end], end


def _check_whole(header: memoryview) -> None:
    """Refuse a header that is not one whole msgpack object before building anything from it.

    msgpack preallocates every array it opens (up to 10,000 slots), so a few KB of nested array
    headers that never close would cost ~80 MB before "incomplete input"; ``skip`` walks the
    structure in C without building objects.
    """
    unpacker = msgpack.Unpacker(max_buffer_size=max(header.nbytes, 1), **_LIMITS)
    unpacker.feed(header)
    try:
        unpacker.skip()
    except msgpack.OutOfData:
        raise DecodeError(
            f"header of {header.nbytes} bytes is not a whole msgpack object"
        ) from None


def _strict_map(pairs: Sequence[tuple[object, object]]) -> dict[object, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise DecodeError("duplicate key in a map")
    return out


def _slice_blobs(mv: memoryview, offset: int, lengths: object) -> list[memoryview]:
    if type(lengths) is not tuple or len(lengths) > CAPS.max_blobs:
        raise DecodeError(f"blob lengths must be an array of at most {CAPS.max_blobs}")
    views = []
    for n in lengths:
        pad = pad_length(offset)
        if type(n) is not int or n < 0 or offset + pad + n > mv.nbytes:
            raise DecodeError(f"truncated or bad blob length {n!r} at offset {offset}")
        if any(mv[offset : offset + pad]):
            raise DecodeError(f"non-zero padding at offset {offset}")
        offset += pad
        views.append(mv[offset : offset + n])
        offset += n
    if offset != mv.nbytes:
        raise DecodeError(f"{mv.nbytes - offset} trailing bytes after the message")
    return views


def _build(cls: type, fields: object, blobs: _Blobs, where: str | None) -> Any:
    """``cls`` from its decoded ``fields``; ``where`` None: errors leave their place unnamed
    (``_decode`` decodes a failure again, naming it)."""
    if type(fields) is not dict:
        raise DecodeError(f"{where}: fields must be a map")
    schema = schema_of(cls)
    names = {name for name, _ in schema}
    added: frozenset[str] = getattr(
        cls, "ADDED", frozenset()
    )  # fields added later, which an older sender leaves out
    if fields.keys() != names and not (fields.keys() <= names and names - fields.keys() <= added):
        missing = sorted(names - fields.keys())
        unknown = sorted(str(k) for k in fields.keys() - names)
        raise DecodeError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    kwargs = {
        n: _decode_value(k, fields[n], blobs, None if where is None else f"{where}.{n}")
        for n, k in schema
        if n in fields
    }
    try:
        return cls(**kwargs)
    except RemoteProtocolError:
        raise
    except _MALFORMED as e:
        raise DecodeError(f"{where}: invalid values: {e}") from e


def _decode_value(kind: Kind, raw: object, blobs: _Blobs, where: str | None) -> object:
    if isinstance(kind, Scalar):
        if type(raw) is not kind.type:  # no int -> float leniency on the wire
            raise DecodeError(f"{where}: expected {kind.type.__name__}, got {type(raw).__name__}")
        return check_value(kind, raw, "" if where is None else where)
    if isinstance(kind, Blob):
        return blobs.take(raw, where)
    if isinstance(kind, Maybe):
        return None if raw is None else _decode_value(kind.inner, raw, blobs, where)
    if isinstance(kind, TupleOf):
        if type(raw) is not tuple:
            raise DecodeError(f"{where}: expected an array, got {type(raw).__name__}")
        if where is None:
            return tuple([_decode_value(kind.inner, v, blobs, None) for v in raw])
        return tuple(
            _decode_value(kind.inner, v, blobs, f"{where}[{i}]") for i, v in enumerate(raw)
        )
    if type(raw) is not tuple or len(raw) != 2 or type(raw[0]) is not int:
        raise DecodeError(f"{where}: a struct must be [struct_code, fields]")
    cls = STRUCT_TYPES.get(raw[0])
    if cls not in kind.classes:
        raise DecodeError(f"{where}: struct code {raw[0]} not allowed here")
    return _build(cls, raw[1], blobs, where)
