"""What a peer holds beside the model (docs/scale.md's budget): copies that outlive their use."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from node.diloco.received import ReceivedVersions
from node.wire.bodies import POOL_MAX_BYTES, BufferPool, pool_bytes_for_model


def test_version_0_is_released_once_a_later_version_is_held() -> None:
    initial = [torch.ones(1000), torch.ones(500)]
    known = ReceivedVersions(initial, wall_clock=lambda: 0.0)
    assert known.held(0)[0] == 0 and torch.equal(known.held(0)[1], initial[0])
    newer = torch.full((1000,), 2.0)
    known.remember(0, 1, newer)
    assert known.held(0) == (1, newer)  # the newest version, not version 0
    assert known.initial[0].numel() == 0  # its copy (a whole fragment's fp32 bytes) is gone
    assert torch.equal(known.held(1)[1], initial[1])  # fragment 1 still at version 0: kept
    assert known.digest(0, 0) is not None  # contributions on version 0 are still recognised


# with a model at or above LARGE_MODEL_BYTES, is a new 4 MiB tensor in a mapping of its own
# (given back when freed) rather than glibc's heap (kept)? Below it, the heap as tuned.
PROBE = """
import sys, torch
from node.diloco.allocator import bound_for_model, tune_allocator
tune_allocator()  # as the command line does first
bounded = bound_for_model(int(sys.argv[1]))
t = torch.empty(1 << 20, dtype=torch.float32)  # 4 MiB: under the 32 MiB it once was
where = "elsewhere"
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= t.data_ptr() < hi:
        where = "heap" if line.rstrip().endswith("[heap]") else "own-mapping"
print(bounded, where)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt",
)
@pytest.mark.parametrize(
    ("model_bytes", "expected"),
    [(4 * 124_439_808, ["True", "own-mapping"]), (4 * 84_288, ["False", "heap"])],
)
def test_a_large_models_freed_tensors_go_back_to_the_system(
    model_bytes: int, expected: list[str]
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(model_bytes)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "ATOLL_MALLOC"},
        check=True,
    )
    assert out.stdout.split() == expected


def test_a_large_models_body_pool_is_capped_by_the_model() -> None:
    # a small model keeps the fixed cap; GPT-2 small's pool is a sixteenth of its 498 MB
    assert pool_bytes_for_model(4 * 84_288) == POOL_MAX_BYTES
    assert pool_bytes_for_model(4 * 124_439_808) == 4 * 124_439_808 // 16
    pool = BufferPool()
    for size in (8 << 20, 16 << 20, 24 << 20):
        pool.give(bytearray(size))
    pool.bound(30 << 20)  # what is kept beyond the new cap goes now, smallest first
    assert pool.held == 24 << 20 and pool.max_bytes == 30 << 20
    pool.give(bytearray(16 << 20))  # and later gifts keep within it
    assert pool.held <= 30 << 20


def test_version_0_is_the_islands_own_tensors_not_a_copy() -> None:
    # the island's global fragments are values, replaced on adoption: no second copy is held
    initial = [torch.ones(1000), torch.ones(500)]
    known = ReceivedVersions(initial, wall_clock=lambda: 0.0)
    assert all(k is g for k, g in zip(known.initial, initial, strict=True))
