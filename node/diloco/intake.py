"""What an owner takes in: each contribution decoded, and screened against the state it holds.

A contribution is kept as it arrived, its compressed tensors (``protocol.diloco.sliced``:
the merge decodes them a slice at a time, so a round's n contributions cost n times their
compressed bytes, not n fragment-sized vectors), and its norm is measured once, slice by slice
(the merge reuses it). fp32 tensors are merged where they arrived, as a view of the request
body, which holds its buffer until then; ``topk2`` tensors are decoded whole into a flat vector
(a buffer kept from an earlier merge when one is spare). ``ContributionIntake.screen`` then says why it is refused before the merger, if it is
(``protocol.diloco.intake``): its norm far out of bounds, a base this owner does not hold under
that version, or work from that base merged already. It also keeps who is owed a resync and
whose "last" mark was spent.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch

from node.diloco.flat import flat_from_tensors, new_flat, view_in_request_body
from node.diloco.owner_state import OwnerConfig, OwnerState
from node.wire.bodies import REQUEST_BODY
from protocol.diloco.intake import (
    LastMarks,
    ResyncLedger,
    already_merged,
    base_mismatch,
    out_of_bounds,
)
from protocol.diloco.norms import norm64
from protocol.diloco.sliced import Delta, EncodedVector, norm_of, sliceable
from protocol.errors import DecodeError
from protocol.wire.messages import Contribution
from protocol.wire.tensors import EncodedTensor

__all__ = ["SPARE_MAX_BYTES", "ContributionIntake", "Refused"]

# A decoded buffer is kept for the next contribution only while the spares stay within this:
# a small model's buffers are reused warm, but at 124M parameters four spares of a 113-157 MB
# fragment were most of an owner's memory between merges, for ~55 ms of page faults saved per
# contribution (docs/scale.md)
SPARE_MAX_BYTES = 100 << 20  # two of a 50M-parameter model's fragments; none at 124M


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a contribution is refused before the merger; ``counted`` names the penalty it counts
    against its sender (``refused_<counted>``)."""

    reason: str
    counted: str  # "out_of_bounds" or "base"


class ContributionIntake:
    """Decodes one owner's contributions and screens them against ``state``."""

    def __init__(self, config: OwnerConfig, state: OwnerState) -> None:
        self.fragment, self.shapes, self.state = config.fragment.index, config.shapes, state
        # decoded contributions' buffers, reused once their merge is published; at most as many
        # as the last published merge had contributions
        self.spare: list[torch.Tensor] = []
        self.spare_max = 4
        self._borrowed: dict[int, weakref.ref[torch.Tensor]] = {}  # lent vectors, by id
        self.resyncs = ResyncLedger()  # learners told to resync, owed a serve
        self.last = LastMarks()

    def screen(
        self, sender: bytes, msg: Contribution, norm: float, reference: float | None
    ) -> Refused | None:
        """Why the decoded ``msg`` of norm ``norm`` is refused before the merger (``reference``:
        the merger's norm reference), or None. A "resync" refusal owes ``sender`` a serve."""
        state = self.state
        far = out_of_bounds(
            norm,
            reference=reference,
            theta_norm=state.theta_norm() if reference is None else 0.0,
            fragment=self.fragment,
        )
        if far is not None:
            return Refused(far, "out_of_bounds")
        mismatch = base_mismatch(
            msg.base_version,
            msg.base_digest,
            digests=state.digests,
            version=state.version,
            keep=state.keep,
            fragment=self.fragment,
        ) or already_merged(
            msg.base_version,
            state.merged_base.get(sender),
            version=state.version,
            fragment=self.fragment,
        )
        if mismatch is not None:
            self.resyncs.owe(sender, state.version)
            return Refused(mismatch, "base")
        return None

    def owes_resync(self, asker: bytes | None) -> bool:
        """Whether ``asker`` is a learner this owner told to resync since it last fetched from
        it (spent by asking): its fetch must be served, not refused as a repeat or past the
        budget (``protocol.diloco.spread``), or in a round that waits for its contribution it
        would wait for a version that never comes (``protocol.diloco.intake.ResyncLedger``)."""
        return self.resyncs.spend(asker)

    def decode(self, msg: Contribution, given: torch.Tensor | None = None) -> tuple[Delta, float]:
        """The contribution as its merge reads it, and its norm: a flat fp32 vector when one is
        held anyway (``given``, or fp32 tensors lying in the request body), else the compressed
        tensors themselves (``EncodedVector``, decoded a slice at a time by the merge, so an
        owner holds no decoded contribution between arrival and merge; ``topk2`` tensors, which
        have no range decoder, are decoded whole as before). Raises ``DecodeError`` for a wrong
        shape, or NaN/Inf: the norm (fp64-summed, finite exactly when every value is) is the
        check, so the values are read once for it. ``given``: our own learner's contribution as
        the flat vector its ``none`` tensors are views of: taken without a copy, and never given
        back for reuse (it is the learner's)."""
        numel = self.state.theta.numel()
        if given is not None:
            if (
                given.dtype != torch.float32
                or given.dim() != 1
                or given.numel() != numel
                or not given.is_contiguous()
                or given.device.type != "cpu"
            ):
                raise DecodeError(
                    f"a local contribution must be a flat fp32 vector of {numel} values"
                )
            return self._measured(self._lend(given))
        if (view := self._view_in_body(msg)) is not None:  # fp32 merged where it arrived
            return self._measured(self._lend(view))
        if sliceable(msg.tensors):
            kept = self._kept(EncodedVector(msg.tensors, self.shapes))
            norm = norm_of(kept)
            if not math.isfinite(norm):
                raise DecodeError("the contribution holds NaN or Inf values")
            return kept, norm
        try:
            out = self.spare.pop()
        except IndexError:
            out = new_flat(numel)
        try:
            flat = flat_from_tensors(msg.tensors, self.shapes, out=out, finite_check=False)
        except BaseException:
            self.give_back(out)
            raise
        return self._measured(flat)

    def _measured(self, flat: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``flat`` and its norm; raises ``DecodeError`` (giving it back) when not finite."""
        norm = norm64(flat)
        if not math.isfinite(norm):
            self.give_back(flat)  # a decoded buffer is kept for the next one, a lent vector dropped
            raise DecodeError("the contribution holds NaN or Inf values")
        return flat, norm

    def _kept(self, encoded: EncodedVector) -> EncodedVector:
        """``encoded``, its bytes its own past the request: a request body goes back to the
        pool for the next download when its request ends, so tensors lying in it hold it
        (``RequestBody.keep_for``, one holder per body) or, when it is held already, are copied."""
        body = REQUEST_BODY.get()
        if body is None or not any(_in_buffer(t, body.buf) for t in encoded.tensors):
            return encoded
        if body.keep_for(encoded):
            return encoded
        return EncodedVector([_owned(t) for t in encoded.tensors], self.shapes)

    def _view_in_body(self, msg: Contribution) -> torch.Tensor | None:
        """The contribution's fp32 tensors as one flat view of the request body they arrived in
        (``view_in_request_body``); None when they are not such tensors, or not in this body."""
        return view_in_request_body(msg.tensors, self.shapes)

    def _lend(self, flat: torch.Tensor) -> torch.Tensor:
        """Mark ``flat`` as not ours to reuse (``give_back`` drops it instead of keeping it)."""
        key = id(flat)  # a dict by id: a set of tensors would compare them element-wise

        def forget(_ref: weakref.ref[torch.Tensor]) -> None:
            self._borrowed.pop(key, None)

        self._borrowed[key] = weakref.ref(flat, forget)
        return flat

    def give_back(self, flat: Delta) -> None:
        """Keep a decoded contribution's buffer for the next one (nothing else refers to it; a
        local contribution's vector is its learner's, and a view of a request body is that
        body's: neither is kept)."""
        if not isinstance(flat, torch.Tensor):  # compressed bytes: nothing to reuse
            return
        borrowed = self._borrowed.pop(id(flat), None)
        if borrowed is not None and borrowed() is flat:
            return
        numel = self.state.theta.numel()
        if (
            len(self.spare) < self.spare_max
            and flat.numel() == numel
            and (len(self.spare) + 1) * 4 * numel <= SPARE_MAX_BYTES
        ):
            self.spare.append(flat)


def _in_buffer(t: EncodedTensor, buf: object) -> bool:
    """Whether ``t``'s data or scales are views of ``buf``."""
    return any(isinstance(b, memoryview) and b.obj is buf for b in (t.data, t.scales))


def _owned(t: EncodedTensor) -> EncodedTensor:
    """``t`` with bytes of its own."""
    return dataclasses.replace(t, data=bytes(t.data), scales=bytes(t.scales))
