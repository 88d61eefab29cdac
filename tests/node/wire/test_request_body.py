"""A request body that a handler keeps a view of: its pooled buffer goes back only once the
request has ended and the view is gone, so no later body is read into memory a view shows."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import torch

from node.wire.bodies import BufferPool, RequestBody


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_the_buffer_goes_back_once_the_request_ended_and_the_view_is_collected() -> None:
    pool = BufferPool()
    buf = bytearray(64 << 10)
    body = RequestBody(pool, buf, asyncio.get_running_loop())
    array = np.frombuffer(buf, dtype=np.float32, count=16, offset=8)
    assert body.keep_for(array) and not body.keep_for(np.zeros(1))  # one view per body
    view = torch.from_numpy(array)
    part = view[4:8]  # a slice of the tensor keeps its storage, and so the array, alive
    del array, view
    body.end()
    gc.collect()
    await _settle()
    assert pool.take(1) is not buf  # the slice still shows it: not pooled
    del part
    gc.collect()
    await _settle()
    assert pool.take(1) is buf


async def test_a_view_collected_before_the_request_ends_waits_for_the_end() -> None:
    pool = BufferPool()
    buf = bytearray(64 << 10)
    body = RequestBody(pool, buf, asyncio.get_running_loop())
    array = np.frombuffer(buf, dtype=np.float32, count=4)
    assert body.keep_for(array)
    del array
    gc.collect()
    await _settle()
    assert pool.take(1) is not buf  # the handler may still read its message
    body.end()
    assert pool.take(1) is buf


async def test_an_ended_request_lends_its_buffer_to_no_view() -> None:
    """A task the request started still sees its ``RequestBody`` after it ended: the buffer may
    be pooled and refilled by then, so no view may hold it (it would be given back twice)."""
    pool = BufferPool()
    buf = bytearray(64 << 10)
    body = RequestBody(pool, buf, asyncio.get_running_loop())
    body.end()
    assert not body.keep_for(np.frombuffer(buf, dtype=np.float32, count=4))
    assert pool.take(1) is buf and pool.take(1) is not buf  # given back once
