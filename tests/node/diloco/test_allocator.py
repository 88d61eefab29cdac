"""node.diloco.allocator: tuned, a large tensor comes from glibc's heap, where a freed block stays
for the next one, instead of a mapping of its own that is unmapped when it is freed;
``ATOLL_MALLOC=default`` leaves glibc as it is.

Each case runs in a fresh interpreter: the thresholds are process-wide and set once. Whether a
block is reused warm also depends on where the heap's neighbours lie (torch allocates with
``posix_memalign``), so the tests check where the block comes from, which does not.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# is a new 64 MiB tensor inside the [heap] mapping (glibc's brk heap) or in one of its own?
PROBE = """
import torch
from node.diloco.allocator import tune_allocator
tuned = tune_allocator()
t = torch.empty(16 << 20, dtype=torch.float32)
ptr = t.data_ptr()
where = "elsewhere"
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= ptr < hi:
        where = "heap" if line.rstrip().endswith("[heap]") else "own-mapping"
print(tuned, tune_allocator(), where)
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt",
)


def _run(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=True,
    )
    return out.stdout.split()


@glibc
def test_tuned_a_large_tensor_comes_from_the_heap() -> None:
    assert _run({}) == ["True", "True", "heap"]  # set once; the second call answers the same


@glibc
def test_atoll_malloc_default_leaves_glibc_alone() -> None:
    assert _run({"ATOLL_MALLOC": "default"}) == ["False", "False", "own-mapping"]
