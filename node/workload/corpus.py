"""Byte corpora, the train / held-out split, per-peer batch sampling and held-out evaluation.

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
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch
import torch.nn as nn
from torch.nn import functional as F

from node.config import SHARDINGS

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

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SEPARATOR = b"\n"  # between files, so the last line of one file never runs into the next

STRIPE_BYTES = 1 << 16  # the longest stripe of a striped shard
_MIN_STRIPES = 16  # a striped shard holds at least this many stripes when the corpus allows


# -----------------------------------------------------------------------------
# loading


def stdlib_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, recursively, without site-packages, sorted by their
    path relative to the stdlib folder (so the order is the same on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return _walk(root, suffix=".py")


def _walk(root: Path, *, suffix: str | None) -> list[Path]:
    """Files under ``root`` (pruning hidden folders and _SKIP_DIRS), sorted by relative path."""
    found: list[PurePath] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = PurePath(dirpath).relative_to(root)
        found += [
            rel / f
            for f in filenames
            if not f.startswith(".") and (suffix is None or f.endswith(suffix))
        ]
    return [root / rel for rel in sorted(found, key=lambda p: p.parts)]


def _read_joined(files: list[Path], *, skip_binary: bool, max_bytes: int | None) -> bytes:
    """Read ``files`` in order and join them once; stops reading once ``max_bytes`` are in."""
    parts: list[bytes] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = f.read_bytes()
        if not data or (skip_binary and b"\0" in data):
            continue
        parts.append(data)
        total += len(data) + len(_SEPARATOR)
    joined = _SEPARATOR.join(parts)
    return joined if max_bytes is None else joined[:max_bytes]


def load_corpus(path: Path | None, *, max_bytes: int | None = None) -> bytes:
    """The training bytes.

    ``path`` None: the standard library (``stdlib_corpus_files``). A file: its bytes. A folder:
    every text file under it, recursively, in sorted order, joined with newlines; files holding a
    NUL byte count as binary and are skipped, as are hidden files and folders. ``max_bytes`` caps
    the result (reading stops early).

    Raises FileNotFoundError if ``path`` does not exist, ValueError if the corpus is empty or
    ``max_bytes`` is not positive.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    path = None if path is None else Path(path)
    if path is None:
        data = _read_joined(stdlib_corpus_files(), skip_binary=True, max_bytes=max_bytes)
        where = f"the Python standard library at {sysconfig.get_paths()['stdlib']}"
    elif not path.exists():
        raise FileNotFoundError(
            f"corpus path {path} does not exist: pass a text file, a folder of text files, "
            "or no corpus path to train on the Python standard library"
        )
    elif path.is_file():
        data = path.read_bytes()
        data = data if max_bytes is None else data[:max_bytes]
        where = str(path)
    elif path.is_dir():
        data = _read_joined(_walk(path, suffix=None), skip_binary=True, max_bytes=max_bytes)
        where = f"folder {path} (binary files, i.e. with NUL bytes, are skipped)"
    else:
        raise ValueError(f"corpus path {path} is neither a file nor a folder")
    if not data:
        raise ValueError(f"corpus is empty: no text bytes found in {where}")
    return data


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
