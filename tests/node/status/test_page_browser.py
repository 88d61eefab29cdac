"""The status page in headless Chromium, fed a board whose member strings are hostile: the page
draws the member list, the fragments and the charts, shows every remote string as text (no element
or link is made from one), and the browser reports no script error or policy violation."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from node.status.page import add_routes
from tests.node.status.chromium import Rendered, need_chromium, render

pytestmark = pytest.mark.timeout(120)

ME, OTHER, EVIL = "a1" * 32, "b2" * 32, "c3" * 32
EVIL_LAB = '<img src=x id="injected-lab" onerror="document.title=\'pwned\'">'
EVIL_URL = 'http://x/"><script id="injected-url">document.title="pwned"</script>'


def _member(peer_id: str, **kw: Any) -> dict[str, Any]:
    return {
        "peer_id": peer_id,
        "lab": "",
        "url": "http://127.0.0.1:1",
        "roles": ["learner", "owner"],
        "reachable": True,
        "learning": True,
        "step": 40,
        "self": False,
        "suspect": False,
        **kw,
    }


BOARD = {
    "swarm": "unit",
    "peer_id": ME,
    "url": "http://127.0.0.1:1",
    "reachable": True,
    "learning": True,
    "step": 40,
    "loss": 2.5,
    "members": [
        _member(ME, self=True, lab="lab-a"),
        _member(OTHER, suspect=True),
        _member(EVIL, lab=EVIL_LAB, url=EVIL_URL, roles=["<b>owner</b>"]),
    ],
    "members_total": 3,
    "fragments": [
        {
            "fragment": 0,
            "owner_id": ME,
            "owner_url": "http://127.0.0.1:1",
            "version": 4,
            "owned": 4,
            "epoch": 0,
        },
        {
            "fragment": 1,
            "owner_id": EVIL,
            "owner_url": EVIL_URL,
            "version": 3,
            "owned": None,
            "epoch": None,
        },
    ],
    "history": [[100.0 + i, 10 * i, 4.0 - 0.3 * i, 1000 * i * i, 800 * i * i] for i in range(6)],
    "validation": [[0, 4.2], [25, 3.4], [50, 2.9]],
    "totals": {
        "bytes_sent": 25000,
        "bytes_received": 20000,
        "members": 3,
        "suspects": 1,
        "remote_errors": {},
        "island": {
            "inner_steps": 40,
            "tokens_trained": 0,
            "stalled_steps": 0,
            "goodput": 0.8,
            "contributions": {"sent": 8, "accepted": 7},
            "resyncs": 0,
            "version_jumps": 0,
        },
        "owners": {
            "merged": 5,
            "late": 1,
            "dropped": 0,
            "refused": {"closed": 2},
            "bounded": {},
            "versions_published": 4,
            "merge_seconds": 0.2,
            "fragments_owned": 1,
        },
    },
}


@pytest.fixture
async def page_url() -> AsyncIterator[str]:
    app = web.Application()

    async def board() -> bytes:
        return json.dumps(BOARD).encode()

    async def metrics() -> bytes:
        return b""

    add_routes(app, board=board, metrics=metrics, metrics_type="text/plain")
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


def _rows(dom: str, cls: str) -> list[str]:
    return re.findall(rf'<tr class="{cls}[^"]*"[^>]*>.*?</tr>', dom, re.S)


async def test_the_page_draws_members_fragments_and_charts_from_hostile_strings_as_text(
    page_url: str,
) -> None:
    need_chromium()
    shown: Rendered = await asyncio.to_thread(render, page_url)
    dom = shown.dom
    members = _rows(dom, "member")
    assert [re.search(r'data-peer="([0-9a-f]+)"', r).group(1) for r in members] == [ME, OTHER, EVIL]  # type: ignore[union-attr]
    assert (
        "(this node)" in members[0]
        and "lab-a" in members[0]
        and "refuses connections" in members[1]
    )
    # hostile strings are text: escaped in the DOM, no element made from them, the page's title untouched
    assert (
        '&lt;img src=x id="injected-lab"' in members[2] and "&lt;b&gt;owner&lt;/b&gt;" in members[2]
    )
    assert '&lt;script id="injected-url"&gt;' in members[2]
    assert 'id="injected-lab"' not in dom.replace('&lt;img src=x id="injected-lab"', "")
    assert (
        "<script id=" not in dom and "<b>owner" not in dom and "pwned" not in dom.split("<body")[0]
    )
    assert 'href="http://x' not in dom  # remote addresses never become links
    assert len(_rows(dom, "fragment")) == 2
    loss = re.search(
        r'<polyline[^>]*data-series="loss"[^>]*data-points="(\d+)"[^>]*points="([^"]+)"', dom
    )
    assert loss is not None and int(loss.group(1)) == 6 and len(loss.group(2).split()) == 6
    held = re.search(r'<polyline[^>]*data-series="validation loss"[^>]*data-points="(\d+)"', dom)
    assert held is not None and int(held.group(1)) == 3  # the held-out curve beside it
    assert re.search(r'data-series="sent" data-points="6"', dom) and re.search(
        r'data-series="received"', dom
    )
    assert "<dd>80.0 %</dd>" in dom and "<dd>5 (1)</dd>" in dom  # goodput; merged here (late)
    problems = [
        line for line in shown.console if "Content Security Policy" in line or "Uncaught" in line
    ]
    assert not problems, problems
