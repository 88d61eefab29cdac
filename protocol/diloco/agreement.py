"""Agreement: does each sender's work point where the rest of its round's work points?

Theory of operation. Validation (``protocol.diloco.validation``) and the norm bounds record harm
they can measure; work that does no measurable harm but carries no honest signal goes through
them and earns the credit honest work earns: a random direction at an honest norm, an old
pseudo-gradient re-sent for ever, a "little is enough" shift (docs/security.md). Honest learners
of one round train the same model from nearby bases on data from one distribution, so their
pseudo-gradients are correlated; such work is not. At each published merge the owner therefore
measures, for every contribution, how well it agrees with the *other* senders' work:

1. ``gram``: the pairwise inner products of the round's contributions, in one pass over them in
   column chunks, no copy of any of them: each chunk's dot products in fp32 (one BLAS ``sdot``
   of ``CHUNK`` values each, which the chunk's data stays in cache for), summed over the chunks
   in fp64; the diagonal is the squared norms the owner measured on arrival, where given. A
   cosine comes out within ~1e-8 of the fp64 one (the tests bound it by 1e-6, replay's
   tolerance), at half an owner's CPU of the fp64 conversion and BLAS ``dgemm`` it replaced
   (2026-12-06, docs/benchmarks.md, *Where Atoll's round goes*).
2. ``medians``: per contribution, its cosine with each other distinct sender's work (the mean over
   that sender's contributions, so one that sends twice gets one vote), and the median of those.
   A median is robust to colluders who are fewer than half of the others: two colluders sending
   one vector agree with each other and with no one else, so each one's median is the honest
   work's (about 0), while an honest contribution's median is an honest pair's.
3. ``judge``: a sender's agreement is the best median of its contributions (a late honest one may
   lag its round); the round's ``level`` is the median over its senders. With at least
   ``min_senders`` distinct senders and a level of at least ``min_level`` (a round with no
   consensus judges no one: two colluders among four senders leave every median near 0), a
   sender *dissents* when its agreement is below ``floor`` and below ``ratio`` times the level.
   The defaults come from measurement (``python -m bench.attacks --peers 8 --model tiny``
   settings, docs/security.md): honest medians 0.14 at the 5th percentile and >= 0.35 x the level
   but for 2 of 205; random, stale and alie work about 0 (45-90 % of it dissents).

Pure: contributions in as flat tensors, verdicts out; ``now`` is not needed (a verdict is per
published version). ``atoll replay`` recomputes a verdict from the logged medians with ``judge``
and, from the kept contributions, the medians themselves.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.diloco.sliced import SLICE, Delta, as_source, numel_of, slices
from protocol.diloco.vectors import new_vector

__all__ = [
    "CHUNK",
    "Agreement",
    "AgreementConfig",
    "GramSum",
    "agreement",
    "gram",
    "judge",
    "judged",
    "medians",
]

# columns per dot product: OpenBLAS runs a dot of at most 10,000 values on one thread, so the
# sums do not depend on the core count and no BLAS thread spins on a busy machine
CHUNK = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class AgreementConfig:
    """When a sender dissents from its round (see the module docstring). ``min_senders``: distinct
    senders a round needs before anyone is judged (with 3, two colluders are its majority and the
    honest one would dissent); ``min_level``: the round's median agreement below which it has no
    consensus to dissent from; ``floor``: an agreement at or above this never dissents;
    ``ratio``: nor one at or above this fraction of the round's level."""

    min_senders: int = 4
    min_level: float = 0.1
    floor: float = 0.05
    ratio: float = 0.35

    def __post_init__(self) -> None:
        if self.min_senders < 3:
            raise ValueError(
                f"agreement needs min_senders >= 3 (a median over at least 2 others), got {self.min_senders}"
            )
        if not (
            -1.0 <= self.floor <= 1.0 and 0.0 <= self.ratio <= 1.0 and 0.0 < self.min_level <= 1.0
        ):
            raise ValueError(
                "agreement floor must lie in -1..1, ratio in 0..1 and min_level in (0, 1], got "
                f"{self.floor}, {self.ratio}, {self.min_level}"
            )


def gram(
    deltas: Sequence[Delta],
    *,
    chunk: int = CHUNK,
    norms: Sequence[float | None] | None = None,
) -> list[list[float]]:
    """The pairwise inner products of ``deltas`` (flat tensors of one length, any float dtype,
    or ``protocol.diloco.sliced`` sources): one pass over them, ``chunk`` columns at a time,
    each chunk's products in fp32 (fp64 for fp64 tensors) and their sum over the chunks in fp64.
    ``norms``: each delta's L2 norm where known (``protocol.diloco.norms.norm64``): its squared
    norm is the diagonal entry, not computed again. A source is read a slice at a time (a
    multiple of ``chunk`` columns: the same sums). Raises ``ValueError`` when their lengths (or
    the norms' count) differ."""
    n = len(deltas)
    if n == 0:
        return []
    sums = GramSum([numel_of(d) for d in deltas], chunk=chunk, norms=norms)
    sources = [as_source(d) for d in deltas]
    step = sums.slice_length()
    scratch = [new_vector(min(sums.length, step)) for _ in sources]
    for start in slices(sums.length, step):
        stop = min(sums.length, start + step)
        sums.add([s.read(start, stop, b) for s, b in zip(sources, scratch, strict=True)])
    return sums.matrix()


class GramSum:
    """``gram`` fed its columns in consecutive slices (``add``), each a multiple of ``chunk``
    columns but the last: how a merge sums the Gram matrix in the pass that sums the round's
    contributions (``protocol.diloco.outer.merge_update``'s ``observe``). ``matrix`` is
    ``gram``'s result to the last bit. Raises ``ValueError`` as ``gram`` does."""

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        chunk: int = CHUNK,
        norms: Sequence[float | None] | None = None,
    ) -> None:
        n = len(lengths)
        if n and any(size != lengths[0] for size in lengths):
            raise ValueError(
                f"agreement needs contributions of one length, got {sorted(set(lengths))}"
            )
        if norms is not None and len(norms) != n:
            raise ValueError(f"gram got {n} contributions and {len(norms)} norms")
        self.length, self.chunk, self.done = (lengths[0] if n else 0), max(1, chunk), 0
        self.total = [[0.0] * n for _ in range(n)]
        known = [False] * n
        for i, norm in enumerate(norms or ()):
            if norm is not None and math.isfinite(norm):
                self.total[i][i], known[i] = norm * norm, True
        self.pairs = [(i, j) for i in range(n) for j in range(i, n) if i != j or not known[i]]

    def slice_length(self) -> int:
        """A slice length ``add`` takes: ``sliced.SLICE`` rounded to whole chunks."""
        return self.chunk * max(1, SLICE // self.chunk)

    def add(self, parts: Sequence[torch.Tensor]) -> None:
        """Columns ``[done, done + len)`` of every contribution, in order."""
        flats = [_host_array(p) for p in parts]
        if self.done % self.chunk:
            raise ValueError("gram slices must be whole chunks but the last")
        size = flats[0].size if flats else 0
        whole = size - size % self.chunk
        # each pair's dot products of every whole chunk in one call (``vecdot`` runs numpy's
        # BLAS ``sdot`` per row, as ``np.dot`` does per chunk: the same fp32 values without a
        # Python call per chunk), then added in fp64 in chunk order, the tail chunk last
        rows = [f[:whole].reshape(-1, self.chunk) for f in flats]
        for i, j in self.pairs:
            acc = self.total[i][j]
            for product in _row_dots(rows[i], rows[j]) if whole else ():
                acc += product
            if whole < size:
                acc += float(np.dot(flats[i][whole:], flats[j][whole:]))
            self.total[i][j] = acc
        self.done += size

    def matrix(self) -> list[list[float]]:
        """The Gram matrix of every column added (symmetric)."""
        total = [row[:] for row in self.total]
        for i in range(len(total)):
            for j in range(i):
                total[i][j] = total[j][i]
        return total


def _row_dots(a: np.ndarray, b: np.ndarray) -> list[float]:
    """The dot product of each row of ``a`` with the same row of ``b`` (2-D, one dtype), each
    as ``np.dot`` of the two rows gives it (numpy < 2 has no ``vecdot``: one call per row)."""
    if hasattr(np, "vecdot"):
        return list(np.vecdot(a, b).tolist())
    return [float(np.dot(x, y)) for x, y in zip(a, b, strict=True)]


def _host_array(t: torch.Tensor) -> np.ndarray:
    """``t`` as a flat fp32 or fp64 numpy array: a view of a CPU tensor of either dtype, else a
    copy converted to fp32 (a half-precision or device tensor)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype not in (torch.float32, torch.float64):
        flat = flat.to("cpu", torch.float32)
    return flat.numpy()


def medians(peers: Sequence[bytes], products: Sequence[Sequence[float]]) -> list[float | None]:
    """Per contribution (``peers[i]`` sent the ``i``-th), the median over the other distinct
    senders of its cosine with their work (each sender's cosines averaged), from the Gram matrix
    ``products``; None when no other sender sent anything. A zero or non-finite contribution has
    cosine 0 with everything. Raises ``ValueError`` when the sizes do not match."""
    n = len(peers)
    if len(products) != n or any(len(row) != n for row in products):
        raise ValueError(f"agreement needs a {n} x {n} Gram matrix for {n} contributions")
    norms = [math.sqrt(products[i][i]) if products[i][i] > 0 else 0.0 for i in range(n)]
    out: list[float | None] = []
    for i in range(n):
        by_sender: dict[bytes, list[float]] = {}
        for j in range(n):
            if peers[j] == peers[i]:
                continue
            denominator = norms[i] * norms[j]
            cosine = products[i][j] / denominator if denominator > 0 else 0.0
            by_sender.setdefault(peers[j], []).append(cosine if math.isfinite(cosine) else 0.0)
        votes = [math.fsum(c) / len(c) for c in by_sender.values()]
        out.append(statistics.median(votes) if votes else None)
    return out


@dataclass(frozen=True, slots=True)
class Agreement:
    """A round's agreement: per contribution its ``peers`` entry and ``medians`` value; the
    round's ``level`` (None: too few senders to judge); who ``dissent``s; one line ``reason``."""

    peers: tuple[bytes, ...]
    medians: tuple[float | None, ...]
    level: float | None
    dissent: frozenset[bytes]
    reason: str


def judge(
    peers: Sequence[bytes], values: Sequence[float | None], config: AgreementConfig
) -> Agreement:
    """Who dissents from the round, from each contribution's median cosine (``medians``); see
    the module docstring. Raises ``ValueError`` when the sequences differ in length."""
    if len(peers) != len(values):
        raise ValueError(f"agreement got {len(peers)} peers and {len(values)} medians")
    best: dict[bytes, float] = {}
    for peer, value in zip(peers, values, strict=True):
        if value is not None:
            best[peer] = max(value, best.get(peer, -math.inf))
    keep = (tuple(peers), tuple(values))
    senders = len(set(peers))
    if senders < config.min_senders or len(best) < senders:
        why = f"{senders} distinct senders, fewer than {config.min_senders}: no one judged"
        return Agreement(*keep, None, frozenset(), why)
    level = statistics.median(best.values())
    if level < config.min_level:
        why = f"level {level:.3f} below {config.min_level}: no consensus, no one judged"
        return Agreement(*keep, level, frozenset(), why)
    bar = min(config.floor, config.ratio * level)
    dissent = frozenset(p for p, v in best.items() if v < bar)
    detail = ", ".join(f"{p.hex()[:8]} {best[p]:+.3f}" for p in sorted(dissent))
    why = f"level {level:.3f} over {len(best)} senders; {len(dissent)} below {bar:.3f}" + (
        f": {detail}" if detail else ""
    )
    return Agreement(*keep, level, dissent, why)


def agreement(
    peers: Sequence[bytes],
    deltas: Sequence[Delta],
    config: AgreementConfig,
    *,
    norms: Sequence[float | None] | None = None,
    products: Sequence[Sequence[float]] | None = None,
) -> Agreement:
    """``judge`` over the medians of ``deltas`` (``peers[i]`` sent ``deltas[i]``; ``norms``: their
    norms where known, as ``gram`` takes them; ``products``: their Gram matrix where summed
    already, ``GramSum``). Raises ``ValueError`` as ``gram`` and ``judge`` do."""
    if len(peers) != len(deltas):
        raise ValueError(f"agreement got {len(peers)} peers and {len(deltas)} contributions")
    if not judged(peers, config):  # nothing to judge: skip the pass over the work
        return judge(peers, [None] * len(peers), config)
    if products is None:
        products = gram(deltas, norms=norms)
    return judge(peers, medians(peers, products), config)


def judged(peers: Sequence[bytes], config: AgreementConfig) -> bool:
    """Whether a round of these senders is judged at all (enough distinct senders): else its
    Gram matrix is not needed."""
    return len(set(peers)) >= config.min_senders
