"""The averaging bench's limit: the same bytes over plain aiohttp, in Atoll's pattern, no work.

Each peer runs a bare aiohttp server on its own thread and event loop. One raw cycle moves what
one Atoll cycle moves, between the same processes (or, against Atoll's int8, what its fp32
cycle moves): every peer POSTs each fragment's bytes (4 per value, 2 with the 16-bit codec)
to that fragment's owner, one fragment after the other as Atoll's learner does, while it
long-polls every owner for the fragment's result; an owner answers those polls once all N
peers' bytes for the fragment are in. Bodies are read into buffers allocated once and reused
(an owner reads every sender's body of a fragment into the same one: nothing reads them, and
at 4 x 124M a buffer per sender was 1.5 GB of the box's memory); nothing is compressed, signed,
hashed, checked or merged.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiohttp
import torch
from aiohttp import web

__all__ = ["RawSide"]

READ_CHUNK = 1 << 20


class RawSide:
    """One peer's raw server and client (see the module docstring)."""

    def __init__(
        self,
        *,
        index: int,
        peers: int,
        fragment_values: list[int],
        bytes_per_value: int,
        source: list[torch.Tensor] | None = None,
    ) -> None:
        """``source``: each fragment's tensor to send the bytes of (the model's own memory, so
        the raw side costs no second copy); zeros of the same size without it."""
        self.index, self.peers = index, peers
        self.sizes = [n * bytes_per_value for n in fragment_values]
        if source is None:
            source = [torch.zeros(n) for n in fragment_values]
        self.source = [
            t.detach().reshape(-1).view(torch.uint8)[:s]
            for t, s in zip(source, self.sizes, strict=True)
        ]
        self.inbox: dict[int, bytearray] = {}  # fragment -> where every sender's bytes land
        self.result = [bytearray(s) for s in self.sizes]  # what we fetch, per fragment
        self.owners: list[str] = []
        self._arrived: dict[tuple[int, int], int] = {}  # (round, fragment) -> senders in
        self._ready: dict[tuple[int, int], asyncio.Event] = {}
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="raw-http", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> str:
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("the raw server did not start within 60 s")
        return self.url

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        app = web.Application(client_max_size=max(self.sizes) + (1 << 20))
        app.router.add_post("/raw/{round}/{p}/{sender}", self._on_post)
        app.router.add_get("/raw/{round}/{p}", self._on_get)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        self._stop = asyncio.Event()
        self._started.set()
        await self._stop.wait()
        await self.session.close()
        await runner.cleanup()

    def close(self) -> None:
        if self._started.is_set():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=15)

    # --- server --------------------------------------------------------------------------------
    def _event(self, round_: int, p: int) -> asyncio.Event:
        return self._ready.setdefault((round_, p), asyncio.Event())

    async def _on_post(self, request: web.Request) -> web.Response:
        r, p, sender = (int(request.match_info[k]) for k in ("round", "p", "sender"))
        buf = self.inbox.get(p)
        if buf is None:
            buf = self.inbox[p] = bytearray(self.sizes[p])
        view, got = memoryview(buf), 0
        async for chunk in request.content.iter_chunked(READ_CHUNK):
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        if got != self.sizes[p]:
            return web.Response(status=400, text=f"got {got} bytes, expected {self.sizes[p]}")
        self._arrived[(r, p)] = self._arrived.get((r, p), 0) + 1
        if self._arrived[(r, p)] == self.peers:
            self._event(r, p).set()
        return web.Response(text="ok")

    async def _on_get(self, request: web.Request) -> web.Response:
        r, p = int(request.match_info["round"]), int(request.match_info["p"])
        await asyncio.wait_for(self._event(r, p).wait(), timeout=600)
        body = self.inbox[p] if p in self.inbox else self.source[p].numpy().data
        return web.Response(body=memoryview(body))

    # --- one cycle ------------------------------------------------------------------------------
    def cycle(self, round_: int, timeout_s: float) -> dict[str, Any]:
        """Send every fragment to its owner and fetch every result; blocks the caller's thread."""
        fut = asyncio.run_coroutine_threadsafe(self._cycle(round_), self.loop)
        try:
            fut.result(timeout_s)
        except Exception as exc:
            fut.cancel()
            return {"ok": False, "error": repr(exc)}
        return {"ok": True}

    async def _cycle(self, round_: int) -> None:
        for key in [k for k in self._ready if k[0] < round_]:  # earlier rounds' bookkeeping
            del self._ready[key]
            self._arrived.pop(key, None)
        fetches = [asyncio.ensure_future(self._fetch(round_, p)) for p in range(len(self.sizes))]
        try:
            for p in range(len(self.sizes)):
                url = f"{self.owners[p]}/raw/{round_}/{p}/{self.index}"
                async with self.session.post(url, data=self.source[p].numpy().data) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"raw POST {url}: {resp.status} {await resp.text()}")
            await asyncio.gather(*fetches)
        finally:
            for f in fetches:
                f.cancel()

    async def _fetch(self, round_: int, p: int) -> None:
        view, got = memoryview(self.result[p]), 0
        async with self.session.get(f"{self.owners[p]}/raw/{round_}/{p}") as resp:
            if resp.status != 200:
                raise RuntimeError(f"raw GET fragment {p}: {resp.status}")
            async for chunk in resp.content.iter_chunked(READ_CHUNK):
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
        if got != self.sizes[p]:
            raise RuntimeError(f"raw GET fragment {p}: {got} bytes, expected {self.sizes[p]}")
