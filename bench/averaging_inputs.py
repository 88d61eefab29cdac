"""The averaging bench's tensors and its correctness checks, the same in every process.

A model of ``params`` fp32 values in ``tensors`` equal 1-D tensors. Every value a peer averages
is a pure function of (seed, what, round, peer, tensor), so any process can regenerate any
peer's input and check a merge without receiving it: the initial weights ``initial(t)`` and each
peer's per-round pseudo-gradient ``delta(r, i, t)``.

A held result is compared with references computed from the inputs of a set of peers (all of
them; the survivors of a kill): its error relative to the update it should have made,
``|held - ref| / |ref - base|``, must stay below ``tolerance(codec)``. Dropping one of N
contributions moves an update by roughly 1/sqrt(N) or more (tens of per cent), while codec
rounding moves it by well under one per cent, so the threshold separates a complete merge
from a silently partial one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CHUNK",
    "Layout",
    "chunk_count",
    "classify",
    "delta",
    "initial",
    "mean_of",
    "relative_error",
    "tolerance",
]

INIT_SCALE = 1.0
DELTA_SCALE = 0.1
CHUNK = 1 << 16  # values per independently seeded piece of a pseudo-gradient


@dataclass(frozen=True, slots=True)
class Layout:
    """``params`` values in ``tensors`` 1-D tensors (the last one takes the remainder)."""

    params: int
    tensors: int

    def sizes(self) -> list[int]:
        base = self.params // self.tensors
        return [base] * (self.tensors - 1) + [self.params - base * (self.tensors - 1)]


def _generator(seed: int, *parts: object) -> torch.Generator:
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def initial(seed: int, layout: Layout, t: int) -> torch.Tensor:
    """Tensor ``t`` of the initial model, [size_t] fp32 (the same on every peer)."""
    return torch.randn(layout.sizes()[t], generator=_generator(seed, "init", t)) * INIT_SCALE


def delta(
    seed: int, layout: Layout, round_: int, peer: int, t: int, chunks: range | None = None
) -> torch.Tensor:
    """Peer ``peer``'s pseudo-gradient for tensor ``t`` in round ``round_``, [size_t] fp32; with
    ``chunks``, only those chunks of ``CHUNK`` values, concatenated (each chunk has its own seed,
    so a sample of chunks costs only its own size)."""
    size = layout.sizes()[t]
    every = range(chunk_count(size))
    picked = every if chunks is None else chunks
    out = torch.empty(sum(min(CHUNK, size - c * CHUNK) for c in picked))
    at = 0
    for c in picked:
        n = min(CHUNK, size - c * CHUNK)
        torch.randn(
            n, generator=_generator(seed, "delta", round_, peer, t, c), out=out[at : at + n]
        )
        at += n
    return out.mul_(DELTA_SCALE)


def chunk_count(size: int) -> int:
    return -(-size // CHUNK)


def tolerance(codec: str) -> float:
    """The largest relative error of a correct merge under ``codec`` (see the module docstring).

    Lossy codecs (fp16, bf16, int8) get one bound, set by the coarsest, int8: one blockwise
    absmax int8 quantisation of Gaussian values moves them by ~0.6 % of their norm (bf16 ~0.3 %,
    fp16 ~0.03 %). Atoll's int8 reference recomputes every rounding the peers make (the
    learners' Q, with their residuals zeroed each round, and the owner's Q of its update with
    the owner's residual replayed), so a correct merge is off by far less; what the bound must
    still cover, should the replayed owner residual drift from the owner's (a rounding of the
    merge's sums that crosses to the other int8 code), is that residual (<= ~0.6 %) and the
    owner's rounding (~0.6 %), and, were learner residuals carried, theirs (~0.6 %): ~2.4 %
    summed at worst. ``5e-2`` is twice that, and still 5x below what dropping one of N <= 16
    equal contributions does (~26 % or more)."""
    return 1e-3 if codec == "none" else 5e-2


def relative_error(held: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> float:
    """|held - ref| / |ref - base| in float64 (inf when the reference makes no update)."""
    update = float(torch.linalg.vector_norm((ref - base).double()))
    err = float(torch.linalg.vector_norm((held - ref).double()))
    return err / update if update > 0 else float("inf")


def classify(errors: dict[str, float], codec: str) -> str:
    """The name of the reference set ``held`` matches best within tolerance, else "neither"."""
    name, err = min(errors.items(), key=lambda kv: kv[1])
    return name if err <= tolerance(codec) else "neither"


def mean_of(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The plain mean of equally shaped fp32 tensors, accumulated in float64."""
    acc = torch.zeros_like(parts[0], dtype=torch.float64)
    for p in parts:
        acc += p
    return (acc / len(parts)).float()
