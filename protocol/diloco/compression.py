"""Tensor codecs for pseudo-gradients and global fragments, with error feedback as values.

Decoupled DiLoCo (arXiv 2604.21428, compression ablation, Table 10) sends outer gradients as
blockwise absmax integers: int4 is close to lossless on text, 2- and 1-bit collapse. Six codecs:

``none``  fp32 bytes; exact.
``bf16``  round-to-nearest-even to bfloat16; ``|err| <= 2^-8 * |x| + 2^-134`` per element (the
          second term only matters for subnormals). Finite values beyond the bf16 range saturate
          to +-bf16 max instead of becoming Inf; the saturation error goes into the residual.
``int8``  the flattened tensor is cut into blocks of ``block_size`` elements (the last one may be
          partial); each block stores ``scale = absmax / 127`` as fp32 and one signed byte per
          element, ``q = round(x / scale)`` in ``[-127, 127]``; ``|err| <= absmax_block / 254``.
``int4``  as int8 with ``scale = absmax / 7`` and ``q`` in ``[-7, 7]``, stored as ``q + 8`` in a
          nibble, two per byte (low nibble first; an odd count pads the last high nibble with 8);
          ``|err| <= absmax_block / 14``.
``topk2`` sparse: per chunk of 4096 elements only the ``ceil(4096 / block_size)`` largest in
          magnitude, as 16-bit positions and 2-bit values with one fp32 step per chunk; every
          other element is left in the residual (``protocol.diloco.sparse`` has the layout).
``sign1``  one bit per element, its sign (set: >= 0), packed eight to a byte (element ``i`` in bit
          ``i % 8`` of byte ``i // 8``, the last byte's spare bits 0), and per block of
          ``block_size`` elements one fp32 ``scale = mean |x|`` (the scale that minimises the
          block's squared error for a sign code); decodes to ``+-scale``. Only with error
          feedback does it carry anything but the signs over rounds (scaled sign compression,
          as in 1-bit SGD); ``|err| <= |x| + scale`` per element.

The integer bounds hold up to fp32 rounding of the scale and of ``q * scale``: a relative
``2^-22`` of ``absmax_block`` when the scale is a normal float, and about ``128 * 2^-149``
absolute when the block is so small that its scale is subnormal. An all-zero block has scale 0
and decodes to zeros (nothing is divided by zero).

Error feedback: ``compress(t, codec, residual=r)`` encodes ``x = t + r`` and returns the new
residual ``x - decompress(encoded)`` as a fresh fp32 tensor of ``t``'s shape; neither ``t`` nor
``r`` is modified. Without ``residual`` it starts from zero, so the first call already returns the
residual to carry. ``none`` is exact: its residual is always zero, returned as a read-only
zero-stride view (no memory), so carrying it costs nothing.

``compress(t, "none", copy=False)`` encodes a contiguous fp32 ``t`` without copying it: the
encoded bytes are a view of ``t``, valid only while ``t`` is not written to. Owners publish their
global fragments that way (a new tensor per version, never modified in place) and learners send
pseudo-gradients that way (a fresh tensor per contribution).

Local tensors with NaN or Inf are our own bug: ``LocalProtocolError``. Remote bytes that would
decode to NaN or Inf (a NaN fp32 payload, NaN, negative or out-of-range scales) are a peer's
fault: ``DecodeError``. Decoding reads ``data``/``scales`` in place through ``torch.frombuffer``
(read-only ``bytes``, which torch would warn about once per process; nothing writes to them,
so that warning is filtered for this package's modules). Byte order is little-endian, the order of every machine torch runs on.
"""

from __future__ import annotations

import warnings

import torch

from protocol.diloco.norms import all_finite
from protocol.diloco.sparse import decode_topk, encode_topk
from protocol.diloco.vectors import new_vector, new_vector_like
from protocol.errors import DecodeError, LocalProtocolError
from protocol.wire.tensors import BLOCKED, CODECS, TOPK_CHUNK, EncodedTensor, payload_bytes

__all__ = ["QMAX", "compress", "decompress", "wire_bytes"]

warnings.filterwarnings(
    "ignore",
    message="The given buffer is not writable",
    category=UserWarning,
    module=r"protocol\.diloco\.",
)

QMAX = {"int8": 127, "int4": 7}
_BITS = 1 << torch.arange(8, dtype=torch.uint8)  # sign1: bit i of a byte holds element i
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_F32_MAX = torch.finfo(torch.float32).max
_BF16_MAX = torch.finfo(torch.bfloat16).max
# Largest scale whose codes (int8 down to -128, int4 down to -8) cannot overflow fp32.
_SCALE_LIMIT = {"int8": _F32_MAX / 128, "int4": _F32_MAX / 8, "sign1": _F32_MAX}


# ---------------------------------------------------------------- public API


def wire_bytes(numel: int, codec: str, block_size: int = 64) -> int:
    """Bytes on the wire (data plus scales) for ``numel`` elements under ``codec``.

    Raises ``LocalProtocolError`` for an unknown codec, a negative ``numel`` or a block size < 1
    with an integer or sparse codec (or > 4096 with topk2).
    """
    _check_codec(codec, block_size)
    if numel < 0:
        raise LocalProtocolError(f"numel must be >= 0, got {numel}")
    data, scales = payload_bytes(codec, numel, block_size)
    return data + scales


def compress(
    t: torch.Tensor,
    codec: str,
    *,
    block_size: int = 64,
    residual: torch.Tensor | None = None,
    copy: bool = True,
    known_finite: bool = False,
) -> tuple[EncodedTensor, torch.Tensor]:
    """Encode ``t + residual`` with ``codec``; return it and the new fp32 residual.

    ``copy=False`` (``none`` only, no residual): the encoded bytes are a view of ``t`` when it is
    a contiguous fp32 CPU tensor (see the module docstring); other tensors are copied anyway.
    ``known_finite=True`` (``none`` only, no residual): the caller checked ``t`` when it made it (an
    owner's new version), so it is not read again here.

    Raises ``LocalProtocolError`` for an unknown codec, a bad block size, a dtype other than
    float32/bfloat16/float16, a residual of another shape, or NaN/Inf in ``t``, in ``residual``
    or in their sum.
    """
    _check_codec(codec, block_size)
    dtype = _DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise LocalProtocolError(f"cannot compress dtype {t.dtype}; use one of {_DTYPE_NAMES}")
    x = _input_vector(t, residual)  # (n,) fp32; may alias t when residual is None
    shape = tuple(t.shape)
    if codec == "none":
        if not (known_finite and residual is None) and not all_finite(x):
            _raise_not_finite(t, residual)
        aliases_t = (
            residual is None and x.data_ptr() == t.data_ptr()
        )  # else x is a new tensor already
        data = _to_buffer(x.clone() if aliases_t and copy else x)
        enc = EncodedTensor(
            codec="none", shape=shape, dtype=dtype, block_size=0, data=data, scales=b""
        )
        return enc, torch.zeros((), dtype=torch.float32, device=t.device).expand(shape)
    if codec == "bf16":
        half, new_residual = _encode_bf16(x, t, residual)
        enc = EncodedTensor(
            codec="bf16", shape=shape, dtype=dtype, block_size=0, data=half, scales=b""
        )
        return enc, new_residual.view(shape)
    if codec == "topk2":
        return _compress_topk(x, t, residual, block_size, dtype)
    if codec == "sign1":
        return _compress_sign(x, t, residual, block_size, dtype)
    codes, scales = _quantize(x, block_size, QMAX[codec])
    if not bool(torch.isfinite(scales).all()):
        _raise_not_finite(t, residual)
    data = _to_buffer(_pack_int8(codes) if codec == "int8" else _pack_int4(codes))
    enc = EncodedTensor(
        codec=codec,
        shape=shape,
        dtype=dtype,
        block_size=block_size,
        data=data,
        scales=_to_buffer(scales),
    )
    _scale_blocks(codes, scales, block_size)  # codes now hold exactly what decompress returns
    torch.sub(x, codes, out=codes)
    return enc, codes.view(shape)


def decompress(
    enc: EncodedTensor, out: torch.Tensor | None = None, *, finite_check: bool = True
) -> torch.Tensor:
    """Decode ``enc`` into a new fp32 tensor of its shape, or into ``out`` (any float dtype).

    Raises ``DecodeError`` when ``out``'s shape differs from ``enc.shape`` or when the remote
    bytes would decode to NaN/Inf (checked before ``out`` is written). A narrower ``out`` dtype
    (fp16) saturates to Inf as ``Tensor.copy_`` does. ``finite_check=False``: ``none`` and
    ``bf16`` values are written unchecked, for a caller that measures the result's ``norm64``
    next (finite exactly when every value is) and refuses it if it is not; every other check stays.
    """
    if out is not None and tuple(out.shape) != enc.shape:
        raise DecodeError(
            f"tensor of shape {enc.shape} does not fit output of shape {tuple(out.shape)}"
        )
    n = enc.numel
    direct = (
        out is not None
        and out.dtype == torch.float32
        and out.is_contiguous()
        and out.device.type == "cpu"
    )
    if n == 0:
        return out if out is not None else torch.empty(enc.shape, dtype=torch.float32)
    unchecked = not finite_check and enc.codec in ("none", "bf16")
    scales = _check_remote(enc) if enc.codec != "topk2" and not unchecked else None
    target = out.view(-1) if out is not None and direct else new_vector(n)
    if enc.codec == "topk2":
        decode_topk(enc, target)  # checks everything before it writes
    else:
        _decode_into(enc, target)
    if scales is not None:
        _scale_blocks(target, scales, enc.block_size)
    if out is None:
        return target.view(enc.shape)
    if not direct:
        out.copy_(target.view(enc.shape))
    return out


# ---------------------------------------------------------------- encoding


def _check_codec(codec: str, block_size: int) -> None:
    """Raise ``LocalProtocolError`` unless ``codec`` is known and ``block_size`` fits it."""
    if codec not in CODECS:
        raise LocalProtocolError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if codec == "topk2" and (isinstance(block_size, bool) or not 1 <= block_size <= TOPK_CHUNK):
        raise LocalProtocolError(f"block_size must be 1..{TOPK_CHUNK} for topk2, got {block_size}")
    if codec in BLOCKED and (isinstance(block_size, bool) or block_size < 1):
        raise LocalProtocolError(f"block_size must be >= 1 for {codec}, got {block_size}")


def _input_vector(t: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``t + residual`` flattened to fp32 (a view of ``t`` when possible and no residual)."""
    flat = t.detach().reshape(-1).to(torch.float32)
    if residual is None:
        return flat
    if residual.shape != t.shape:
        raise LocalProtocolError(
            f"residual shape {tuple(residual.shape)} != tensor shape {tuple(t.shape)}"
        )
    if not residual.is_floating_point():
        raise LocalProtocolError(f"residual must be a float tensor, got {residual.dtype}")
    return torch.add(
        flat, residual.detach().reshape(-1).to(torch.float32), out=new_vector_like(flat)
    )


def _raise_not_finite(t: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Say which local input is not finite; always raises ``LocalProtocolError``."""
    if not bool(torch.isfinite(t).all()):
        raise LocalProtocolError("tensor to compress contains NaN or Inf")
    if residual is not None and not bool(torch.isfinite(residual).all()):
        raise LocalProtocolError("error-feedback residual contains NaN or Inf")
    raise LocalProtocolError("tensor + residual overflows float32")


def _encode_bf16(
    x: torch.Tensor, t: torch.Tensor, residual: torch.Tensor | None
) -> tuple[memoryview, torch.Tensor]:
    """bf16 bytes of ``x`` (saturating) and the fp32 residual ``x - decoded``."""
    half = x.to(torch.bfloat16)
    if not all_finite(half):
        if not all_finite(x):
            _raise_not_finite(t, residual)
        half = x.clamp(-_BF16_MAX, _BF16_MAX).to(torch.bfloat16)
    decoded = torch.sub(x, half, out=new_vector_like(x))  # x - decoded(half), in fp32
    return _to_buffer(half), decoded


def _compress_topk(
    x: torch.Tensor, t: torch.Tensor, residual: torch.Tensor | None, block_size: int, dtype: str
) -> tuple[EncodedTensor, torch.Tensor]:
    """topk2 of the flat fp32 ``x = t + residual`` and the new residual ``x - decoded``."""
    if not all_finite(x):
        _raise_not_finite(t, residual)
    data, steps, decoded = encode_topk(x, block_size)
    enc = EncodedTensor(
        codec="topk2",
        shape=tuple(t.shape),
        dtype=dtype,
        block_size=block_size,
        data=_to_buffer(data),
        scales=_to_buffer(steps),
    )
    torch.sub(x, decoded, out=decoded)
    return enc, decoded.view(t.shape)


def _compress_sign(
    x: torch.Tensor, t: torch.Tensor, residual: torch.Tensor | None, block_size: int, dtype: str
) -> tuple[EncodedTensor, torch.Tensor]:
    """sign1 of the flat fp32 ``x = t + residual`` and the new residual ``x - decoded``."""
    if not all_finite(x):
        _raise_not_finite(t, residual)
    n = x.numel()
    decoded = new_vector_like(x)
    scales = torch.empty(-(-n // block_size), dtype=torch.float32, device=x.device)
    for lo, hi, first, rows in _spans(n, block_size):
        # |x| into the decoded buffer, then its row means (fp32 sums of finite values: finite
        # unless a block's |x| sum overflows, which only values near fp32's maximum can do)
        torch.mean(
            torch.abs(x[lo:hi], out=decoded[lo:hi]).view(rows, -1),
            dim=1,
            out=scales[first : first + rows],
        )
    if not all_finite(scales):
        raise LocalProtocolError(
            "tensor to compress is too large for sign1's block means (near fp32's maximum)"
        )
    bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=x.device)
    torch.ge(x, 0, out=bits[:n].view(torch.bool))
    packed = (bits.view(-1, 8) * _BITS.to(x.device)).sum(dim=1, dtype=torch.uint8)
    torch.mul(bits[:n], 2, out=bits[:n])  # 0/2, then -1/+1 in fp32 below
    decoded.copy_(bits[:n]).sub_(1)
    _scale_blocks(decoded, scales, block_size)  # decoded now holds exactly what decompress returns
    enc = EncodedTensor(
        codec="sign1",
        shape=tuple(t.shape),
        dtype=dtype,
        block_size=block_size,
        data=_to_buffer(packed),
        scales=_to_buffer(scales),
    )
    torch.sub(x, decoded, out=decoded)
    return enc, decoded.view(t.shape)


def _quantize(x: torch.Tensor, block_size: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax codes (fp32 integers in [-qmax, qmax], shape of ``x``) and scales."""
    n = x.numel()
    codes = new_vector_like(x)  # becomes the residual: a freed one's memory is taken again
    scales = torch.empty(-(-n // block_size), dtype=torch.float32, device=x.device)
    for lo, hi, first, rows in _spans(n, block_size):
        xs, cs = x[lo:hi].view(rows, -1), codes[lo:hi].view(rows, -1)
        ss = scales[first : first + rows]
        # |x| into the codes' buffer, then its row maxima: a fraction of aminmax(dim=1)'s time
        # on short rows. NaN propagates into the scale
        torch.amax(torch.abs(xs, out=cs), dim=1, out=ss)
        ss.div_(qmax)
        safe = torch.where(ss > 0, ss, torch.ones_like(ss))
        torch.div(xs, safe.unsqueeze(1), out=cs)
        cs.round_().clamp_(-qmax, qmax)
    return codes, scales


def _pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """One signed byte per code."""
    return codes.to(torch.int8)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two nibbles ``q + 8`` per byte, low nibble first; an odd tail pads with 8 (zero).

    Each byte is ``(q0 + 8) + 16 (q1 + 8)`` computed on the fp32 codes (small integers: exact),
    then cast once: a third faster than casting to int8 and shifting strided halves."""
    n = codes.numel()
    half = n // 2
    packed = torch.empty(half + (n & 1), dtype=torch.uint8, device=codes.device)
    pairs = codes[: 2 * half].view(half, 2)
    packed[:half].copy_(torch.add(pairs[:, 0], pairs[:, 1], alpha=16).add_(136))
    if n & 1:
        packed[half] = int(codes[-1]) + 136
    return packed


def _to_buffer(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a 1-D tensor's storage (moved to the CPU if needed)."""
    flat = t.detach().to("cpu").contiguous().view(-1)
    return flat.view(torch.uint8).numpy().data.toreadonly()


# ---------------------------------------------------------------- decoding


def _check_remote(enc: EncodedTensor) -> torch.Tensor | None:
    """The scales (int codecs) after checking that ``enc`` decodes to finite values.

    Raises ``DecodeError`` for NaN/Inf payloads or NaN, negative or out-of-range scales.
    """
    if enc.codec == "none" or enc.codec == "bf16":
        view = torch.frombuffer(
            enc.data, dtype=torch.float32 if enc.codec == "none" else torch.bfloat16
        )
        if not all_finite(view):
            raise DecodeError(f"{enc.codec} tensor payload contains NaN or Inf")
        return None
    scales = torch.frombuffer(enc.scales, dtype=torch.float32)
    if not bool(((scales >= 0) & (scales <= _SCALE_LIMIT[enc.codec])).all()):
        raise DecodeError(f"{enc.codec} tensor has NaN, negative or out-of-range block scales")
    return scales


def _decode_into(enc: EncodedTensor, target: torch.Tensor) -> None:
    """Write the raw values (fp32 payload, bf16 values or integer codes) into fp32 ``target``."""
    if enc.codec == "none":
        target.copy_(torch.frombuffer(enc.data, dtype=torch.float32))
    elif enc.codec == "bf16":
        target.copy_(torch.frombuffer(enc.data, dtype=torch.bfloat16))
    elif enc.codec == "int8":
        target.copy_(torch.frombuffer(enc.data, dtype=torch.int8))
    elif enc.codec == "sign1":
        packed = torch.frombuffer(enc.data, dtype=torch.uint8)
        bits = (packed.unsqueeze(1) & _BITS).ne(0).view(-1)[: target.numel()]
        target.copy_(bits).mul_(2).sub_(1)
    else:
        packed = torch.frombuffer(enc.data, dtype=torch.uint8)
        pairs = target.numel() // 2
        both = target[: 2 * pairs].view(pairs, 2)
        both[:, 0].copy_(packed[:pairs] & 15)
        both[:, 1].copy_(packed[:pairs] >> 4)
        if target.numel() & 1:
            target[-1] = packed[-1] & 15
        target.sub_(8)


def _scale_blocks(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    """Multiply each block of fp32 ``codes`` in place by its scale."""
    for lo, hi, first, rows in _spans(codes.numel(), block_size):
        codes[lo:hi].view(rows, -1).mul_(scales[first : first + rows].unsqueeze(1))


def _spans(n: int, block_size: int) -> list[tuple[int, int, int, int]]:
    """Non-empty (start, stop, first block, rows) spans: the full blocks, then the partial tail.

    Each span is viewed as ``(rows, -1)``, so a vectorised op covers all its blocks at once.
    """
    full = n // block_size * block_size
    spans = [(0, full, 0, full // block_size), (full, n, full // block_size, 1)]
    return [s for s in spans if s[1] > s[0]]
