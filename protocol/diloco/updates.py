"""Global versions as compressed outer updates, with the owner's error feedback.

An owner that publishes updates keeps its global fragment Θ as the very state its learners hold
(the "published" state), and an error-feedback residual e. For each merge the outer step gives a
target Θ*; the owner sends ``q = Q(Θ* − Θ + e)`` with one of the lossy codecs of
``protocol.diloco.compression``, and every peer, the owner included, sets ``Θ ← Θ + D(q)`` with
``apply_update``; the owner keeps ``e ← (Θ* − Θ + e) − D(q)``, so what one update rounds away is
sent with the next (``compress``'s residual). Because all of them run the same fp32
element-wise add on the same bytes, they hold bit-identical states, and the owner signs the hash
of the result with the update: a learner whose state hashes otherwise (a different base, a bug)
fetches the full version instead.

``decode_flat`` is the one decoder of a fragment's tensors into a flat fp32 vector (shapes
checked against the plan, NaN/Inf refused before anything is written), shared with full versions
and contributions (``node.diloco.flat.flat_from_tensors``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.diloco.compression import compress, decompress
from protocol.diloco.norms import all_finite
from protocol.diloco.vectors import new_vector
from protocol.errors import DecodeError, LocalProtocolError
from protocol.wire.tensors import UPDATE_CODECS, EncodedTensor

__all__ = ["UPDATE_CODECS", "apply_update", "decode_flat", "encode_update", "fragment_numel"]


def fragment_numel(shapes: Sequence[tuple[int, ...]]) -> int:
    """Elements of a fragment with these tensor shapes."""
    return sum(int(torch.Size(s).numel()) for s in shapes)


def decode_flat(
    tensors: Sequence[EncodedTensor],
    shapes: Sequence[tuple[int, ...]],
    out: torch.Tensor | None = None,
    *,
    finite_check: bool = True,
) -> torch.Tensor:
    """Decompress a fragment's tensors into one flat fp32 vector, checking shapes; into ``out``
    (a contiguous fp32 vector of the fragment's size, e.g. a reused buffer) when given.

    Raises ``DecodeError`` on a wrong tensor count or shape, or non-finite values (checked by
    ``decompress`` on each tensor's remote bytes before they are written), and ``ValueError``
    for an ``out`` that does not fit (our own bug). ``finite_check``: see ``decompress``.
    """
    if len(tensors) != len(shapes):
        raise DecodeError(f"fragment has {len(shapes)} tensors, message carries {len(tensors)}")
    total = fragment_numel(shapes)
    if out is None:
        out = new_vector(total)
    elif out.shape != (total,) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous fp32 vector of {total} values, got {out.dtype} {tuple(out.shape)}"
        )
    offset = 0
    for i, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
        if tuple(t.shape) != tuple(shape):
            raise DecodeError(
                f"tensor {i}: shape {tuple(t.shape)} does not match the plan's {tuple(shape)}"
            )
        n = t.numel
        decompress(t, out=out[offset : offset + n].view(shape), finite_check=finite_check)
        offset += n
    return out


def apply_update(
    base: torch.Tensor,
    tensors: Sequence[EncodedTensor],
    shapes: Sequence[tuple[int, ...]],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``base + D(tensors)``: the next published state, as every peer computes it (a new fp32
    vector, or ``out``; ``base`` is not written unless it is ``out``).

    Raises ``DecodeError`` for tensors that do not fit the shapes, decode to NaN/Inf, or make
    the sum overflow fp32; ``ValueError`` for a ``base`` of the wrong size.
    """
    total = fragment_numel(shapes)
    if base.shape != (total,) or base.dtype != torch.float32:
        raise ValueError(
            f"base must be a flat fp32 vector of {total} values, got {base.dtype} {tuple(base.shape)}"
        )
    same = out is not None and out.data_ptr() == base.data_ptr()
    delta = decode_flat(tensors, shapes, out=None if same else out)
    result = base.add_(delta) if same else delta.add_(base)
    if not all_finite(result):
        raise DecodeError("the update overflows float32 when added to its base")
    return result


def encode_update(
    target: torch.Tensor,
    published: torch.Tensor,
    residual: torch.Tensor | None,
    shapes: Sequence[tuple[int, ...]],
    codec: str,
    *,
    block_size: int = 64,
    consume_target: bool = False,
) -> tuple[list[EncodedTensor], torch.Tensor, torch.Tensor]:
    """The owner's side: compress ``target − published + residual`` tensor by tensor.

    Returns the encoded update, the new published state (``apply_update(published, ...)``, a new
    vector: what every learner will hold) and the new residual (flat fp32). ``consume_target``:
    ``target`` is a flat fp32 vector the caller no longer needs (a merge's fresh result): the
    difference is computed in its place, and the published state reuses it (the same bits, one
    fragment-sized vector fewer). Raises ``LocalProtocolError`` for a codec that is not lossy
    (``UPDATE_CODECS``), mismatched sizes, or a target/residual that is not finite.
    """
    if codec not in UPDATE_CODECS:
        raise LocalProtocolError(
            f"updates are published with one of {UPDATE_CODECS}, not {codec!r}"
        )
    total = fragment_numel(shapes)
    for name, t in (("target", target), ("published", published), ("residual", residual)):
        if t is not None and t.shape != (total,):
            raise LocalProtocolError(
                f"{name} must be a flat vector of {total} values, got {tuple(t.shape)}"
            )
    scratch = (
        consume_target
        and target.dtype == torch.float32
        and target.is_contiguous()
        and target.data_ptr() != published.data_ptr()
    )
    delta = torch.sub(
        target.detach().float(), published, out=target if scratch else new_vector(total)
    )
    new_residual = new_vector(total)
    tensors, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        part = delta[offset : offset + n].view(shape)
        r = None if residual is None else residual[offset : offset + n].view(shape)
        enc, left = compress(part, codec, block_size=block_size, residual=r)
        new_residual[offset : offset + n].copy_(left.reshape(-1))
        tensors.append(enc)
        offset += n
    try:
        new_published = apply_update(
            published, tensors, shapes, out=delta
        )  # delta is ours to reuse
    except DecodeError as exc:
        raise LocalProtocolError(f"the owner's own update does not apply: {exc}") from None
    return tensors, new_published, new_residual
