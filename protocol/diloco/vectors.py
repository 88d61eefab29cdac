"""Fragment-sized fp32 vectors whose memory comes from ``malloc``, for the vectors made and freed
round after round (pseudo-gradients, decoded contributions and versions, merges, outer steps).

torch asks glibc for 64-byte-aligned blocks (``posix_memalign``), and such a request is a few
bytes larger than the block a freed tensor of the same size leaves, so it often misses it and
the heap grows by fresh pages instead, which the kernel zeroes on first touch: in
``bench.averaging`` (4 x 50M) that was ~19 % of a round's CPU. A plain ``malloc`` of a size just
freed takes that block again (docs/benchmarks.md, *Fresh pages*). torch's kernels do not need the
64-byte alignment (numpy's is 16). The tensor frees its block when its last reference goes, as
any other: no pool and no lifetime to track. Pure memory: no I/O, so ``protocol/`` may use it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["copy_vector", "new_vector", "new_vector_like"]


def new_vector(numel: int) -> torch.Tensor:
    """An uninitialised flat fp32 CPU vector of ``numel`` values, its memory from ``malloc``."""
    return torch.from_numpy(np.empty(numel, dtype=np.float32))


def new_vector_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised fp32 tensor of ``t``'s shape: from ``malloc`` when ``t`` is on the CPU,
    else ``torch.empty`` on ``t``'s device."""
    if t.device.type != "cpu":
        return torch.empty(t.shape, dtype=torch.float32, device=t.device)
    return new_vector(t.numel()).view(t.shape)


def copy_vector(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (detached): into ``new_vector_like`` memory for an fp32 tensor, else ``clone``."""
    t = t.detach()
    if t.dtype != torch.float32:
        return t.clone()
    return new_vector_like(t).copy_(t)
