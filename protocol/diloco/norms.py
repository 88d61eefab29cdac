"""The Euclidean norm of a large fp32 tensor, accumulated in fp64, fast.

``torch.linalg.vector_norm(t, dtype=torch.float64)`` first converts the whole tensor to fp64 (a
new tensor twice its size: ~1 GB/s on a small machine, most of an owner's decode time).
``norm64`` converts ``CHUNK`` elements at a time into one reused, cache-sized fp64 buffer and
sums their squares in fp64: the same precision and range (a finite fp32 tensor of up to 2^31
elements cannot overflow fp64, so the result is finite exactly when every element is), ~10x
faster. The summation order differs from torch's, so the last bits may too.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CHUNK", "all_finite", "norm64"]

CHUNK = 1 << 18  # elements per fp64 conversion: 2 MiB, within a core's L2 cache


def norm64(t: torch.Tensor) -> float:
    """The fp64-accumulated L2 norm of ``t`` (any float dtype and shape; read, never written).

    NaN when ``t`` holds a NaN, Inf when it holds an Inf (and no NaN).
    """
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= CHUNK:
        return float(torch.linalg.vector_norm(flat, dtype=torch.float64))
    buf = torch.empty(CHUNK, dtype=torch.float64, device=flat.device)
    total = 0.0
    for start in range(0, n, CHUNK):
        part = flat[start:start + CHUNK]
        b = buf[: part.numel()]
        b.copy_(part)
        total += float(torch.dot(b, b))
    return math.sqrt(total)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: one min/max pass (a NaN propagates into both),
    no temporary (``torch.isfinite(t).all()`` builds a bool tensor: ~10x slower)."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t.detach().reshape(-1))
    return bool(torch.isfinite(low) & torch.isfinite(high))
