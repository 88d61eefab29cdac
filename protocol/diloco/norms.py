"""Two reductions every owner and learner runs over each fragment-sized vector: its Euclidean
norm and whether it is finite. Both are hot (an owner measures each contribution, its Θ and
each merged update; every decoded payload is checked), so each takes the fast path a large
fp32 vector allows and falls back to the careful one only where the fast one cannot answer.

``norm64``: ``torch.linalg.vector_norm(t, dtype=torch.float64)`` first converts the whole tensor
to fp64 (a new tensor twice its size). Instead the squares of each ``SUM_CHUNK`` elements are
written into one reused, cache-sized fp32 buffer and summed by torch (its pairwise sum: within
~1e-9 of the fp64 sum for gradient-like data), and the chunks' sums added in fp64; a chunk whose
fp32 sum could not answer (it overflowed, met a NaN/Inf, or landed in fp32's subnormal range) is
measured again in fp64. So the result has fp64's range: a finite fp32 tensor of up to 2^31
elements cannot overflow it, and the result is finite exactly when every element is. Not a BLAS
dot product: MKL takes its thread count from the calling thread, so the same vector gave other
last bits in an owner's worker thread than in ``atoll replay``, whose recomputed merges then
differed; torch's own reductions use the process's ``torch.set_num_threads``.

``all_finite``: one fp32 sum (a NaN or Inf anywhere makes it non-finite; ~2x ``aminmax``'s speed)
and, only when the sum is not finite, ``aminmax`` to tell an overflowing sum of finite values
from a NaN or Inf.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CHUNK", "SUM_CHUNK", "add_squares", "all_finite", "norm64"]

CHUNK = 1 << 18  # elements per fp64 conversion: 2 MiB, within a core's L2 cache
SUM_CHUNK = 1 << 16  # elements squared and summed in fp32 at a time, the sums added in fp64
# An fp32 chunk sum of squares below this may have lost precision to fp32's subnormal range
# (each square of a value under ~1e-19 is rounded there): it is measured again in fp64.
_TINY = 1e-30


def norm64(t: torch.Tensor) -> float:
    """The L2 norm of ``t`` (any float dtype and shape; read, never written), summed in fp64.

    NaN when ``t`` holds a NaN, Inf when it holds an Inf (and no NaN).
    """
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= SUM_CHUNK or flat.dtype != torch.float32 or flat.device.type != "cpu":
        return _norm64_converted(flat)
    return math.sqrt(add_squares(flat, 0.0, torch.empty(SUM_CHUNK, dtype=torch.float32)))


def add_squares(flat: torch.Tensor, total: float, scratch: torch.Tensor) -> float:
    """``total`` plus the squares of the flat fp32 CPU ``flat``, each ``SUM_CHUNK`` of them summed
    as ``norm64`` sums them (``scratch``: an fp32 vector of ``SUM_CHUNK``). Fed a long vector in
    consecutive pieces of a multiple of ``SUM_CHUNK`` values, the square root of the final total
    is ``norm64`` of the whole to the last bit (``protocol.diloco.sliced.norm_of``)."""
    for start in range(0, flat.numel(), SUM_CHUNK):
        part = flat[start : start + SUM_CHUNK]
        squared = scratch[: part.numel()]
        torch.mul(part, part, out=squared)
        squares = float(squared.sum())
        if not (_TINY <= squares < math.inf) and squares != 0.0:
            squares = _squares64(part)
        total += squares
    return total


def _squares64(part: torch.Tensor, buf: torch.Tensor | None = None) -> float:
    """The sum of squares of ``part`` in fp64 (NaN or Inf when it holds one), converted into
    ``buf`` (an fp64 vector at least as long) when given, else into a new one."""
    wide = part.to(torch.float64) if buf is None else buf[: part.numel()].copy_(part)
    return float(wide.mul_(wide).sum())


def _norm64_converted(flat: torch.Tensor) -> float:
    """``norm64`` by converting ``CHUNK`` elements at a time into one reused fp64 buffer."""
    n = flat.numel()
    if n <= CHUNK:
        return float(torch.linalg.vector_norm(flat, dtype=torch.float64))
    buf = torch.empty(CHUNK, dtype=torch.float64, device=flat.device)
    return math.sqrt(
        sum(_squares64(flat[start : start + CHUNK], buf) for start in range(0, n, CHUNK))
    )


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, with no temporary (``torch.isfinite(t).all()``
    builds a bool tensor: ~10x slower): its sum is finite only if every element is; a sum that
    is not (a NaN or Inf, or finite values overflowing it) is answered by one min/max pass, into
    which a NaN propagates."""
    if t.numel() == 0:
        return True
    flat = t.detach().reshape(-1)
    if not flat.is_floating_point():
        return True
    if math.isfinite(float(flat.sum())):
        return True
    low, high = torch.aminmax(flat)
    return bool(torch.isfinite(low) & torch.isfinite(high))
