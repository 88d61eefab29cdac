"""The wire form of one compressed tensor.

``EncodedTensor`` is what ``protocol.diloco.compression`` produces and what messages carry. Its
two byte fields (``data`` and ``scales``) may be large; the codec streams them as raw chunks
after a small msgpack header instead of copying them into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.errors import DecodeError

__all__ = ["CODECS", "DTYPES", "EncodedTensor", "MAX_TENSOR_ELEMENTS"]

CODECS = ("none", "bf16", "int8", "int4")
DTYPES = ("float32", "bfloat16", "float16")
MAX_TENSOR_ELEMENTS = 1 << 31
MAX_DIMS = 8

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodedTensor:
    """One tensor after compression.

    ``codec``: one of ``CODECS``. ``shape``: the original shape. ``dtype``: the original dtype
    the receiver restores. ``block_size``: elements per absmax block (int8/int4; 0 otherwise).
    ``data``: the payload bytes (fp32, bf16, int8 or packed int4). ``scales``: one fp32 absmax
    per block for int8/int4, empty otherwise.
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
        blocked = self.codec in ("int8", "int4")
        if blocked != (self.block_size > 0) or self.block_size < 0:
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
        n = self.numel
        return {"none": 4 * n, "bf16": 2 * n, "int8": n, "int4": (n + 1) // 2}[self.codec]

    def expected_scale_bytes(self) -> int:
        if self.block_size <= 0:
            return 0
        return 4 * -(-self.numel // self.block_size)

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.scales)
