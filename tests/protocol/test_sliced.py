"""Contributions kept compressed and read a slice at a time (``protocol.diloco.sliced``): the
same values as decoded whole, the same norms, and a merge (clips, every aggregate, momentum,
the agreement's Gram matrix) with the bits of the whole-vector arithmetic the owner ran before
(``_reference_merge`` below is that code, kept here as the reference)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import pytest
import torch

from protocol.diloco.agreement import GramSum, gram
from protocol.diloco.compression import compress, decompress
from protocol.diloco.norms import norm64
from protocol.diloco.outer import OuterConfig, bound_to_norm, merge_update, outer_step
from protocol.diloco.sliced import SLICE, EncodedVector, decode_range, norm_of, sliceable
from protocol.diloco.updates import decode_flat
from protocol.errors import DecodeError

pytestmark = pytest.mark.timeout(300)  # fragments of three slices, six contributions, a busy CPU
CODECS = ("none", "bf16", "int8", "int4", "sign1")
# a fragment of three tensors whose boundaries and blocks fall across slice boundaries
SHAPES = [(3, 70_001), (SLICE + 77,), (5, 12_289)]


def _encode(flat: torch.Tensor, codec: str, block: int) -> list:
    tensors, offset = [], 0
    for shape in SHAPES:
        n = math.prod(shape)
        enc, _ = compress(flat[offset : offset + n].view(shape), codec, block_size=block)
        tensors.append(enc)
        offset += n
    return tensors


def _contribution(seed: int, scale: float = 1e-3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(
        sum(math.prod(s) for s in SHAPES), generator=torch.Generator().manual_seed(99)
    )
    return (0.8 * shared + 0.6 * torch.randn(shared.numel(), generator=g)) * scale


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("block", [64, 48, 7])
def test_a_range_decodes_to_the_whole_tensors_values(codec: str, block: int) -> None:
    x = torch.randn(10_007) * 3.0
    enc, _ = compress(x, codec, block_size=block)
    whole = decompress(enc)
    for start, stop in [(0, 10_007), (1, 2), (5, 9_999), (63, 129), (64, 128), (10_000, 10_007)]:
        out = torch.full((stop - start,), math.nan)
        decode_range(enc, start, stop, out)
        assert torch.equal(out, whole[start:stop]), (start, stop)


@pytest.mark.parametrize("codec", CODECS)
def test_an_encoded_vector_reads_what_decode_flat_writes_and_its_norm_is_norm64s(
    codec: str,
) -> None:
    tensors = _encode(_contribution(1), codec, 64)
    whole = decode_flat(tensors, SHAPES)
    source = EncodedVector(tensors, SHAPES)
    scratch = torch.empty(SLICE)
    n = whole.numel()
    assert n > 2 * SLICE
    read = torch.cat(
        [source.read(s, min(n, s + SLICE), scratch).clone() for s in range(0, n, SLICE)]
    )
    assert torch.equal(read, whole)
    assert norm_of(source) == norm64(whole)  # bit for bit


def test_an_encoded_vector_refuses_wrong_shapes_and_topk2_is_not_sliceable() -> None:
    tensors = _encode(_contribution(2), "int4", 64)
    with pytest.raises(DecodeError, match="shape"):
        EncodedVector(tensors, [(1,), *SHAPES[1:]])
    with pytest.raises(DecodeError, match="carries"):
        EncodedVector(tensors[:2], SHAPES)
    sparse, _ = compress(torch.randn(5000), "topk2", block_size=64)
    assert not sliceable([sparse]) and sliceable(tensors)


# ---------------------------------------------------------------- the whole-vector reference


def _reference_sum(terms: Sequence[tuple[torch.Tensor, float]], like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like, dtype=torch.float32)
    if not terms:
        return out.zero_()
    (first, a), rest = terms[0], terms[1:]
    torch.mul(first.to(torch.float32), a, out=out)
    for t, a in rest:
        out.add_(t.to(torch.float32), alpha=a)
    return out


def _reference_merge(
    theta: torch.Tensor,
    buffer: torch.Tensor | None,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    clips: Sequence[float],
    norms: Sequence[float],
    cfg: OuterConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The merge as the owner computed it on whole decoded vectors (before this module)."""
    clipped = [d * c if c < 1.0 else d for d, c in zip(deltas, clips, strict=True)]
    total = math.fsum(weights)
    if cfg.aggregate == "mean":
        delta = _reference_sum(
            [(d, w / total) for d, w in zip(clipped, weights, strict=True) if w > 0], deltas[0]
        )
    else:
        ns = [n if c >= 1.0 else norm64(d) for n, c, d in zip(norms, clips, clipped, strict=True)]
        terms = [
            (d, w / (total * n))
            for d, w, n in zip(clipped, weights, ns, strict=True)
            if w > 0 and n > 1e-12
        ]
        direction = _reference_sum(terms, deltas[0])
        r = statistics.median([n for n, w in zip(ns, weights, strict=True) if w > 0])
        if cfg.aggregate == "normed":
            delta = direction.mul_(r)
        else:
            length = float(torch.linalg.vector_norm(direction))
            delta = direction.mul_(r / length)
    limit = cfg.max_delta_ratio * norm64(theta)
    delta, _ = bound_to_norm(delta, limit)
    return outer_step(theta, delta, buffer, cfg)


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
@pytest.mark.parametrize("aggregate", ["mean", "normed", "rda"])
def test_a_sliced_merge_has_the_whole_vector_merges_bits(codec: str, aggregate: str) -> None:
    """Six contributions (two clipped, one weightless), momentum on: the new state, the momentum
    and the Gram matrix summed in the merge's pass are the whole-vector ones to the last bit."""
    k = 6
    flats = [_contribution(10 + i, scale=1e-3 * (1 + i % 3)) for i in range(k)]
    encoded = [EncodedVector(_encode(f, codec, 64), SHAPES) for f in flats]
    decoded = [decode_flat(list(e.tensors), SHAPES) for e in encoded]
    norms = [norm_of(e) for e in encoded]
    assert norms == [norm64(d) for d in decoded]
    weights, clips = [1.0, 2.0, 0.5, 0.0, 1.5, 1.0], [1.0, 0.4, 1.0, 1.0, 0.7, 1.0]
    theta = torch.randn(flats[0].numel())
    buffer = torch.randn(theta.numel()) * 1e-3
    cfg = OuterConfig(aggregate=aggregate, max_delta_ratio=0.5)
    want_theta, want_buffer = _reference_merge(theta, buffer, decoded, weights, clips, norms, cfg)
    sums = GramSum([e.numel for e in encoded], norms=norms)
    got = merge_update(
        theta, buffer, encoded, weights, clips, cfg, embedding=False, norms=norms, observe=sums.add
    )
    assert torch.equal(got.theta, want_theta)
    assert got.buffer is not None and want_buffer is not None
    assert torch.equal(got.buffer, want_buffer)
    want_gram = gram(decoded, norms=norms)
    assert sums.matrix() == want_gram  # the agreement's input, bit for bit
    assert gram(encoded, norms=norms) == want_gram
    # held tensors (a local contribution, an fp32 body) mixed in: the same bits again
    mixed = [decoded[i] if i % 2 else encoded[i] for i in range(k)]
    again = merge_update(theta, buffer, mixed, weights, clips, cfg, embedding=False, norms=norms)
    assert torch.equal(again.theta, want_theta)
