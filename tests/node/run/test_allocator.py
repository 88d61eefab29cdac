"""node.run.allocator: with glibc's thresholds raised, a freed large tensor's pages are reused
(no new page faults the second time); ``ATOLL_MALLOC=default`` leaves glibc as it is.

Each case runs in a fresh interpreter: the thresholds are process-wide and set once.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# faults while writing a second 128 MiB tensor after the first is freed (4 KiB pages: 32768)
PROBE = """
import resource, torch
from node.run.allocator import tune_allocator
tuned = tune_allocator()
def faults_writing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(32 << 20, dtype=torch.float32).fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_writing()
print(tuned, tune_allocator(), faults_writing())
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                           reason="glibc's mallopt")


def _run(env: dict[str, str]) -> tuple[str, str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=True)
    tuned, again, faults = out.stdout.split()
    return tuned, again, int(faults)


@glibc
def test_tuned_the_second_large_tensor_takes_warm_pages() -> None:
    tuned, again, faults = _run({})
    assert (tuned, again) == ("True", "True")  # set once, the second call answers the same
    assert faults < 1000  # the freed block stayed in the heap


@glibc
def test_atoll_malloc_default_leaves_glibc_alone() -> None:
    tuned, again, faults = _run({"ATOLL_MALLOC": "default"})
    assert (tuned, again) == ("False", "False")
    assert faults > 16000  # glibc unmapped the block: every page faults again
