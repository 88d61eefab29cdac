"""The wire form of one compressed tensor.

``EncodedTensor`` is what ``protocol.diloco.compression`` produces and what messages carry. Its
two byte fields (``data`` and ``scales``) may be large; the codec streams them as raw chunks
after a small msgpack header instead of copying them into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.errors import DecodeError

__all__ = [
    "CODECS",
    "DTYPES",
    "MAX_TENSOR_ELEMENTS",
    "TOPK_CHUNK",
    "UPDATE_CODECS",
    "EncodedTensor",
    "payload_bytes",
    "topk_counts",
]

CODECS = ("none", "bf16", "int8", "int4", "topk2", "sign1")
UPDATE_CODECS = CODECS[
    1:
]  # the lossy ones: what an owner may publish updates in (protocol.diloco.updates)
BLOCKED = ("int8", "int4", "topk2", "sign1")  # codecs whose block_size is >= 1
TOPK_CHUNK = 4096  # topk2: elements per chunk, so a position within it fits in 16 bits
DTYPES = ("float32", "bfloat16", "float16")
MAX_TENSOR_ELEMENTS = 1 << 31
MAX_DIMS = 8

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodedTensor:
    """One tensor after compression.

    ``codec``: one of ``CODECS``. ``shape``: the original shape. ``dtype``: the original dtype
    the receiver restores. ``block_size``: elements per absmax block (int8/int4), elements per
    kept value (topk2, 1..``TOPK_CHUNK``), elements per scale (sign1), 0 otherwise. ``data``: the
    payload bytes (fp32, bf16, int8, packed int4, topk2's positions then 2-bit codes, or sign1's
    sign bits). ``scales``: one fp32 per block (int8/int4/sign1) or per chunk (topk2), empty
    otherwise. Every length is checked against
    ``payload_bytes``, so a decoder may trust them (not the values inside).
    """

    codec: str
    shape: tuple[int, ...]
    dtype: str
    block_size: int
    data: Buffer
    scales: Buffer

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise DecodeError(f"unknown tensor codec {self.codec!r}; expected one of {CODECS}")
        if self.dtype not in DTYPES:
            raise DecodeError(f"unsupported tensor dtype {self.dtype!r}; expected one of {DTYPES}")
        if len(self.shape) > MAX_DIMS or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape
        ):
            raise DecodeError(f"bad tensor shape {self.shape!r}: at most {MAX_DIMS} dims >= 0")
        if self.numel > MAX_TENSOR_ELEMENTS:
            raise DecodeError(f"tensor of {self.numel} elements exceeds {MAX_TENSOR_ELEMENTS}")
        blocked = self.codec in BLOCKED
        too_big = self.codec == "topk2" and self.block_size > TOPK_CHUNK
        if blocked != (self.block_size > 0) or self.block_size < 0 or too_big:
            raise DecodeError(f"block_size {self.block_size} invalid for codec {self.codec}")
        if len(self.data) != self.expected_data_bytes():
            raise DecodeError(
                f"{self.codec} tensor of shape {self.shape} needs {self.expected_data_bytes()} "
                f"data bytes, got {len(self.data)}"
            )
        if len(self.scales) != self.expected_scale_bytes():
            raise DecodeError(
                f"{self.codec} tensor needs {self.expected_scale_bytes()} scale bytes, "
                f"got {len(self.scales)}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def expected_data_bytes(self) -> int:
        return payload_bytes(self.codec, self.numel, self.block_size)[0]

    def expected_scale_bytes(self) -> int:
        return payload_bytes(self.codec, self.numel, self.block_size)[1]

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.scales)


def topk_counts(numel: int, block_size: int) -> tuple[int, int, int]:
    """topk2's layout: (full chunks, values kept per full chunk, values kept in the tail chunk).

    A chunk of ``L`` elements keeps ``ceil(L / block_size)`` of them; the tail chunk holds the
    last ``numel % TOPK_CHUNK`` elements and is absent when that is 0. Expects ``numel >= 0``
    and ``1 <= block_size``.
    """
    full, tail = divmod(numel, TOPK_CHUNK)
    return full, -(-TOPK_CHUNK // block_size), -(-tail // block_size)


def payload_bytes(codec: str, numel: int, block_size: int) -> tuple[int, int]:
    """(data bytes, scale bytes) of a well-formed ``codec`` tensor of ``numel`` elements.

    topk2 keeps ``K`` values in ``C`` chunks: ``2K`` bytes of uint16 positions, ``ceil(K / 4)``
    bytes of 2-bit codes and ``4C`` bytes of fp32 steps. Expects a known codec, ``numel >= 0``
    and ``block_size >= 1`` for the blocked codecs.
    """
    if codec == "topk2":
        full, k, k_tail = topk_counts(numel, block_size)
        kept = full * k + k_tail
        return 2 * kept + (kept + 3) // 4, 4 * (full + (k_tail > 0))
    data = {
        "none": 4 * numel,
        "bf16": 2 * numel,
        "int8": numel,
        "int4": (numel + 1) // 2,
        "sign1": (numel + 7) // 8,
    }[codec]
    return data, 4 * -(-numel // block_size) if codec in BLOCKED else 0
