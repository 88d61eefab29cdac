"""Compression whose result stays where the tensor is: a device's codes, scales and residual.

``compress`` (``protocol.diloco.compression``) returns host bytes: on a GPU each tensor's finite
check and byte copy would wait for the device once per tensor. ``encode_on_device`` does the same
arithmetic and returns tensors on ``t``'s device instead (payload, scales, the new residual, and a
finite flag as a 0-d bool tensor), so a caller can copy a whole fragment's payloads to the host
with one wait (``node.diloco.device``). Its payload bytes and residual are bit-identical to
``compress``'s for every finite input, on any device (``wire_tensor`` wraps host payloads as an
``EncodedTensor``). Codecs: ``none``, ``bf16``, ``int8``, ``int4``; the sparse and sign codecs
(``topk2``, ``sign1``) are not offered here (``ON_DEVICE``), their callers use ``compress``.

The flag is ``isfinite(sum(x))`` for ``x = t + residual``: False for any NaN or Inf, and also
when finite values overflow the sum, so a False flag means "check on the host": the caller runs
``compress`` on the host copy, which raises ``LocalProtocolError`` or encodes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.diloco.compression import QMAX, _input_vector, _quantize, _scale_blocks
from protocol.errors import LocalProtocolError
from protocol.wire.tensors import Buffer, EncodedTensor

__all__ = ["ON_DEVICE", "DeviceEncoded", "encode_on_device", "wire_tensor"]

ON_DEVICE = ("none", "bf16", "int8", "int4")
_BF16_MAX = torch.finfo(torch.bfloat16).max


@dataclass(frozen=True, slots=True)
class DeviceEncoded:
    """One tensor's encoding, on its device: ``data`` and ``scales`` (1-D; copy their bytes to
    the host for the wire), the new fp32 ``residual`` (``t``'s shape) and ``finite`` (0-d bool)."""

    codec: str
    shape: tuple[int, ...]
    dtype: str
    block_size: int
    data: torch.Tensor
    scales: torch.Tensor
    residual: torch.Tensor
    finite: torch.Tensor


def encode_on_device(
    t: torch.Tensor, codec: str, *, block_size: int = 64, residual: torch.Tensor | None = None
) -> DeviceEncoded:
    """Encode ``t + residual`` with ``codec`` (one of ``ON_DEVICE``) without leaving ``t``'s device
    and without waiting for it. Raises ``LocalProtocolError`` for another codec, a bad block size,
    a dtype other than float32, or a residual of another shape."""
    if codec not in ON_DEVICE:
        raise LocalProtocolError(f"codec {codec!r} is not encoded on a device; use compress")
    if codec in QMAX and (isinstance(block_size, bool) or block_size < 1):
        raise LocalProtocolError(f"block_size must be >= 1 for {codec}, got {block_size}")
    if t.dtype != torch.float32:
        raise LocalProtocolError(f"encode_on_device takes float32 tensors, got {t.dtype}")
    x = _input_vector(t, residual)  # (n,) fp32; may alias t when residual is None
    shape, empty = tuple(t.shape), torch.empty(0, dtype=torch.float32, device=x.device)
    finite = torch.isfinite(x.sum())
    if codec == "none":
        zero = torch.zeros((), dtype=torch.float32, device=x.device).expand(shape)
        return DeviceEncoded(codec, shape, "float32", 0, x, empty, zero, finite)
    if codec == "bf16":
        # clamping changes nothing in range; beyond it, compress saturates the same way
        half = x.clamp(-_BF16_MAX, _BF16_MAX).to(torch.bfloat16)
        new_residual = torch.sub(x, half)
        return DeviceEncoded(
            codec, shape, "float32", 0, half, empty, new_residual.view(shape), finite
        )
    codes, scales = _quantize(x, block_size, QMAX[codec])
    data = codes.to(torch.int8) if codec == "int8" else _pack_int4(codes)
    _scale_blocks(codes, scales, block_size)  # codes now hold exactly what decompress returns
    torch.sub(x, codes, out=codes)
    return DeviceEncoded(
        codec, shape, "float32", block_size, data, scales, codes.view(shape), finite
    )


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``compression._pack_int4``'s bytes without reading a value on the host (odd tails too)."""
    n = codes.numel()
    half = n // 2
    packed = torch.empty(half + (n & 1), dtype=torch.uint8, device=codes.device)
    pairs = codes[: 2 * half].view(half, 2)
    packed[:half].copy_(torch.add(pairs[:, 0], pairs[:, 1], alpha=16).add_(136))
    if n & 1:
        packed[half:].copy_(codes[-1:].add(136))
    return packed


def wire_tensor(enc: DeviceEncoded, data: Buffer, scales: Buffer) -> EncodedTensor:
    """``enc`` as it goes on the wire, given its payload and scales as host bytes."""
    return EncodedTensor(
        codec=enc.codec,
        shape=enc.shape,
        dtype=enc.dtype,
        block_size=enc.block_size,
        data=data,
        scales=scales,
    )
