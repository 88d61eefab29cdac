"""bench.averaging_threads: a round's CPU and fresh pages, read per thread and told by role."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from bench.averaging_threads import ThreadTimes, role_of

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task"),
]


def test_roles_follow_the_threads_names() -> None:
    assert role_of("atoll-node") == "loop"
    assert role_of("asyncio_3") == "workers"
    assert role_of("raw-http") == "raw"
    assert role_of("MainThread") == "trainer"
    assert role_of("Thread-7 (_pump)") == "other"


def _work(pages: int, out: list[bytearray]) -> None:
    """Burn ~0.2 s of CPU, then write one byte into each page of a fresh ``pages``-page buffer."""
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
    buf = bytearray(pages * 4096)  # zeroed by the kernel's fresh pages, touched here
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    out.append(buf)


def test_a_threads_cpu_and_fresh_pages_count_under_its_role_only() -> None:
    # counters are read while the threads live (a finished thread's are gone with it)
    kept: list[bytearray] = []
    done = threading.Event()
    waiting = threading.Thread(target=done.wait, name="atoll-node")
    working = threading.Thread(target=lambda: (_work(4096, kept), done.wait()), name="asyncio_1")
    waiting.start()
    before = ThreadTimes.now([working, waiting])  # not started yet: read as nothing
    working.start()
    while not kept:
        time.sleep(0.01)
    spent = ThreadTimes.now([working, waiting]).since(before)
    done.set()
    working.join()
    waiting.join()
    workers = spent["workers"]
    assert workers["user_s"] + workers["sys_s"] >= 0.1, spent
    assert workers["minflt"] >= 2048, spent  # 16 MiB of fresh pages, 4096 of them
    assert "loop" not in spent, spent  # it only waited
