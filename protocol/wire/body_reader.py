"""``BodyReader``, the sans-IO receiving side for streamed bodies: it copies chunks once into one
preallocated (optionally reused) buffer, refusing a declared size over its cap before
allocating. ``protocol.wire.codec`` re-exports it.
"""

from __future__ import annotations

import struct

from protocol.errors import DecodeError, LocalProtocolError, Oversize
from protocol.wire.framing import Buffer, byte_view

__all__ = ["BodyReader"]


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
