"""A fragment's tensors on the wire and as one flat fp32 vector: content hash and decoding.

Owners seal versions with ``content_hash``; learners and state sync check it and decode with
``flat_from_tensors``, which checks every shape against the fragment plan and refuses NaN/Inf.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from protocol.diloco.compression import compress, decompress
from protocol.errors import DecodeError
from protocol.wire.tensors import EncodedTensor

__all__ = ["content_hash", "encode_flat", "flat_digest", "flat_from_tensors"]

DIGEST_CHUNK = 1 << 20


def content_hash(tensors: Sequence[EncodedTensor]) -> bytes:
    """SHA-256 over every tensor's data and scales, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.data)
        h.update(t.scales)
    return h.digest()


def flat_digest(flat: torch.Tensor) -> bytes:
    """SHA-256 of a flat fp32 global fragment as a learner holds it (after decoding): the
    identity of the state a pseudo-gradient was measured against. Hashed in 1 MiB pieces."""
    data = flat.detach().to(torch.float32).contiguous().cpu().numpy().data.cast("B")
    h = hashlib.sha256()
    for start in range(0, len(data), DIGEST_CHUNK):
        h.update(data[start:start + DIGEST_CHUNK])
    return h.digest()


def flat_from_tensors(tensors: Sequence[EncodedTensor], shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """Decompress a fragment's tensors into one flat fp32 vector, checking shapes.

    Raises ``DecodeError`` on a wrong tensor count or shape, or non-finite values.
    """
    if len(tensors) != len(shapes):
        raise DecodeError(f"fragment has {len(shapes)} tensors, message carries {len(tensors)}")
    total = sum(int(torch.Size(s).numel()) for s in shapes)
    out = torch.empty(total, dtype=torch.float32)
    offset = 0
    for i, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
        if tuple(t.shape) != tuple(shape):
            raise DecodeError(f"tensor {i}: shape {tuple(t.shape)} does not match the plan's {tuple(shape)}")
        n = t.numel
        decompress(t, out=out[offset:offset + n].view(shape))
        offset += n
    if not torch.isfinite(out).all():
        raise DecodeError("fragment contains NaN or Inf values")
    return out


def encode_flat(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]], codec: str) -> list[EncodedTensor]:
    """A flat fp32 fragment as its tensors on the wire, each compressed with ``codec`` (how an
    owner publishes a version: ``flat_digest(flat_from_tensors(encode_flat(...)))`` is the
    version's digest)."""
    tensors, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        enc, _ = compress(flat[offset:offset + n].view(shape), codec)
        tensors.append(enc)
        offset += n
    return tensors
