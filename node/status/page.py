"""The status page's routes: ``/`` (HTML), ``/status.js`` (its one script), the JSON it polls
(``/v1/status/board``) and the Prometheus text (``/metrics``).

The HTML and the script are files beside this module, read once on first use and served as they
are: no template, no build step, nothing fetched from elsewhere (the page works offline). The
script draws with DOM calls only; a Content-Security-Policy lets the page run its own script and
nothing else (no inline script, no other origin, its one inline style by hash), so even a remote
string that got past the script's escaping could not run. The JSON and metrics bodies come from
coroutine functions: a node's board (which caches its own rendering), or ``atoll status
--serve``'s proxy (``node.status.serve``), which asks the peer and raises an
``aiohttp.web.HTTPException`` (a 502 saying why) when it cannot.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

__all__ = ["BOARD_PATH", "METRICS_PATH", "Body", "add_routes", "security_policy"]

STATIC = Path(__file__).with_name("static")
BOARD_PATH = "/v1/status/board"
METRICS_PATH = "/metrics"
_STYLE = re.compile(r"<style>(.*?)</style>", re.S)
_COMMON = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
Body = Callable[[], Awaitable[bytes]]  # a route's body; may raise web.HTTPException


@functools.cache
def _static(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@functools.cache
def security_policy() -> str:
    """The page's CSP: its own script and JSON, and its inline style by hash; nothing else."""
    style = _STYLE.search(_static("page.html").decode())
    digest = base64.b64encode(
        hashlib.sha256(style.group(1).encode() if style else b"").digest()
    ).decode()
    return (
        "default-src 'none'; script-src 'self'; connect-src 'self'; "
        f"style-src 'sha256-{digest}'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def add_routes(
    app: web.Application,
    *,
    board: Body,
    metrics: Body,
    metrics_type: str,
) -> None:
    """Serve the page on ``app`` (before it starts); ``board`` and ``metrics`` give the bodies of
    the JSON and of ``/metrics`` (whose content type is ``metrics_type``)."""

    async def page(_request: web.Request) -> web.Response:
        return web.Response(
            body=_static("page.html"),
            content_type="text/html",
            charset="utf-8",
            headers={**_COMMON, "Content-Security-Policy": security_policy()},
        )

    async def script(_request: web.Request) -> web.Response:
        return web.Response(
            body=_static("status.js"),
            content_type="text/javascript",
            charset="utf-8",
            headers=_COMMON,
        )

    async def board_json(_request: web.Request) -> web.Response:
        return web.Response(
            body=await board(),
            content_type="application/json",
            headers={**_COMMON, "Cache-Control": "no-store"},
        )

    async def metrics_text(_request: web.Request) -> web.Response:
        return web.Response(
            body=await metrics(),
            headers={**_COMMON, "Content-Type": metrics_type, "Cache-Control": "no-store"},
        )

    app.router.add_get("/", page)
    app.router.add_get("/status.js", script)
    app.router.add_get(BOARD_PATH, board_json)
    app.router.add_get(METRICS_PATH, metrics_text)
