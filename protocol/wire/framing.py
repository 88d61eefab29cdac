"""The codec's frame and the buffers around it: the frame constants, ``header_length`` (the
header size a frame prefix declares), flat byte views, and ``Encoded``, a message as views to
send in chunks. The frame layout is told in ``protocol.wire.codec``, which re-exports these.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from protocol.errors import DecodeError, LocalProtocolError

__all__ = [
    "ALIGN",
    "COALESCE_MAX",
    "FORMAT_VERSION",
    "FRAME_PREFIX",
    "MAGIC",
    "Buffer",
    "Encoded",
    "byte_view",
    "chunk_views",
    "header_length",
    "pad_length",
]

MAGIC = b"ATOL"
FORMAT_VERSION = 1
ALIGN = 8
COALESCE_MAX = 64 << 10
FRAME_PREFIX = struct.Struct(">4sBI")

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


def pad_length(offset: int) -> int:
    """The zero bytes that bring ``offset`` to a multiple of ``ALIGN``."""
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
    """An encoded message: ``parts`` (header, then blobs and padding) are views, not copies.
    ``blobs``: the blobs among them, in order, when ``codec.encode`` made it (None for parts
    put together by hand, which are then digested as a receiver would)."""

    parts: list[memoryview]
    size: int
    blobs: tuple[memoryview, ...] | None = None

    def iter_chunks(self, chunk_size: int = 1 << 20) -> Iterator[memoryview]:
        """The message bytes as chunks of at most ``chunk_size`` (see ``chunk_views``)."""
        return chunk_views(self.parts, chunk_size)

    def tobytes(self) -> bytes:
        """The whole message as one bytes object (a copy: for small messages and tests)."""
        return b"".join(self.parts)


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
    if mv.nbytes < FRAME_PREFIX.size:
        raise DecodeError(f"truncated: {mv.nbytes} bytes is shorter than the frame prefix")
    magic, version, header_len = FRAME_PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DecodeError(f"unsupported format version {version}, expected {FORMAT_VERSION}")
    return int(header_len)
