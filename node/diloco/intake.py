"""What an owner takes in: each contribution decoded, and screened against the state it holds.

A contribution is decoded into one flat fp32 vector (a buffer kept from an earlier merge when one
is spare: fresh memory is slow to fill; fp32 tensors are merged where they arrived, as a view of
the request body, which holds its buffer until then) and its norm measured once (the merge reuses
it). ``ContributionIntake.screen`` then says why it is refused before the merger, if it is
(``protocol.diloco.intake``): its norm far out of bounds, a base this owner does not hold under
that version, or work from that base merged already. It also keeps who is owed a resync and
whose "last" mark was spent.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from node.diloco.flat import flat_from_tensors, new_flat, wire_flat_span
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
from protocol.errors import DecodeError
from protocol.wire.messages import Contribution

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

    def decode(
        self, msg: Contribution, given: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, float]:
        """The contribution as one flat fp32 vector (in a reused buffer when one is spare) and
        its norm. Raises ``DecodeError`` for a wrong shape, or NaN/Inf: the norm (fp64-summed,
        finite exactly when every value is) is the check, so the values are read once for it.
        ``given``: our own learner's contribution as the flat vector its ``none`` tensors are
        views of: taken without a copy, and never given back for reuse (it is the learner's)."""
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
            flat = self._lend(given)
        elif (
            view := self._view_in_body(msg)
        ) is not None:  # fp32 tensors merged where they arrived: no copy
            flat = self._lend(view)
        else:
            try:
                out = self.spare.pop()
            except IndexError:
                out = new_flat(numel)
            try:
                flat = flat_from_tensors(msg.tensors, self.shapes, out=out, finite_check=False)
            except BaseException:
                self.give_back(out)
                raise
        norm = norm64(flat)
        if not math.isfinite(norm):
            self.give_back(flat)  # a decoded buffer is kept for the next one, a lent vector dropped
            raise DecodeError("the contribution holds NaN or Inf values")
        return flat, norm

    def _view_in_body(self, msg: Contribution) -> torch.Tensor | None:
        """The contribution's fp32 tensors as one flat view of the request body they arrived in,
        which then holds that buffer until the view is collected (``RequestBody.keep_for``);
        None when they are not such tensors, or not in this request's body."""
        body = REQUEST_BODY.get()
        span = wire_flat_span(msg.tensors, self.shapes) if body is not None else None
        if body is None or span is None or span[0] is not body.buf:
            return None
        # the tensor keeps this array alive for as long as it or any slice of it lives: the body
        # is held by the array, not by one tensor object
        array = np.frombuffer(body.buf, dtype=np.float32, count=span[2], offset=span[1])
        if not body.keep_for(array):
            return None
        return torch.from_numpy(array)

    def _lend(self, flat: torch.Tensor) -> torch.Tensor:
        """Mark ``flat`` as not ours to reuse (``give_back`` drops it instead of keeping it)."""
        key = id(flat)  # a dict by id: a set of tensors would compare them element-wise

        def forget(_ref: weakref.ref[torch.Tensor]) -> None:
            self._borrowed.pop(key, None)

        self._borrowed[key] = weakref.ref(flat, forget)
        return flat

    def give_back(self, flat: torch.Tensor) -> None:
        """Keep a decoded contribution's buffer for the next one (nothing else refers to it; a
        local contribution's vector is its learner's, and a view of a request body is that
        body's: neither is kept)."""
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
