"""glibc's allocator, tuned for a process that allocates the same large tensors round after round.

glibc serves an allocation above its mmap threshold (128 KiB at start, rising to at most 32 MiB
as large blocks are freed) with fresh pages from the kernel and unmaps them when it is freed.
Every pseudo-gradient, decode buffer and global fragment of a model larger than that then pays
the kernel's page faults and zeroing again each round: on the 2-core box, writing a new 200 MB
tensor took 92 ms against 11.5 ms for one whose pages were reused (``src * 2`` on 50M fp32
values, median of five). ``tune_allocator`` raises the mmap threshold to 1 GiB and the trim
threshold to 2 GiB, so freed blocks stay in the heap and the next tensor of that size takes
them warm, and keeps every thread on the one main heap (``M_ARENA_MAX`` 1): a worker thread's
own arena does not keep its freed blocks by those thresholds, and the codecs, hashes and
decodes all run in worker threads. A freed block is not always taken by the next tensor of its
size (torch allocates with ``posix_memalign``, which may need a little more than the block), so
some fresh pages remain; what it gave in ``bench.averaging`` (4 × 50M, Atoll alone on the box,
medians of five rounds after three, 2026-12-02): Atoll's int4 round 1.07 and 1.27 s tuned
against 1.60 s and 5–7 s with glibc as it comes; fp32 1.01 and 1.11 s against 1.14 and 1.08 s.

The price: a process keeps the heap it peaked at (its resident size no longer drops after a
spike), which for a peer that allocates the same sizes every round is what it holds anyway.
``ATOLL_MALLOC=default`` leaves the allocator as it is. Elsewhere than glibc (macOS, musl) this
does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import cast

from node.config import LARGE_MODEL_BYTES

__all__ = [
    "LARGE_MODEL_BYTES",
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "bound_for_model",
    "heap_in_use",
    "tune_allocator",
]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 1 << 31
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
_tuned: bool | None = None


def tune_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds and keep one arena, once per process (see the
    module docstring). Call it before the process starts its worker threads.

    Returns whether both were raised; False under ``ATOLL_MALLOC=default``, off glibc, or when
    glibc refuses the trim threshold. Versions of glibc that cap the mmap threshold at 32 MiB
    get that cap instead of 1 GiB."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get(
        "ATOLL_MALLOC", ""
    ).strip().lower() == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no such symbol)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) or bool(
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    )
    trim_ok = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    one_arena = bool(mallopt(_M_ARENA_MAX, 1))  # threads started from now on share the main heap
    _tuned = mmap_ok and trim_ok
    log.debug(
        "glibc allocator: mmap threshold raised %s, trim threshold raised %s, one arena %s",
        mmap_ok,
        trim_ok,
        one_arena,
    )
    return _tuned


# for such a model, what has pages of its own: every tensor of GPT-2 small but its biases and
# LayerNorm gains (the smallest matrix, 768 x 768 fp32, is 2.4 MB), and every per-tensor residual
# and code buffer the codecs make of them
LARGE_MMAP_THRESHOLD = 1 << 20


def bound_for_model(model_bytes: int, *, sharded: bool = False) -> bool:
    """For a model of ``model_bytes`` fp32 bytes at or above ``LARGE_MODEL_BYTES``: lower the
    mmap threshold to 1 MiB and the trim threshold to it, so every tensor of a MB or more gets
    pages of its own and gives them back when freed. Tuned for small models, the heap kept up to
    2 GiB of freed blocks besides fragmentation: at 124M parameters a peer's resident size was
    ~2 GB (4x the model) above the bytes it had in use; with the threshold at 32 MiB the codecs'
    per-tensor residuals and codes (up to 9.4 MB each at 124M) still churned through the heap and
    kept it ~0.9 GB above them (docs/scale.md). The price is the page faults of each fresh tensor
    (~0.5 ms per MB here). ``sharded``: a rank of an FSDP island, bound whatever the size: FSDP's
    all-gather and reduce-scatter buffers come and go every step, and kept in the heap they cost
    about what sharding saves (docs/islands.md). Returns whether it changed anything (False
    under ``ATOLL_MALLOC=default``, off glibc, or below the size)."""
    if (model_bytes < LARGE_MODEL_BYTES and not sharded) or not tune_allocator():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, LARGE_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, LARGE_MMAP_THRESHOLD)
    )
    log.info(
        "a %d MB model: freed tensors above %d KiB go back to the system",
        model_bytes >> 20,
        LARGE_MMAP_THRESHOLD >> 10,
    )
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [], _MallInfo2
    return cast("Callable[[], _MallInfo2]", fn)


def heap_in_use() -> int | None:
    """Bytes the C heap has handed out and not had back (glibc's ``mallinfo2``: the main heap's
    allocated chunks plus its mmapped ones): torch's CPU tensors, numpy arrays, the codecs'
    buffers; not Python's own small objects (pymalloc's arenas) nor freed blocks the heap keeps.
    A peer whose resident size climbs while this stays flat is keeping freed memory, not leaking.
    ``None`` off glibc or before 2.33 (no ``mallinfo2``)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)
