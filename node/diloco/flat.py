"""A fragment's tensors on the wire and as one flat fp32 vector: content hash and decoding.

Owners seal versions with ``content_hash``; state sync checks it, and learners and owners decode
with ``flat_from_tensors``, which checks every shape against the fragment plan and refuses NaN/Inf
(``decompress`` checks each tensor's remote bytes before writing them: one pass, no second one).
For the ``none`` codec the decoded flat vector is the tensors' data bytes end to end, so its
``flat_digest`` equals the ``content_hash`` of the tensors (``flat_is_wire_form`` says when).

Fragment-sized vectors made each round (pseudo-gradients, decoded contributions and versions) come
from ``new_flat``: memory from ``malloc`` rather than torch's aligned allocations, so a freed
one is taken again by the next of its size instead of the heap growing with fresh pages.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import blake3
import numpy as np
import torch

from node.wire.bodies import REQUEST_BODY
from protocol.diloco.compression import compress
from protocol.diloco.updates import decode_flat, fragment_numel
from protocol.diloco.vectors import new_vector as new_flat
from protocol.wire.signing import digest_parts
from protocol.wire.tensors import EncodedTensor

__all__ = [
    "content_hash",
    "encode_flat",
    "flat_digest",
    "flat_from_tensors",
    "flat_is_wire_form",
    "new_flat",
    "view_in_request_body",
    "wire_flat_span",
]


def content_hash(tensors: Sequence[EncodedTensor]) -> bytes:
    """BLAKE3 (32 bytes) over every tensor's data and scales, in order: the digest of a message's
    blobs that carries these tensors (``digest_parts``), which a receiver computes anyway."""
    return digest_parts([part for t in tensors for part in (t.data, t.scales)])


def flat_digest(flat: torch.Tensor) -> bytes:
    """BLAKE3 (32 bytes) of a flat fp32 global fragment as a learner holds it (after decoding):
    the identity of the state a pseudo-gradient was measured against. Every peer hashes every
    version it takes, so the hash is BLAKE3 (1.5-3.5x SHA-256's speed on one core here), as the envelopes'."""
    data = flat.detach().to(torch.float32).contiguous().cpu().numpy().data.cast("B")
    return blake3.blake3(data).digest()


def flat_is_wire_form(tensors: Sequence[EncodedTensor]) -> bool:
    """Whether the flat fp32 vector these tensors decode to is their data bytes end to end (every
    tensor ``none``-coded, fp32): then ``flat_digest`` of it equals ``content_hash(tensors)``."""
    return all(t.codec == "none" for t in tensors)


def view_in_request_body(
    tensors: Sequence[EncodedTensor], shapes: Sequence[tuple[int, ...]]
) -> torch.Tensor | None:
    """The flat fp32 vector ``tensors`` decode to, as a view of the request body they arrived in
    (``REQUEST_BODY``), which then holds that buffer until the view is collected
    (``RequestBody.keep_for``); None when they are not fp32 ``none`` tensors of ``shapes`` lying
    end to end in this request's body, or the body is held already (the caller copies them)."""
    body = REQUEST_BODY.get()
    span = wire_flat_span(tensors, shapes) if body is not None else None
    if body is None or span is None or span[0] is not body.buf:
        return None
    # the tensor keeps this array alive for as long as it or any slice of it lives: the body is
    # held by the array, not by one tensor object
    array = np.frombuffer(body.buf, dtype=np.float32, count=span[2], offset=span[1])
    if not body.keep_for(array):
        return None
    return torch.from_numpy(array)


def wire_flat_span(
    tensors: Sequence[EncodedTensor], shapes: Sequence[tuple[int, ...]]
) -> tuple[bytearray, int, int] | None:
    """Where the flat fp32 vector these tensors decode to lies as they arrived: (the buffer, the
    byte offset in it, the number of values), when they are fp32 ``none`` tensors of the plan's
    shapes lying end to end in one ``bytearray``; else None (``flat_from_tensors`` copies them)."""
    if len(tensors) != len(shapes) or not flat_is_wire_form(tensors):
        return None
    start, end, total, owner = None, None, 0, None
    for t, shape in zip(tensors, shapes, strict=True):
        if (
            t.dtype != "float32"
            or tuple(t.shape) != tuple(shape)
            or not isinstance(t.data, memoryview)
        ):
            return None
        n = t.numel
        if n == 0:
            continue
        if t.data.readonly or t.data.nbytes != 4 * n or not isinstance(t.data.obj, bytearray):
            return None
        address = ctypes.addressof(ctypes.c_char.from_buffer(t.data))
        if (end is not None and address != end) or (owner is not None and t.data.obj is not owner):
            return None
        start, owner = (address, t.data.obj) if start is None else (start, owner)
        end, total = address + 4 * n, total + n
    if start is None or owner is None:
        return None
    return owner, start - ctypes.addressof(ctypes.c_char.from_buffer(owner)), total


def flat_from_tensors(
    tensors: Sequence[EncodedTensor],
    shapes: Sequence[tuple[int, ...]],
    out: torch.Tensor | None = None,
    *,
    finite_check: bool = True,
) -> torch.Tensor:
    """Decompress a fragment's tensors into one flat fp32 vector, checking shapes; into ``out``
    (a contiguous fp32 vector of the fragment's size, e.g. a reused buffer) when given, else
    into a ``new_flat`` one.

    Raises ``DecodeError`` on a wrong tensor count or shape, or non-finite values (checked by
    ``decompress`` on each tensor's remote bytes before they are written; ``finite_check=False``
    leaves that to a caller that measures the result's ``norm64``).
    """
    if out is None:
        out = new_flat(fragment_numel(shapes))
    return decode_flat(tensors, shapes, out, finite_check=finite_check)


def encode_flat(
    flat: torch.Tensor,
    shapes: Sequence[tuple[int, ...]],
    codec: str,
    *,
    copy: bool = True,
    known_finite: bool = False,
) -> list[EncodedTensor]:
    """A flat fp32 fragment as its tensors on the wire, each compressed with ``codec`` (how an
    owner publishes a version: ``flat_digest(flat_from_tensors(encode_flat(...)))`` is the
    version's digest). ``copy=False``: ``none`` tensors are views of ``flat``, which must then
    not be written to while they are in use (see ``compress``). ``known_finite``: checked by the
    caller already (``compress`` does not read it again for ``none``)."""
    tensors, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        enc, _ = compress(
            flat[offset : offset + n].view(shape), codec, copy=copy, known_finite=known_finite
        )
        tensors.append(enc)
        offset += n
    return tensors
