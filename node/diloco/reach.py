"""How a learner reaches the peers it asks: who owns a fragment, where a peer is, and their
replies over the transport; a peer that refuses connections is reported (``on_unreachable``).

``reply`` is ``Transport.reply``: the buffer goes back to the pool on leaving the block.
``keepable`` is the same for a reply whose pooled buffer may be taken over (``KeptReply.take``):
a verified version is kept for other learners as the very bytes received, not a copy
(``Holdings.put``), which ``Transport.reply`` cannot allow since it always gives the buffer back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from node.wire.transport import BufferPool, Reply, Transport

__all__ = ["KeptReply", "Reach"]


class KeptReply:
    """A reply from ``Reach.keepable``: ``status``, ``body`` (valid inside the block unless its
    buffer is taken) and ``headers``."""

    def __init__(
        self, status: int, buf: bytearray, used: int, headers: dict[str, str], pool: BufferPool
    ) -> None:
        self.status, self.headers, self._pool = status, headers, pool
        self.body = memoryview(buf)[:used]
        self._buf: bytearray | None = buf
        self._used = used

    def take(self) -> tuple[bytearray, int]:
        """The pooled buffer and its length, now the caller's (it gives the buffer back)."""
        if self._buf is None:
            raise RuntimeError("the reply's buffer was taken already")
        buf, self._buf = self._buf, None
        return buf, self._used

    def close(self) -> None:
        """Give the buffer back to the pool, unless it was taken."""
        with contextlib.suppress(BufferError):  # a view the caller kept: it stays valid
            self.body.release()
        if self._buf is not None:
            self._pool.give(self._buf)
            self._buf = None


class Reach:
    """The learner's way to the owners and holders it asks."""

    def __init__(
        self,
        transport: Transport,
        owner_of: Callable[[int], tuple[bytes, str] | None],
        *,
        url_of: Callable[[bytes], str | None] | None = None,
        on_unreachable: Callable[[bytes], None] | None = None,
    ) -> None:
        """``owner_of(p)``: fragment ``p``'s owner as ``(peer id, url)`` (None: none known);
        ``url_of(peer id)``: a member's address in our own view (None: not a member we know)."""
        self.transport, self.owner_of = transport, owner_of
        self._url_of, self.on_unreachable = url_of, on_unreachable

    def url_of(self, peer_id: bytes) -> str | None:
        return self._url_of(peer_id) if self._url_of is not None else None

    @contextlib.asynccontextmanager
    async def reply(self, peer_id: bytes, method: str, url: str, **kw: Any) -> AsyncIterator[Reply]:
        """``Transport.reply`` from ``peer_id``. Raises as ``Transport.request``."""
        asked = False
        try:
            async with self.transport.reply(method, url, **kw) as r:
                asked = True
                yield r
        except aiohttp.ClientConnectorError:
            if not asked:  # the request's own failure, not one raised inside the block
                self._unreachable(peer_id)
            raise

    @contextlib.asynccontextmanager
    async def keepable(
        self, peer_id: bytes, method: str, url: str, **kw: Any
    ) -> AsyncIterator[KeptReply]:
        """A reply from ``peer_id`` whose buffer goes back to the pool on exit unless taken
        (``KeptReply.take``). Raises as ``Transport.request``."""
        try:
            status, buf, used, headers = await self.transport.request(method, url, **kw)
        except aiohttp.ClientConnectorError:
            self._unreachable(peer_id)
            raise
        r = KeptReply(status, buf, used, headers, self.transport.pool)
        try:
            yield r
        finally:
            r.close()

    def _unreachable(self, peer_id: bytes) -> None:
        if self.on_unreachable is not None:
            self.on_unreachable(peer_id)
