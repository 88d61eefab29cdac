"""A pooled buffer that a live view shows (a learner's version adopted straight from its reply,
``keep_while_viewed``) is never handed out again while the view lives: the pool drops it, so no
later body is read into memory the view shows; once the view is gone the pool takes buffers as
before."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from node.wire.bodies import BufferPool, keep_while_viewed

pytestmark = pytest.mark.timeout(30)


def test_a_viewed_buffer_is_not_pooled_while_its_view_lives_and_the_next_body_gets_other_memory() -> (
    None
):
    pool = BufferPool()
    buf = bytearray(np.arange(1 << 16, dtype=np.float32).tobytes())
    array = np.frombuffer(buf, dtype=np.float32)
    flat = torch.from_numpy(array)[10:]  # a slice keeps the array, and so the pin, alive
    keep_while_viewed(buf, array)
    del array
    pool.give(buf)
    assert pool.held == 0
    other = pool.take(len(buf))
    assert other is not buf
    other[:] = b"\xff" * len(other)  # the next body's bytes land elsewhere
    assert float(flat[0]) == 10.0 and float(flat[-1]) == float((1 << 16) - 1)
    del flat
    gc.collect()
    pool.give(buf)  # no view left: pooled again
    assert pool.held == len(buf) and pool.take(len(buf)) is buf


def test_two_views_of_one_buffer_keep_it_until_both_are_gone() -> None:
    pool, buf = BufferPool(), bytearray(1 << 16)
    first, second = np.frombuffer(buf, dtype=np.uint8), np.frombuffer(buf, dtype=np.uint8)
    keep_while_viewed(buf, first)
    keep_while_viewed(buf, second)
    del first
    gc.collect()
    pool.give(buf)
    assert pool.held == 0
    del second
    gc.collect()
    pool.give(buf)
    assert pool.held == len(buf)
