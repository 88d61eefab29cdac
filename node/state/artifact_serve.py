"""``GET /v1/artifacts/{sha256}``: a peer hands the artifacts it holds to members, in ranges.

Behind the same admission as every route (in a certified swarm a member's certificate; in an
open one any key or none), and unbound (``protocol.wire.request_checks.unbound_ok``): an
artifact proves itself by its hash, so a joiner may ask an initial peer before it knows whom it
reaches. Each answer is one range of at most ``ARTIFACT_PIECE`` bytes (``Range: bytes=S-E``,
206 with ``Content-Range``; a small artifact whole without a range), read off disk in a worker
thread; replies to one address at a time are capped like every streamed reply (429 beyond).
A peer that lacks the artifact answers 404 with the addresses of members it knows (at most
``MAX_HINTS``), where the asker may look next. Nothing here is ever a 500: a bad hash or range
is a 400/416 with the reason.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from aiohttp import web

from node.state.artifacts import ArtifactStore
from node.wire.transport import Transport
from protocol.errors import DecodeError
from protocol.wire.recipe import is_sha256

__all__ = ["ARTIFACT_PATH", "ARTIFACT_PIECE", "MAX_HINTS", "ArtifactServer"]

ARTIFACT_PATH = "/v1/artifacts/{digest}"
ARTIFACT_PIECE = 4 << 20  # the most bytes one answer carries
MAX_HINTS = 8
_RANGE = re.compile(r"bytes=([0-9]{1,15})-([0-9]{0,15})")


class ArtifactServer:
    """Serves ``store``'s artifacts; ``hints()``: member addresses to name when one is missing."""

    def __init__(
        self,
        store: ArtifactStore,
        transport: Transport,
        hints: Callable[[], list[str]] = list,
    ) -> None:
        self.store, self.transport, self.hints = store, transport, hints
        self.served_bytes = 0
        self.misses = 0

    def status(self) -> dict[str, int]:
        """For ``/v1/status``: bytes served, asks for artifacts not held here."""
        return {"served_bytes": self.served_bytes, "misses": self.misses}

    def install(self) -> None:
        self.transport.app.router.add_get(ARTIFACT_PATH, self.on_get)

    async def on_get(self, request: web.Request) -> web.Response:
        digest = request.match_info["digest"]
        if not is_sha256(digest):
            raise DecodeError(f"{digest[:80]!r} is not an artifact hash (64 lower-case hex digits)")
        if not self.store.has(digest):
            self.misses += 1
            return web.json_response(
                {
                    "reason": f"artifact {digest[:16]} is not held here",
                    "peers": self.hints()[:MAX_HINTS],
                },
                status=404,
            )
        size = self.store.size(digest)
        start, end = self._range(request.headers.get("Range"), size)
        if start >= size and size > 0:
            return web.json_response(
                {"reason": f"range starts at {start}, past the artifact's {size} bytes"},
                status=416,
                headers={"Content-Range": f"bytes */{size}"},
            )
        with self.transport.streaming(request):
            body = await asyncio.to_thread(self.store.read_range, digest, start, end - start)
        self.served_bytes += len(body)
        if request.headers.get("Range") is None:
            return web.Response(body=body, content_type="application/octet-stream")
        return web.Response(
            status=206,
            body=body,
            content_type="application/octet-stream",
            headers={"Content-Range": f"bytes {start}-{start + len(body) - 1}/{size}"},
        )

    @staticmethod
    def _range(header: str | None, size: int) -> tuple[int, int]:
        """``[start, end)`` of the answer: the range asked for, at most ``ARTIFACT_PIECE`` long.
        Raises ``DecodeError`` for a malformed range, or no range on an artifact past one piece."""
        if header is None:
            if size > ARTIFACT_PIECE:
                raise DecodeError(
                    f"the artifact is {size} bytes: ask for it in ranges "
                    f"(Range: bytes=START-END, at most {ARTIFACT_PIECE} bytes each)"
                )
            return 0, size
        match = _RANGE.fullmatch(header.strip())
        if match is None:
            raise DecodeError(f"Range {header[:60]!r} is not bytes=START-END")
        start = int(match.group(1))
        last = int(match.group(2)) if match.group(2) else start + ARTIFACT_PIECE - 1
        if last < start:
            raise DecodeError(f"Range {header[:60]!r} ends before it starts")
        return start, min(size, last + 1, start + ARTIFACT_PIECE)
