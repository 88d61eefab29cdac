"""Serving a sealed fragment to hostile askers: Range headers of thousands of digits or garbage
never make a 500, refusals say why, and an asker that hangs up is no error in the log."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from node.state.serve import (
    MAX_RANGE_DIGITS,
    RangeNotSatisfiable,
    parse_range,
    serve_sealed,
    state_etag,
)
from node.wire.transport import Transport
from tests.node.state.test_sync import make_state

pytestmark = pytest.mark.timeout(20)

HUGE = "9" * 5000  # past Python's int-parsing limit of 4300 digits


def test_range_positions_of_thousands_of_digits_are_refused_unparsed() -> None:
    for value in (f"bytes={HUGE}-", f"bytes=-{HUGE}", f"bytes=0-{HUGE}", f"bytes={'1' * 20}-"):
        with pytest.raises(RangeNotSatisfiable, match=f"more than {MAX_RANGE_DIGITS} digits"):
            parse_range(value, 100)
    assert parse_range(f"bytes=0-{'9' * MAX_RANGE_DIGITS}", 100) == (0, 100)
    assert parse_range("bytes=٣-", 100) is None  # non-ASCII digits are not a range


@pytest.fixture
async def served() -> AsyncIterator[tuple[Transport, bytes]]:
    sealed, _ = make_state(300_000)  # 1.2 MB: more than one reply chunk
    t = Transport()

    async def fragment(request: web.Request) -> web.StreamResponse:
        return await serve_sealed(request, t, sealed, etag=state_etag(sealed, 1))

    t.app.router.add_get("/f", fragment)
    await t.start()
    try:
        yield t, sealed.tobytes()
    finally:
        await t.close()


async def test_hostile_range_headers_get_416_with_a_reason_or_the_whole_body(
    served: tuple[Transport, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    t, wire = served
    async with aiohttp.ClientSession() as session:
        for value in (
            f"bytes={HUGE}-",
            f"bytes=-{HUGE}",
            f"bytes=0-{HUGE}",
            f"bytes={'7' * 3000}-",
        ):
            async with session.get(f"{t.url}/f", headers={"Range": value}) as r:
                body = await r.read()
                assert r.status == 416 and r.headers["Content-Range"] == f"bytes */{len(wire)}"
                assert json.loads(body)["reason"], body
        for value in (
            "bytes=abc",
            "bytes=5-2",
            "bytes=0-1,4-5",
            "items=0-5",
            "bytes=",
            "bytes=1-2-3",
        ):
            async with session.get(f"{t.url}/f", headers={"Range": value}) as r:
                assert (r.status, await r.read()) == (200, wire), (
                    value
                )  # ignored, as RFC 9110 allows
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_asker_that_hangs_up_is_no_error(
    served: tuple[Transport, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    t, _ = served
    caplog.set_level(logging.DEBUG)
    for read_first in (0, 1000):
        for _ in range(5):
            r, w = await asyncio.open_connection("127.0.0.1", t.port)
            w.write(b"GET /f HTTP/1.1\r\nHost: x\r\n\r\n")
            await w.drain()
            if read_first:
                await r.readexactly(read_first)
            w.close()
    async with aiohttp.ClientSession() as session, session.get(f"{t.url}/f") as resp:
        assert resp.status == 200 and len(await resp.read()) > 0  # still serving
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
