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

Decoding is strict: size caps are checked before anything is allocated, msgpack runs with every
length limit set and no ext types, duplicate map keys, unknown or missing fields and wrong types
are refused, and every failure is a ``RemoteProtocolError`` (``DecodeError`` or ``Oversize``).

``BodyReader`` is the sans-IO receiving side for streamed bodies: it copies chunks once into one
preallocated (optionally reused) buffer, refusing a declared size over its cap before
allocating.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import DecodeError, LocalProtocolError, Oversize, RemoteProtocolError
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
    struct_code,
)

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "BodyReader",
    "Encoded",
    "byte_view",
    "chunk_views",
    "decode",
    "encode",
    "header_length",
]

MAGIC = b"ATOL"
FORMAT_VERSION = 1
ALIGN = 8
COALESCE_MAX = 64 << 10
_PREFIX = struct.Struct(">4sBI")
_ZEROS = memoryview(bytes(ALIGN))
_MALFORMED = (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException)

Buffer = bytes | bytearray | memoryview


def byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of ``buf`` without copying; raises LocalProtocolError if
    ``buf`` is not C-contiguous."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise LocalProtocolError("buffer is not C-contiguous")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    return mv.cast("B")


def _pad(offset: int) -> int:
    return -offset % ALIGN


def chunk_views(parts: Sequence[memoryview], chunk_size: int) -> Iterator[memoryview]:
    """The bytes of ``parts`` in order, as non-empty chunks of at most ``chunk_size`` bytes.

    Parts up to ``COALESCE_MAX`` bytes are copied together into one chunk; larger parts are
    yielded as zero-copy slices. Raises LocalProtocolError if ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise LocalProtocolError(f"chunk_size must be >= 1, got {chunk_size}")
    small = min(chunk_size, COALESCE_MAX)
    pending = bytearray()
    for part in parts:
        n = part.nbytes
        if n <= small and len(pending) + n <= chunk_size:
            pending += part
            continue
        if pending:
            yield memoryview(pending)
            pending = bytearray()
        if n <= small:
            pending += part
            continue
        for off in range(0, n, chunk_size):
            yield part[off : off + chunk_size]
    if pending:
        yield memoryview(pending)


@dataclass(frozen=True, slots=True)
class Encoded:
    """An encoded message: ``parts`` (header, then blobs and padding) are views, not copies."""

    parts: list[memoryview]
    size: int

    def iter_chunks(self, chunk_size: int = 1 << 20) -> Iterator[memoryview]:
        """The message bytes as chunks of at most ``chunk_size`` (see ``chunk_views``)."""
        return chunk_views(self.parts, chunk_size)

    def tobytes(self) -> bytes:
        """The whole message as one bytes object (a copy: for small messages and tests)."""
        return b"".join(self.parts)


# ── encode ───────────────────────────────────────────────────────────────────────────────────
def encode(msg: Message) -> Encoded:
    """Encode a registered message; raises LocalProtocolError if it cannot be (unregistered
    class, a value of the wrong type, a header over the cap)."""
    cls = type(msg)
    code = getattr(cls, "TYPE_CODE", None)
    if code is None or MESSAGE_TYPES.get(code) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a registered message")
    blobs: list[memoryview] = []
    try:
        fields = _encode_fields(msg, blobs, cls.__name__)
        header = msgpack.packb(
            [code, fields, [b.nbytes for b in blobs]], use_bin_type=True, strict_types=True
        )
    except DecodeError as e:
        raise LocalProtocolError(f"cannot encode: {e.reason}") from e
    if len(header) > CAPS.max_header:
        raise LocalProtocolError(f"header of {len(header)} bytes exceeds {CAPS.max_header}")
    return _frame(header, blobs)


def _frame(header: bytes, blobs: list[memoryview]) -> Encoded:
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    parts = [memoryview(head)]
    size = len(head)
    for blob in blobs:
        pad = _pad(size)
        if pad:
            parts.append(_ZEROS[:pad])
        parts.append(blob)
        size += pad + blob.nbytes
    return Encoded(parts=parts, size=size)


def _encode_fields(obj: object, blobs: list[memoryview], where: str) -> dict[str, Any]:
    return {
        name: _encode_value(kind, getattr(obj, name), blobs, f"{where}.{name}")
        for name, kind in schema_of(type(obj))
    }


def _encode_value(kind: Kind, value: object, blobs: list[memoryview], where: str) -> object:
    if isinstance(kind, Blob):
        check_value(kind, value, where)
        blobs.append(byte_view(value))  # type: ignore[arg-type]  # checked bytes-like above
        return len(blobs) - 1
    if isinstance(kind, Maybe):
        return None if value is None else _encode_value(kind.inner, value, blobs, where)
    if isinstance(kind, TupleOf):
        if type(value) is not tuple or len(value) > CAPS.max_tuple:
            raise LocalProtocolError(f"{where}: expected a tuple of <= {CAPS.max_tuple} items")
        return [_encode_value(kind.inner, v, blobs, f"{where}[{i}]") for i, v in enumerate(value)]
    value = check_value(kind, value, where)
    if isinstance(kind, Scalar):
        return value
    return [struct_code(type(value)), _encode_fields(value, blobs, where)]


# ── decode ───────────────────────────────────────────────────────────────────────────────────
class _Blobs:
    """The blobs of one message, handed out in order."""

    __slots__ = ("next", "views")

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.next = 0

    def take(self, index: object, where: str) -> memoryview:
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


def _decode(mv: memoryview) -> Message:
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
    code, fields, lengths = raw
    cls = MESSAGE_TYPES.get(code) if type(code) is int else None
    if cls is None:
        raise DecodeError(f"unknown message type code {code!r}")
    blobs = _Blobs(_slice_blobs(mv, body_start, lengths))
    msg: Message = _build(cls, fields, blobs, cls.__name__)
    if blobs.next != len(blobs.views):
        raise DecodeError(f"{len(blobs.views) - blobs.next} blobs not referenced by any field")
    return msg


def header_length(buf: Buffer) -> int:
    """The header length an encoded message's frame prefix declares, read without decoding
    anything, so that a receiver can refuse a header over its own cap, or decode a large one off
    its event loop, before the header costs it a decode.

    Raises DecodeError on a short prefix, a bad magic or an unsupported format version.
    """
    try:
        mv = byte_view(buf)
    except LocalProtocolError as e:
        raise DecodeError(e.args[0]) from e
    if mv.nbytes < _PREFIX.size:
        raise DecodeError(f"truncated: {mv.nbytes} bytes is shorter than the frame prefix")
    magic, version, header_len = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DecodeError(f"unsupported format version {version}, expected {FORMAT_VERSION}")
    return int(header_len)


def _read_prefix(mv: memoryview) -> tuple[memoryview, int]:
    header_len = header_length(mv)
    if header_len > CAPS.max_header:
        raise Oversize(f"header of {header_len} bytes exceeds the cap of {CAPS.max_header}")
    end = _PREFIX.size + header_len
    if end > mv.nbytes:
        raise DecodeError(f"truncated: header needs {end} bytes, have {mv.nbytes}")
    return mv[_PREFIX.size : end], end


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
        raise DecodeError(f"header of {header.nbytes} bytes is not a whole msgpack object") from None


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
        pad = _pad(offset)
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


def _build(cls: type, fields: object, blobs: _Blobs, where: str) -> Any:
    if type(fields) is not dict:
        raise DecodeError(f"{where}: fields must be a map")
    schema = schema_of(cls)
    names = {name for name, _ in schema}
    if fields.keys() != names:
        missing = sorted(names - fields.keys())
        unknown = sorted(str(k) for k in fields.keys() - names)
        raise DecodeError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    kwargs = {n: _decode_value(k, fields[n], blobs, f"{where}.{n}") for n, k in schema}
    try:
        return cls(**kwargs)
    except RemoteProtocolError:
        raise
    except _MALFORMED as e:
        raise DecodeError(f"{where}: invalid values: {e}") from e


def _decode_value(kind: Kind, raw: object, blobs: _Blobs, where: str) -> object:
    if isinstance(kind, Scalar):
        if type(raw) is not kind.type:  # no int -> float leniency on the wire
            raise DecodeError(f"{where}: expected {kind.type.__name__}, got {type(raw).__name__}")
        return check_value(kind, raw, where)
    if isinstance(kind, Blob):
        return blobs.take(raw, where)
    if isinstance(kind, Maybe):
        return None if raw is None else _decode_value(kind.inner, raw, blobs, where)
    if isinstance(kind, TupleOf):
        if type(raw) is not tuple:
            raise DecodeError(f"{where}: expected an array, got {type(raw).__name__}")
        return tuple(
            _decode_value(kind.inner, v, blobs, f"{where}[{i}]") for i, v in enumerate(raw)
        )
    if type(raw) is not tuple or len(raw) != 2 or type(raw[0]) is not int:
        raise DecodeError(f"{where}: a struct must be [struct_code, fields]")
    cls = STRUCT_TYPES.get(raw[0])
    if cls not in kind.classes:
        raise DecodeError(f"{where}: struct code {raw[0]} not allowed here")
    return _build(cls, raw[1], blobs, where)


# ── streaming receive ────────────────────────────────────────────────────────────────────────
class BodyReader:
    """Receives a streamed body into one preallocated buffer (sans-IO).

    Either call ``expect(total_len)`` first (e.g. from Content-Length), or the first 8 bytes
    fed are read as a big-endian u64 length prefix. ``feed`` copies each chunk once into the
    buffer; ``view()`` is the complete body. A ``buffer`` passed in is reused when large
    enough; the caller must not reuse it while a message decoded from it is still alive.
    """

    LENGTH_PREFIX = struct.Struct(">Q")

    def __init__(self, max_size: int, buffer: bytearray | None = None) -> None:
        if max_size < 0:
            raise LocalProtocolError(f"max_size must be >= 0, got {max_size}")
        self.max_size = max_size
        self.buffer = buffer
        self._view: memoryview | None = None
        self._expected: int | None = None
        self._received = 0
        self._prefix = bytearray()

    @property
    def expected(self) -> int | None:
        return self._expected

    @property
    def received(self) -> int:
        return self._received

    @property
    def done(self) -> bool:
        return self._expected is not None and self._received == self._expected

    def expect(self, total_len: int) -> None:
        """Declare the body length; raises Oversize over ``max_size`` (before allocating),
        DecodeError if negative, LocalProtocolError if already declared."""
        if self._expected is not None:
            raise LocalProtocolError("body length already declared")
        if total_len < 0:
            raise DecodeError(f"negative body length {total_len}")
        if total_len > self.max_size:
            raise Oversize(f"body of {total_len} bytes exceeds the cap of {self.max_size}")
        if self.buffer is None or len(self.buffer) < total_len:
            self.buffer = bytearray(total_len)
        self._view = memoryview(self.buffer)[:total_len]
        self._expected = total_len

    def feed(self, chunk: Buffer) -> None:
        """Copy ``chunk`` into the buffer; raises DecodeError past the declared length, or
        Oversize/DecodeError from a bad length prefix."""
        data = byte_view(chunk)
        if self._expected is None:
            data = self._feed_prefix(data)
        if self._view is None:
            return
        end = self._received + data.nbytes
        if end > self.max_size or end > self._view.nbytes:
            raise DecodeError(f"body longer than the {self._view.nbytes} bytes declared")
        self._view[self._received : end] = data
        self._received = end

    def _feed_prefix(self, data: memoryview) -> memoryview:
        take = self.LENGTH_PREFIX.size - len(self._prefix)
        self._prefix += data[:take]
        if len(self._prefix) == self.LENGTH_PREFIX.size:
            self.expect(self.LENGTH_PREFIX.unpack(self._prefix)[0])
        return data[take:]

    def view(self) -> memoryview:
        """The complete body; raises LocalProtocolError before it is complete."""
        if not self.done or self._view is None:
            raise LocalProtocolError(f"body incomplete: {self._received}/{self._expected}")
        return self._view
