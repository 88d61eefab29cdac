"""ATOLL_TRACEMALLOC: the allocation sites that grew after warm-up, named by file and line."""

from __future__ import annotations

import tracemalloc

import pytest

from node.run.memtrace import MemTrace, open_fds


def test_off_unless_asked() -> None:
    trace = MemTrace(env="")
    trace.mark_warm()
    assert not trace.enabled and trace.report() == []


def test_a_bad_setting_says_what_to_give() -> None:
    with pytest.raises(ValueError, match="number of frames"):
        MemTrace(env="yes")


def test_names_the_line_that_kept_memory_after_warm_up() -> None:
    was_tracing = tracemalloc.is_tracing()
    trace = MemTrace(env="1")
    try:
        trace.mark_warm()
        kept = [bytearray(4096) for _ in range(500)]  # ~2 MB held past the end
        lines = trace.report()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    assert lines and "test_memtrace.py" in lines[0] and lines[0].startswith("+2.")
    assert lines[-1].startswith("open file descriptors") and len(kept) == 500


def test_counts_open_descriptors() -> None:
    before = open_fds()
    with open(__file__, "rb"):
        assert open_fds() == before + 1
