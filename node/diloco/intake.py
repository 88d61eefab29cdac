"""What an owner takes in: each contribution decoded, checked and handed to its merger.

``ContributionIntake`` is mixed into ``FragmentOwner`` (which provides the attributes below). A
contribution is decoded into one flat fp32 vector (a buffer kept from an earlier merge when one
is spare; fresh memory is slow to fill; fp32 tensors are merged where they arrived, as a view of
the request body, which holds its buffer until then), its norm measured once (the merge reuses it), and it
is refused before the merger when it was measured against a state this owner does not hold under
that version, when the sender's work from that base was merged already (a pseudo-gradient is
cumulative since its base: counting it twice would count its steps twice), or when its norm is
far out of bounds (``OUT_OF_BOUNDS`` times the merger's norm reference, or |Theta| with none):
refused with the reason "out of bounds", counted against its sender (``refused_out_of_bounds``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from node.diloco.eventlog import LoggedMerger
from node.diloco.flat import flat_from_tensors, new_flat, wire_flat_span
from node.wire.bodies import REQUEST_BODY
from protocol.diloco.activity import LearnerActivity
from protocol.diloco.fragments import Fragment
from protocol.diloco.merge import Decision, FragmentMerger
from protocol.diloco.norms import norm64
from protocol.diloco.standing import Event, Standing
from protocol.errors import DecodeError, Stale
from protocol.wire.messages import Ack, Contribution

if TYPE_CHECKING:
    from node.diloco.owner import OwnerCounts

__all__ = ["ContributionIntake"]

log = logging.getLogger("node.diloco.owner")


LAST_SENDERS_KEPT = 100_000  # senders whose "last" mark was honoured; beyond, the mark is ignored
RESYNCS_OWED_KEPT = (
    4096  # learners told to resync (owed a serve, or served one of this version); the oldest go
)
OWED_SERVES_PER_VERSION = (
    2  # owed serves of one version to one learner: one more if the first is lost
)
OUT_OF_BOUNDS = (
    1000.0  # a contribution's norm over this many times the reference is refused at intake
)


class ContributionIntake:
    """The contribution-taking side of ``FragmentOwner``."""

    fragment: Fragment
    shapes: list[tuple[int, ...]]
    theta: torch.Tensor
    version: int
    digests: dict[int, set[bytes]]
    merger: FragmentMerger
    log: LoggedMerger | None
    clock: Callable[[], float]
    _keep_digests: int
    _merged_base: dict[bytes, int]
    _last_from: set[bytes]  # senders whose last contribution this owner has taken
    resyncs_owed: dict[
        bytes, tuple[int, int, bool]
    ]  # learner -> (version, owed serves of it given, one owed now)
    activity: LearnerActivity
    _spare: list[torch.Tensor]
    _spare_max: int
    _borrowed: dict[int, weakref.ref[torch.Tensor]]
    standing: Standing  # per sender key: refused while low (``protocol.diloco.standing``)
    _theta_norm: tuple[weakref.ref[torch.Tensor], float] | None

    counts: OwnerCounts

    if TYPE_CHECKING:  # FragmentOwner's

        def final_hold(self) -> str | None: ...

    async def _accept(
        self, sender: bytes, msg: Contribution, given: torch.Tensor | None = None
    ) -> Decision | Ack:
        """Decode, check and hand one contribution to the merger: its decision, or the Ack of
        a refusal before the merger (a final version handed out, a base this owner does not hold,
        work merged already)."""
        if (held := self.final_hold()) is not None:  # before decoding: refused at no cost
            log.info("%s (from %s)", held, sender.hex()[:8])
            return Ack(accepted=False, reason=held, version=self.version)
        if (
            low := self.standing.refused(sender, version=self.version)
        ) is not None:  # also at no cost
            self.counts.penalties[sender]["refused_standing"] += 1
            return Ack(
                accepted=False,
                reason=f"fragment {self.fragment.index}: {low}",
                version=self.version,
            )
        if msg.base_version > self.version:
            raise Stale(f"base version {msg.base_version} is ahead of the owner's {self.version}")
        try:
            flat, norm = await asyncio.to_thread(
                self._decode, msg, given
            )  # malformed: a 4xx, whatever its base
        except (
            DecodeError
        ):  # NaN/Inf or a wrong shape: counts against the (authenticated) sender too
            self.standing.record(sender, Event.REFUSED, version=self.version)
            raise
        if (
            far := self._out_of_bounds(norm)
        ) is not None:  # acknowledged as taken, it was a free shot
            self._give_back(flat)
            self.counts.penalties[sender]["refused_out_of_bounds"] += 1
            self.standing.record(sender, Event.REFUSED, version=self.version)
            log.info("fragment %d: %s (from %s)", self.fragment.index, far, sender.hex()[:8])
            return Ack(accepted=False, reason=far, version=self.version)
        mismatch = self._base_mismatch(msg) or self._already_merged(sender, msg)
        if mismatch is not None:
            self._give_back(flat)
            self.counts.penalties[sender]["refused_base"] += 1
            self._owe_resync(sender)
            log.info("fragment %d: %s", self.fragment.index, mismatch)
            return Ack(accepted=False, reason=mismatch, version=self.version)
        if self.log is not None:
            self.log.note_payload(msg)
        # a sender's last contribution makes its round wait for the others' (bounded): honoured
        # once per sender, so a member marking all its work "last" cannot slow every round; a
        # refused one (a duplicate, say) does not spend the mark, so its resend is still honoured
        last = (
            msg.last and sender not in self._last_from and len(self._last_from) < LAST_SENDERS_KEPT
        )
        now = self.clock()
        decision = self.merger.on_contribution(
            sender,
            base_version=msg.base_version,
            tokens=msg.tokens,
            steps=msg.steps,
            step_time=msg.step_time,
            payload=flat,
            norm=norm,
            now=now,
            last=last,
        )
        if decision.refusal is not None:
            self.counts.penalties[sender][f"refused_{decision.refusal}"] += 1
        self.activity.heard(
            sender, now, steps=msg.steps, step_time=msg.step_time, accepted=decision.accepted
        )
        if decision.accepted:
            if last:
                self._last_from.add(sender)
        else:
            self._give_back(flat)
        log.info("fragment %d: %s", self.fragment.index, decision.reason)
        return decision

    def owes_resync(self, asker: bytes | None) -> bool:
        """Whether ``asker`` is a learner this owner told to resync since it last fetched from
        it (spent by asking): its fetch must be served, not refused as a repeat or past the
        budget (``protocol.diloco.spread``), or in a round that waits for its contribution it
        would wait for a version that never comes. Granted by our own refusal, never by a claim:
        each costs its sender one whole contribution first, and at most
        ``OWED_SERVES_PER_VERSION`` of one version go to one learner, so a member sending
        cheap (int4) contributions on a wrong base cannot make the owner upload a full
        version for each."""
        held = self.resyncs_owed.get(asker) if asker is not None else None
        if asker is None or held is None or not held[2]:
            return False
        self.resyncs_owed[asker] = (held[0], held[1] + 1, False)
        return True

    def _owe_resync(self, learner: bytes) -> None:
        """Our "resync" refusal owes ``learner`` a serve of our latest version (``owes_resync``)."""
        version, given, _ = self.resyncs_owed.pop(learner, (self.version, 0, False))
        if version != self.version:
            given = 0
        self.resyncs_owed[learner] = (self.version, given, given < OWED_SERVES_PER_VERSION)
        while len(self.resyncs_owed) > RESYNCS_OWED_KEPT:
            self.resyncs_owed.pop(next(iter(self.resyncs_owed)))

    def _out_of_bounds(self, norm: float) -> str | None:
        """Why a contribution of norm ``norm`` is refused outright: over ``OUT_OF_BOUNDS`` times
        the merger's norm reference (its recent senders' merged norms), or with none yet, times
        |Theta|. No honest pseudo-gradient comes near (an honest step is a few percent of
        |Theta|; fp32 values near 3e38 or an int8 scale of 2.6e36 are 1e30 times over), and the
        merge would only clip it: refused here, with a reason, it counts against its sender."""
        reference = self.merger.norm_reference()
        basis, what = (
            (reference, "the recent merged norms' median")
            if reference is not None
            else (self._current_theta_norm(), "|Theta|")
        )
        if basis > 0 and norm > OUT_OF_BOUNDS * basis:
            return (
                f"out of bounds: the contribution's norm {norm:.3g} is over {OUT_OF_BOUNDS:g}x {what} "
                f"({basis:.3g}) of fragment {self.fragment.index}; not merged"
            )
        return None

    def _current_theta_norm(self) -> float:
        """|Theta| of the version held (the norm measured as it was merged, else measured now)."""
        known = self._theta_norm
        if known is not None and known[0]() is self.theta:
            return known[1]
        return norm64(self.theta)

    def _base_mismatch(self, msg: Contribution) -> str | None:
        """Why ``msg`` cannot be applied here: its base state is not the one this owner holds
        under that version (a "resync" reason: the learner then fetches the owners' states)."""
        known = self.digests.get(msg.base_version)
        if known is None:
            if msg.base_version >= self.version - self._keep_digests + 2:
                return (
                    f"resync: base version {msg.base_version} of fragment {self.fragment.index} is not "
                    f"known here (this owner starts at version {min(self.digests, default=self.version)})"
                )
            return (
                None  # older than any kept digest: the merger refuses it as stale, with that reason
            )
        if msg.base_digest not in known:
            return (
                f"resync: base version {msg.base_version} of fragment {self.fragment.index} has state "
                f"{next(iter(known)).hex()[:12]} here, the contribution was measured against "
                f"{msg.base_digest.hex()[:12]}"
            )
        return None

    def _already_merged(self, sender: bytes, msg: Contribution) -> str | None:
        """A learner's pseudo-gradient is cumulative since its base: a second one from the same
        base, after the first was merged (a learner that gave up waiting and sent again), would
        count the first one's steps twice."""
        merged = self._merged_base.get(sender)
        if merged is not None and msg.base_version <= merged:
            return (
                f"resync: a contribution of yours based on version {merged} of fragment "
                f"{self.fragment.index} was merged already; take version {self.version} first"
            )
        return None

    def _decode(
        self, msg: Contribution, given: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, float]:
        """The contribution as one flat fp32 vector (in a reused buffer when one is spare) and
        its norm. Raises ``DecodeError`` for a wrong shape, or NaN/Inf: the norm (fp64-summed,
        finite exactly when every value is) is the check, so the values are read once for it.
        ``given``: our own learner's contribution as the flat vector its ``none`` tensors are
        views of: taken without a copy, and never given back for reuse (it is the learner's)."""
        numel = self.theta.numel()
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
                out = self._spare.pop()
            except IndexError:
                out = new_flat(numel)
            try:
                flat = flat_from_tensors(msg.tensors, self.shapes, out=out, finite_check=False)
            except BaseException:
                self._give_back(out)
                raise
        norm = norm64(flat)
        if not math.isfinite(norm):
            self._give_back(
                flat
            )  # a decoded buffer is kept for the next one, a lent vector dropped
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
        """Mark ``flat`` as not ours to reuse (``_give_back`` drops it instead of keeping it)."""
        key = id(flat)  # a dict by id: a set of tensors would compare them element-wise

        def forget(_ref: weakref.ref[torch.Tensor]) -> None:
            self._borrowed.pop(key, None)

        self._borrowed[key] = weakref.ref(flat, forget)
        return flat

    def _give_back(self, flat: torch.Tensor) -> None:
        """Keep a decoded contribution's buffer for the next one (nothing else refers to it; a
        local contribution's vector is its learner's, and a view of a request body is that
        body's: neither is kept)."""
        borrowed = self._borrowed.pop(id(flat), None)
        if borrowed is not None and borrowed() is flat:
            return
        if len(self._spare) < self._spare_max and flat.numel() == self.theta.numel():
            self._spare.append(flat)
