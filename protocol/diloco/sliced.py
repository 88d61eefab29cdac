"""A round's contributions read slice by slice, so a merge holds O(slice x contributors) of
decoded values at a time instead of every contribution decoded whole.

An owner used to decode each contribution into a fragment-sized fp32 vector on arrival and keep
it until its round merged: with n contributions (carried ones included) that was n times the
fragment's fp32 bytes at every merge, most of a peer's memory peak at 124M parameters
(docs/scale.md). Now a contribution stays as it arrived (its compressed tensors, ~1/8 of fp32
for int4) and is read through a ``VectorSource``: ``EncodedVector`` decodes the values
``[start, stop)`` of the fragment's flat vector into a small scratch buffer, ``TensorSource``
hands out views of a vector held anyway (a local contribution, an fp32 body, a replayed log's).

Everything that reads the contributions does it in ``SLICE``-value slices that start at
multiples of ``SLICE``: the weighted sums of ``protocol.diloco.outer`` (element-wise: the same
bits in any slicing), ``norm_of`` (``norm64``'s chunks of ``SUM_CHUNK`` summed in the same order:
the same bits) and ``protocol.diloco.agreement.GramSum`` (its chunks of ``CHUNK`` columns, the
same order). Decoding a range is the codec's element-wise decode of the blocks that hold it
(``decode_range``), so the values are those ``decompress`` writes for the whole tensor.
``topk2`` has no range decoder: such a contribution is decoded whole (``sliceable``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from protocol.diloco.compression import decompress
from protocol.diloco.norms import SUM_CHUNK, add_squares, norm64
from protocol.diloco.updates import fragment_numel
from protocol.diloco.vectors import new_vector
from protocol.errors import DecodeError
from protocol.wire.tensors import EncodedTensor

__all__ = [
    "SLICE",
    "Delta",
    "EncodedVector",
    "ScaledSource",
    "TensorSource",
    "VectorSource",
    "as_source",
    "decode_range",
    "norm_of",
    "numel_of",
    "slices",
    "sliceable",
]

# values per slice (1 MiB of fp32): a multiple of norm64's SUM_CHUNK and CHUNK and of the
# agreement's CHUNK, so sliced reductions add the same chunks in the same order
SLICE = 1 << 18
_UNIT = {"none": 1, "bf16": 1, "int8": 1, "int4": 2, "sign1": 8}  # values per data byte boundary


@runtime_checkable
class VectorSource(Protocol):
    """A flat vector read in ranges: ``read(start, stop, scratch)`` returns its values
    ``[start, stop)`` as a 1-D tensor, a view of memory it holds or written into
    ``scratch[: stop - start]`` (an fp32 CPU vector of at least that many values)."""

    @property
    def numel(self) -> int: ...

    def read(self, start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor: ...


Delta = torch.Tensor | VectorSource  # a contribution as a merge takes it


class TensorSource:
    """A tensor held anyway, read as views of its flat form (any float dtype, any device)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach().reshape(-1)

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def read(self, start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor:
        return self.tensor[start:stop]


class ScaledSource:
    """``source`` times ``factor`` (a clipped contribution), computed per slice in fp32 (the
    product ``d * c`` of an fp32 ``d``, element by element)."""

    __slots__ = ("factor", "source")

    def __init__(self, source: VectorSource, factor: float) -> None:
        self.source, self.factor = source, factor

    @property
    def numel(self) -> int:
        return self.source.numel

    def read(self, start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor:
        part = self.source.read(start, stop, scratch)
        if part.dtype == torch.float32 and part.data_ptr() == scratch.data_ptr():
            return part.mul_(self.factor)
        return part * self.factor


class EncodedVector:
    """A fragment's compressed tensors (as a contribution carries them) read as one flat fp32
    vector, decoded range by range. Raises ``DecodeError`` on a wrong tensor count or shape (as
    ``decode_flat``) or a codec with no range decoder (check ``sliceable`` first)."""

    __slots__ = ("__weakref__", "_offsets", "numel", "tensors")

    def __init__(self, tensors: Sequence[EncodedTensor], shapes: Sequence[tuple[int, ...]]) -> None:
        if len(tensors) != len(shapes):
            raise DecodeError(f"fragment has {len(shapes)} tensors, message carries {len(tensors)}")
        offsets, offset = [], 0
        for i, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
            if tuple(t.shape) != tuple(shape):
                raise DecodeError(
                    f"tensor {i}: shape {tuple(t.shape)} does not match the plan's {tuple(shape)}"
                )
            if t.codec not in _UNIT:
                raise DecodeError(f"tensor {i}: codec {t.codec} cannot be decoded by range")
            offsets.append(offset)
            offset += t.numel
        self.tensors, self._offsets, self.numel = tuple(tensors), offsets, offset
        assert offset == fragment_numel(shapes)

    def read(self, start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor:
        out = scratch[: stop - start]
        for t, offset in zip(self.tensors, self._offsets, strict=True):
            lo, hi = max(start, offset), min(stop, offset + t.numel)
            if lo < hi:
                decode_range(t, lo - offset, hi - offset, out[lo - start : hi - start])
        return out


def sliceable(tensors: Sequence[EncodedTensor]) -> bool:
    """Whether every tensor's codec has a range decoder (all but ``topk2``)."""
    return all(t.codec in _UNIT for t in tensors)


def decode_range(enc: EncodedTensor, start: int, stop: int, out: torch.Tensor) -> None:
    """Write values ``[start, stop)`` of ``enc``'s flat form into the fp32 vector ``out``: the
    values ``decompress`` gives for the whole tensor (each is its code times its block's scale,
    element by element). Whole blocks are decoded in place, a partial one at either end into a
    small buffer. NaN/Inf in ``none``/``bf16`` payloads are not refused here (the caller measured
    the whole vector's norm on arrival); bad scales raise ``DecodeError`` as in ``decompress``."""
    unit = _unit(enc)
    n, pos = enc.numel, start
    while pos < stop:
        end = stop if stop == n else stop // unit * unit
        if pos % unit == 0 and end > pos:
            decompress(_part(enc, pos, end), out=out[pos - start : end - start], finite_check=False)
            pos = end
            continue
        first = pos // unit * unit
        last = min(first + unit, n)
        block = decompress(_part(enc, first, last), finite_check=False)
        take = min(stop, last)
        out[pos - start : take - start].copy_(block[pos - first : take - first])
        pos = take


def _unit(enc: EncodedTensor) -> int:
    """The alignment a range of ``enc`` must start at to be its own tensor: a whole block of
    scales and a whole data byte."""
    per_byte = _UNIT[enc.codec]
    return math.lcm(enc.block_size, per_byte) if enc.block_size else per_byte


def _part(enc: EncodedTensor, start: int, stop: int) -> EncodedTensor:
    """Values ``[start, stop)`` of ``enc`` (``start`` aligned to ``_unit``, ``stop`` too or the
    end) as a tensor of their own: slices of its data and scales, no copy."""
    per_byte, data = _UNIT[enc.codec], memoryview(enc.data).cast("B")
    if enc.codec in ("none", "bf16"):
        width = 4 if enc.codec == "none" else 2
        raw = data[width * start : width * stop]
    else:
        raw = data[start // per_byte : -(-stop // per_byte)]
    scales: bytes | memoryview = b""
    if enc.block_size:
        bs = enc.block_size
        scales = memoryview(enc.scales).cast("B")[4 * (start // bs) : 4 * -(-stop // bs)]
    return EncodedTensor(
        codec=enc.codec,
        shape=(stop - start,),
        dtype=enc.dtype,
        block_size=enc.block_size,
        data=raw,
        scales=scales,
    )


def as_source(delta: Delta) -> VectorSource:
    """``delta`` as a ``VectorSource`` (a tensor read as views of itself)."""
    return TensorSource(delta) if isinstance(delta, torch.Tensor) else delta


def numel_of(delta: Delta) -> int:
    return delta.numel() if isinstance(delta, torch.Tensor) else delta.numel


def slices(numel: int, length: int = SLICE) -> range:
    """The starts of consecutive ``length``-value slices of ``numel`` values."""
    return range(0, numel, max(1, length))


def norm_of(delta: Delta) -> float:
    """``norm64`` of ``delta``'s values, to the last bit, holding one slice of them at a time."""
    if isinstance(delta, torch.Tensor):
        return norm64(delta)
    if isinstance(delta, TensorSource):
        return norm64(delta.tensor)
    n = delta.numel
    scratch = new_vector(min(n, SLICE))
    if n <= SLICE:
        return norm64(delta.read(0, n, scratch))
    squares, total = torch.empty(SUM_CHUNK, dtype=torch.float32), 0.0
    for start in slices(n):
        part = delta.read(start, min(n, start + SLICE), scratch)
        if part.dtype != torch.float32 or part.device.type != "cpu":  # not how norm64 sums it
            return norm64(_whole(delta))
        total = add_squares(part, total, squares)
    return math.sqrt(total)


def _whole(source: VectorSource) -> torch.Tensor:
    """Every value of ``source`` at once (a source that reads other than fp32 CPU slices)."""
    n = source.numel
    scratch = new_vector(min(n, SLICE))
    return torch.cat([source.read(s, min(n, s + SLICE), scratch).clone() for s in slices(n)])
