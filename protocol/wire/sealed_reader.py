"""``SealedReader``: receives a sealed message chunk by chunk, sans-IO, verifying its envelope
before it allocates the body buffer (the checks are those of ``protocol.wire.opening``)."""

from __future__ import annotations

from protocol.errors import LocalProtocolError
from protocol.wire.codec import BodyReader, Buffer, byte_view
from protocol.wire.opening import Envelope, Opened, envelope_length, open_envelope
from protocol.wire.replay import ReplayWindow
from protocol.wire.sealing import LENGTH_PREFIX

__all__ = ["SealedReader"]


class SealedReader:
    """Receives a sealed message chunk by chunk (sans-IO), verifying the envelope first.

    The body buffer is allocated only once the envelope's signature has verified and its
    declared size is within ``max_size``; the body is hashed once complete (its digest covers
    the head and the blobs apart, see ``protocol.wire.sealing``). ``feed`` raises what
    ``open_envelope`` and ``BodyReader.feed`` raise.
    """

    def __init__(self, max_size: int, buffer: bytearray | None = None) -> None:
        self._head = bytearray()
        self._body = BodyReader(max_size, buffer)
        self.envelope: Envelope | None = None

    @property
    def done(self) -> bool:
        return self.envelope is not None and self._body.done

    @property
    def buffer(self) -> bytearray | None:
        """The body buffer, for reuse by a later reader."""
        return self._body.buffer

    def feed(self, chunk: Buffer) -> None:
        data = byte_view(chunk)
        if self.envelope is None:
            data = self._feed_head(data)
        if self.envelope is not None and data.nbytes:
            self._body.feed(data)

    def _feed_head(self, data: memoryview) -> memoryview:
        while self.envelope is None:
            target = LENGTH_PREFIX.size
            if len(self._head) >= target:
                target += envelope_length(self._head)
            take = target - len(self._head)
            if take == 0:
                envelope = bytes(self._head[LENGTH_PREFIX.size :])
                self.envelope = open_envelope(envelope, max_size=self._body.max_size)
                self._body.expect(self.envelope.size)
            elif data.nbytes == 0:
                break
            else:
                self._head += data[:take]
                data = data[take:]
        return data

    def open(
        self, *, now: float, replay: ReplayWindow, expected_recipient: bytes | None = None
    ) -> Opened:
        """Hash, recipient and replay checks, decode; raises as ``Envelope.open_body``, or
        LocalProtocolError before the message is complete."""
        env = self._complete()
        admitted = env.admit(
            self._body.view(), now=now, replay=replay, expected_recipient=expected_recipient
        )
        return admitted.decode()

    def verify(self) -> Opened:
        """Like ``open`` without the replay window nor a recipient (see ``verify_sealed``)."""
        return self._complete().verify_body(self._body.view())

    def _complete(self) -> Envelope:
        if self.envelope is None or not self._body.done:
            raise LocalProtocolError("sealed message incomplete")
        return self.envelope
