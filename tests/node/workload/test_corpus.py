"""Corpus loading, the train / held-out split, per-learner sampling and held-out evaluation."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from node.workload.corpus import (
    STRIPE_BYTES,
    BatchSampler,
    CorpusShard,
    evaluate,
    heldout_windows,
    load_corpus,
    shard_spans,
    split_corpus,
    stdlib_corpus_files,
)
from node.workload.model import GPT, GPTConfig

# --- loading -------------------------------------------------------------------------------


def test_stdlib_files_are_sorted_python_sources_without_site_packages() -> None:
    files = stdlib_corpus_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "__pycache__" in f.parts for f in files)
    assert any(f.name == "os.py" for f in files)
    assert files == stdlib_corpus_files()


def test_stdlib_corpus_is_the_default_and_max_bytes_caps_it() -> None:
    data = load_corpus(None, max_bytes=10_000)
    assert len(data) == 10_000
    assert data == load_corpus(None, max_bytes=10_000)


def test_folder_joins_text_files_in_sorted_order_and_skips_binaries(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "sub" / "c.py").write_bytes(b"third")
    (tmp_path / "blob.bin").write_bytes(b"\x89PNG\x00\x01")
    (tmp_path / ".hidden").write_bytes(b"secret")
    assert load_corpus(tmp_path) == b"first\nsecond\nthird"
    assert load_corpus(tmp_path, max_bytes=8) == b"first\nse"
    assert load_corpus(tmp_path / "b.txt") == b"second"


def test_missing_path_says_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="does not exist.*standard library") as err:
        load_corpus(missing)
    assert str(missing) in str(err.value)


def test_empty_corpora_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path)
    (tmp_path / "only.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(None, max_bytes=0)


# --- split ---------------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_complete_and_spread() -> None:
    data = bytes((i // 100) % 251 for i in range(100_000))  # 1000 chunks of 100 equal bytes
    train, heldout = split_corpus(data, heldout_fraction=0.05, chunk_bytes=100)
    assert train.dtype == heldout.dtype == torch.uint8
    assert train.numel() + heldout.numel() == len(data)
    assert heldout.numel() == 50 * 100
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    both = torch.cat([train, heldout])
    assert torch.equal(torch.bincount(both, minlength=256), torch.bincount(whole, minlength=256))
    assert heldout.unique().numel() > 40  # chunks from all over the corpus, not one tail
    again = split_corpus(data, heldout_fraction=0.05, chunk_bytes=100)
    assert torch.equal(again[0], train) and torch.equal(again[1], heldout)


def test_split_of_a_small_corpus_still_holds_out_some_bytes() -> None:
    train, heldout = split_corpus(b"x" * 1000, heldout_fraction=0.1)
    assert heldout.numel() > 0 and train.numel() + heldout.numel() == 1000
    with pytest.raises(ValueError, match="too small"):
        split_corpus(b"abc")
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_corpus(b"x" * 1000, heldout_fraction=1.0)


# --- sampling ------------------------------------------------------------------------------


def three_shards() -> torch.Tensor:
    return torch.cat([torch.full((1000,), v, dtype=torch.uint8) for v in (10, 20, 30)])


def test_contiguous_shards_are_disjoint_slices_sampled_only_from_their_own() -> None:
    train = three_shards()
    samplers = [
        BatchSampler(train, CorpusShard(m, 3), batch_size=8, block_size=32, seed=0)
        for m in range(3)
    ]
    assert [s.spans for s in samplers] == [[(0, 1000)], [(1000, 2000)], [(2000, 3000)]]
    for m, s in enumerate(samplers):
        for _ in range(5):
            x, y = s.next()
            assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
            assert set(x.unique().tolist()) == set(y.unique().tolist()) == {10 * (m + 1)}


@pytest.mark.parametrize("n", [3000, 100_000, 5_000_000])
@pytest.mark.parametrize("n_shards", [1, 3, 32])
def test_striped_shards_are_disjoint_cover_the_split_and_each_spans_it(
    n: int, n_shards: int
) -> None:
    spans = [
        shard_spans(n, shard=m, n_shards=n_shards, sharding="striped", block_size=32)
        for m in range(n_shards)
    ]
    covered = sorted(span for shard in spans for span in shard)
    assert covered[0][0] == 0 and covered[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))  # disjoint, no gap
    stripe = covered[0][1] - covered[0][0]
    assert 4 * 33 <= stripe <= STRIPE_BYTES
    lengths = [sum(b - a for a, b in shard) for shard in spans]
    assert max(lengths) - min(lengths) <= stripe  # dealt evenly
    if n >= n_shards * 16 * 4 * 33:  # room for 16 stripes a shard: each reaches the last stripe
        assert all(shard[-1][1] >= n - n_shards * stripe for shard in spans)


def test_a_striped_shard_samples_every_part_of_the_corpus_and_only_its_own_stripes() -> None:
    # ten regions of 10 KB, each one byte value: a contiguous third sees three or four of them,
    # a striped third sees all ten
    train = torch.cat([torch.full((10_000,), v, dtype=torch.uint8) for v in range(10)])
    striped = BatchSampler(train, CorpusShard(1, 3, "striped"), batch_size=64, block_size=8, seed=0)
    contiguous = BatchSampler(train, CorpusShard(1, 3), batch_size=64, block_size=8, seed=0)
    seen_striped = {v for _ in range(20) for v in striped.next()[0].unique().tolist()}
    seen_contiguous = {v for _ in range(20) for v in contiguous.next()[0].unique().tolist()}
    assert seen_striped == set(range(10)) and len(seen_contiguous) <= 4
    own = torch.zeros(train.numel(), dtype=torch.bool)
    for a, b in striped.spans:
        own[a:b] = True
    assert striped.data.numel() == int(own.sum())
    assert torch.equal(striped.data, train[own])  # exactly its stripes, in order


def test_sampler_windows_are_shifted_and_seeded() -> None:
    train = torch.arange(5000, dtype=torch.int64).remainder(256).to(torch.uint8)
    a, b, c = (
        BatchSampler(train, CorpusShard(1, 2), batch_size=4, block_size=16, seed=s)
        for s in (7, 7, 8)
    )
    xa, ya = next(a)
    xb, yb = b.next()
    xc, _ = c.next()
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc)
    x2, _ = a.next()
    assert not torch.equal(xa, x2)  # fresh tensors: the first batch was not overwritten
    assert a.tokens_per_batch == 64


def test_sampler_refuses_bad_shards() -> None:
    with pytest.raises(ValueError, match="shard must be"):
        BatchSampler(three_shards(), CorpusShard(3, 3), batch_size=1, block_size=8, seed=0)
    with pytest.raises(ValueError, match="fewer than a window"):
        BatchSampler(three_shards(), CorpusShard(0, 1000), batch_size=1, block_size=8, seed=0)
    with pytest.raises(ValueError, match="fewer than a window"):  # a striped shard with no stripe
        BatchSampler(
            three_shards(), CorpusShard(999, 1000, "striped"), batch_size=1, block_size=8, seed=0
        )
    with pytest.raises(ValueError, match="sharding must be one of contiguous, striped"):
        BatchSampler(
            three_shards(), CorpusShard(0, 3, "random"), batch_size=1, block_size=8, seed=0
        )


# --- evaluation ----------------------------------------------------------------------------


def test_evaluate_is_deterministic_and_restores_mode() -> None:
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    heldout = torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(0))
    heldout = heldout.to(torch.uint8)
    before = [p.clone() for p in model.parameters()]
    first = evaluate(model, heldout, batch_size=4, block_size=32, n_batches=3)
    assert model.training
    model.eval()
    second = evaluate(model, heldout, batch_size=4, block_size=32, n_batches=3)
    assert not model.training
    assert first == second
    assert abs(first - math.log(256)) < 0.1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_heldout_windows_are_evenly_spread_and_in_bounds() -> None:
    starts = heldout_windows(torch.zeros(1000, dtype=torch.uint8), n_windows=5, block_size=99)
    assert starts.tolist() == [0, 225, 450, 675, 900]
    with pytest.raises(ValueError, match="shorter than one window"):
        heldout_windows(torch.zeros(10, dtype=torch.uint8), n_windows=1, block_size=10)
