"""How a learner reaches the peers it asks: who owns a fragment, where a peer is, and their
replies over the transport; a peer that refuses connections is reported (``on_unreachable``).

``reply`` is ``Transport.reply``: the buffer goes back to the pool on leaving the block unless
taken (``Reply.take``: a verified version is kept for other learners as the very bytes received,
``Holdings.put``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from node.wire.transport import Reply, Transport

__all__ = ["FIND_WAIT_S", "Reach"]

# How long a learner waits for a lookup of the holders a pointer names that its view lacks: one
# DHT request by id (a bounded view holds the roster and the members it wanted lately only)
FIND_WAIT_S = 3.0


class Reach:
    """The learner's way to the owners and holders it asks."""

    def __init__(
        self,
        transport: Transport,
        owner_of: Callable[[int], tuple[bytes, str] | None],
        *,
        url_of: Callable[[bytes], str | None] | None = None,
        on_unreachable: Callable[[bytes], None] | None = None,
        find: Callable[[Sequence[bytes]], Awaitable[None]] | None = None,
    ) -> None:
        """``owner_of(p)``: fragment ``p``'s owner as ``(peer id, url)`` (None: none known);
        ``url_of(peer id)``: a member's address in our own view (None: not a member we know);
        ``find(peer ids)``: look those members up now, into the view ``url_of`` reads."""
        self.transport, self.owner_of = transport, owner_of
        self._url_of, self.on_unreachable, self._find = url_of, on_unreachable, find

    def url_of(self, peer_id: bytes) -> str | None:
        return self._url_of(peer_id) if self._url_of is not None else None

    async def find(self, peer_ids: Sequence[bytes]) -> None:
        """Look up members our view lacks (holders a pointer names), waiting at most
        ``FIND_WAIT_S``; those not found stay unknown (``url_of`` None)."""
        if self._find is None or not peer_ids:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIND_WAIT_S):
                await self._find(peer_ids)

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

    def _unreachable(self, peer_id: bytes) -> None:
        if self.on_unreachable is not None:
            self.on_unreachable(peer_id)
