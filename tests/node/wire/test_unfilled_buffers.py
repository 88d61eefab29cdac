"""A body's fresh buffer is not written before the body's bytes are: ``bytearray(n)`` zeroed
every byte first, one more pass over every byte received (and the page faults of a fresh buffer
paid before the socket's bytes arrived)."""

from __future__ import annotations

import os
import sys

import pytest

from node.wire.bodies import BufferPool, unfilled

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm"),
]

SIZE = 256 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize(
    "make", [unfilled, lambda n: BufferPool().take(n)], ids=["unfilled", "take"]
)
def test_a_fresh_body_buffer_touches_none_of_its_pages_until_bytes_land_in_it(make) -> None:  # type: ignore[no-untyped-def]
    before = _resident_bytes()
    buf = make(SIZE)
    grown = _resident_bytes() - before
    assert len(buf) == SIZE and isinstance(buf, bytearray)
    # a zeroed buffer would be resident whole; the untouched one is not (whatever the allocator
    # reused of its own heap is below this margin)
    assert grown < SIZE // 4, f"{grown >> 20} MiB resident after taking a {SIZE >> 20} MiB buffer"
    buf[:4] = b"abcd"
    buf[-4:] = b"wxyz"
    assert bytes(buf[:4]) == b"abcd" and bytes(buf[-4:]) == b"wxyz"
    del buf
