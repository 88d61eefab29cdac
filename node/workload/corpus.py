"""Byte corpora (read by ``node.workload.corpus_files``), the train / held-out split, per-peer
batch sampling and held-out evaluation.

The default corpus is the Python standard library's own ``.py`` files (~31 MB on CPython 3.11):
present on every machine that runs Atoll, plain text, and big enough that a small model does not
memorise it. Note that it differs between Python versions, so peers on different versions train
on (slightly) different data; pass the same ``--corpus`` everywhere when that matters.

Layout of the data, for a corpus of ``n`` bytes::

    corpus  [c0 c1 c2 ... c19 c20 ...]          fixed-size chunks
    heldout  every ~1/heldout_fraction-th chunk  (spread over the whole corpus, deterministic)
    train    the other chunks, concatenated, then cut into n_shards contiguous shards,
             one per learner; learner m samples random windows from shard m only.
             (``sharding="striped"``: dealt in stripes of 64 KiB or less, round robin, so
             that learner m holds stripes m, m + n, m + 2n, ... and its shard spans the whole
             corpus, as a data-parallel sampler's would.)

Evaluation uses a fixed set of evenly spaced held-out windows, so every call on every peer scores
the same bytes and loss curves are comparable.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from node.config import SHARDINGS
from node.workload.corpus_files import load_corpus, stdlib_corpus_files

__all__ = [
    "SHARDINGS",
    "STRIPE_BYTES",
    "shard_spans",
    "stdlib_corpus_files",
    "load_corpus",
    "split_corpus",
    "BatchSampler",
    "CorpusShard",
    "heldout_windows",
    "validation_slice",
    "evaluate",
]

STRIPE_BYTES = 1 << 16  # the longest stripe of a striped shard
_MIN_STRIPES = 16  # a striped shard holds at least this many stripes when the corpus allows


# -----------------------------------------------------------------------------
# train / held-out split


def split_corpus(
    data: bytes, *, heldout_fraction: float = 0.05, chunk_bytes: int = 1 << 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``data`` into (train, heldout), both uint8 1-D tensors, disjoint, covering ``data``.

    The corpus is cut into chunks of ``chunk_bytes`` (smaller for small corpora, so there are
    enough chunks); chunk i goes to held-out when floor((i+1)·f) > floor(i·f), which spreads a
    fraction f of the chunks evenly over the corpus. Deterministic: no randomness involved.

    Raises ValueError if the fraction is outside (0, 1) or either part would be empty.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    n = len(data)
    min_chunks = math.ceil(1.0 / heldout_fraction) + 1  # so at least one chunk is held out
    chunk = max(1, min(chunk_bytes, n // min_chunks))
    n_chunks = math.ceil(n / chunk)
    is_heldout = [
        math.floor((i + 1) * heldout_fraction) > math.floor(i * heldout_fraction)
        for i in range(n_chunks)
    ]
    if n < min_chunks or not any(is_heldout) or all(is_heldout):
        raise ValueError(
            f"corpus of {n} bytes is too small to split with heldout_fraction={heldout_fraction}"
        )
    full = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (n,) uint8, one copy
    train = torch.cat(
        [full[i * chunk : (i + 1) * chunk] for i in range(n_chunks) if not is_heldout[i]]
    )
    heldout = torch.cat(
        [full[i * chunk : (i + 1) * chunk] for i in range(n_chunks) if is_heldout[i]]
    )
    return train, heldout  # (n_train,) uint8, (n_heldout,) uint8


# -----------------------------------------------------------------------------
# sampling


def shard_spans(
    n: int, *, shard: int, n_shards: int, sharding: str = "contiguous", block_size: int = 1
) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of a train split of ``n`` bytes that shard ``shard`` holds.

    ``contiguous``: the ``shard``-th of ``n_shards`` equal slices. ``striped``: the split cut into
    stripes of at most ``STRIPE_BYTES`` (shorter on small corpora, so that each shard holds about
    ``_MIN_STRIPES`` of them, but never shorter than four windows of ``block_size + 1``), dealt
    round robin. Either way the shards are disjoint and together cover the split.

    Raises ValueError for a shard outside ``[0, n_shards)`` or an unknown sharding.
    """
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard must be in [0, {n_shards}), got {shard}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if sharding == "contiguous":
        return [(shard * n // n_shards, (shard + 1) * n // n_shards)]
    stripe = min(STRIPE_BYTES, max(n // (n_shards * _MIN_STRIPES), 4 * (block_size + 1)))
    return [(a, min(a + stripe, n)) for a in range(shard * stripe, n, n_shards * stripe)]


@dataclass(frozen=True, slots=True)
class CorpusShard:
    """The part of the train split one learner samples: shard ``index`` of ``count``, cut as
    ``sharding`` says (``shard_spans``). Raises ValueError for an index outside ``[0, count)``
    or an unknown sharding."""

    index: int
    count: int
    sharding: str = "contiguous"

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(
                f"shard must be in [0, {self.count}), got {self.index}: pass an index below the "
                "shard count"
            )
        if self.sharding not in SHARDINGS:
            raise ValueError(
                f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}"
            )


class BatchSampler:
    """Random (x, y) windows from one learner's shard of the train split.

    The shard holds the ranges ``shard_spans`` gives (``spans``), joined into one tensor (a
    copy, for a striped shard); shards are disjoint. Window starts come from this sampler's own
    ``torch.Generator(seed)``, so a sampler's stream depends only on (train, shard, batch_size,
    block_size, seed). The index buffers are reused between calls; the returned x and y are
    fresh tensors.
    """

    def __init__(
        self,
        train: torch.Tensor,
        shard: CorpusShard,
        *,
        batch_size: int,
        block_size: int,
        seed: int,
    ) -> None:
        if batch_size < 1 or block_size < 1:
            raise ValueError(
                f"batch_size and block_size must be >= 1, got {batch_size}, {block_size}"
            )
        self.shard = shard
        self.spans = shard_spans(
            train.numel(),
            shard=shard.index,
            n_shards=shard.count,
            sharding=shard.sharding,
            block_size=block_size,
        )
        pieces = [train[a:b] for a, b in self.spans]
        # (shard_len,) uint8: a view of one span; stripes joined (none: empty, refused below)
        self.data = pieces[0] if len(pieces) == 1 else torch.cat([train[:0], *pieces])
        if self.data.numel() < block_size + 2:
            raise ValueError(
                f"shard {shard.index}/{shard.count} holds {self.data.numel()} bytes, fewer than "
                f"a window of {block_size + 1}: use a bigger corpus or fewer shards"
            )
        self.batch_size, self.block_size = batch_size, block_size
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(block_size + 1)  # (T+1,) int64
        self._starts = torch.empty(batch_size, dtype=torch.long)  # (B,) int64
        self._index = torch.empty(batch_size, block_size + 1, dtype=torch.long)  # (B, T+1)
        self._window = torch.empty(batch_size, block_size + 1, dtype=torch.uint8)  # (B, T+1)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: x, y int64 (B, T), y shifted one byte right of x."""
        high = self.data.numel() - self.block_size  # last valid start + 1
        torch.randint(0, high, (self.batch_size,), generator=self.generator, out=self._starts)
        torch.add(self._starts[:, None], self._offsets[None, :], out=self._index)  # (B, T+1)
        torch.take(self.data, self._index, out=self._window)  # (B, T+1) uint8
        x = self._window[:, :-1].long()  # (B, T) int64, contiguous copy
        y = self._window[:, 1:].long()  # (B, T) int64, contiguous copy
        return x, y

    __next__ = next

    def __iter__(self) -> BatchSampler:
        return self


# -----------------------------------------------------------------------------
# evaluation


def heldout_windows(heldout: torch.Tensor, *, n_windows: int, block_size: int) -> torch.Tensor:
    """Start offsets (n_windows,) int64 of evenly spaced windows over the held-out split.

    Raises ValueError if the held-out split is shorter than one window.
    """
    high = heldout.numel() - block_size - 1  # last valid start
    if high < 0:
        raise ValueError(
            f"held-out split of {heldout.numel()} bytes is shorter than one window of "
            f"{block_size + 1}: use a bigger corpus or a bigger heldout_fraction"
        )
    return torch.linspace(0, high, n_windows, dtype=torch.float64).round().long()


def validation_slice(heldout: torch.Tensor, *, fraction: float = 0.25) -> tuple[torch.Tensor, str]:
    """The swarm's pinned validation set for validated publication (``node.diloco.validation``):
    the last ``fraction`` of the held-out split, uint8 (m,), and its SHA-256 (hex), which every
    peer of a swarm on the same corpus computes alike. Held out, so no learner trains on it; it
    overlaps the bytes ``evaluate`` scores (its windows are spread over the whole held-out split).
    Raises ValueError for a fraction outside (0, 1]."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"validation fraction must be in (0, 1], got {fraction}")
    part = heldout[heldout.numel() - max(1, int(heldout.numel() * fraction)) :]
    return part, hashlib.sha256(part.numpy().tobytes()).hexdigest()


@torch.no_grad()
def evaluate(
    model: nn.Module, heldout: torch.Tensor, *, batch_size: int, block_size: int, n_batches: int
) -> float:
    """Mean cross-entropy in nats/byte over a fixed set of ``n_batches * batch_size`` evenly
    spaced held-out windows: the same windows on every call, so curves are comparable.

    ``model(x)`` must return ``(logits, ...)`` with logits (B, T, vocab). Runs in eval mode under no_grad on the
    model's device and restores the model's train/eval mode. Raises ValueError if the held-out
    split is shorter than one window.
    """
    starts = heldout_windows(heldout, n_windows=n_batches * batch_size, block_size=block_size)
    device = next(model.parameters()).device
    offsets = torch.arange(block_size + 1)  # (T+1,)
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for b in range(n_batches):
            idx = starts[b * batch_size : (b + 1) * batch_size, None] + offsets  # (B, T+1)
            window = heldout[idx].to(device=device, dtype=torch.long)  # (B, T+1) int64
            logits, _ = model(window[:, :-1], None)  # (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
            total += loss.item()
    finally:
        model.train(was_training)
    return total / n_batches
