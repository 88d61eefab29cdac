"""A merge's arithmetic: the outer step over a round's work, its check, and the sealed result.

``VersionMaker.make`` runs off the event loop: it clips, aggregates and applies the outer Nesterov
step (``protocol.diloco.outer.merge_update``), with updates encodes the result as an update over
the version held (error feedback), checks the candidate on the swarm's validation set when the
owner validates (``node.diloco.validation``), measures how each sender's work agrees with the
rest of the round's (``protocol.diloco.agreement``: for standing; its Gram matrix summed in the
outer step's pass over the contributions, which reads each a slice at a time: a compressed one
is decoded slice by slice, once), and seals it, with the whole state for a replica.
A failure raises ``MergeFailed`` naming the senders to drop: every one of a non-finite result's
(each was checked for shape, finiteness and a finite norm on arrival, so no single one is to
blame), or those validation blamed (``Rejected``).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import torch

from node.diloco.eventlog import LoggedMerger
from node.diloco.owner_state import OwnerConfig, OwnerCounts, OwnerState
from node.diloco.replica import Carried
from node.diloco.sealing import Sealer
from node.diloco.validation import OwnerValidation
from protocol.diloco.agreement import Agreement, AgreementConfig, GramSum, agreement, judged
from protocol.diloco.merge import Decision
from protocol.diloco.norms import all_finite, norm64
from protocol.diloco.outer import MergeUpdate, merge_update
from protocol.diloco.sliced import Delta, numel_of
from protocol.diloco.updates import encode_update
from protocol.wire.messages import ReplicaState
from protocol.wire.signing import Sealed

__all__ = ["Fenced", "MergeFailed", "NextVersion", "Rejected", "VersionMaker", "Work"]


class MergeFailed(Exception):
    """A merge could not produce a finite global fragment; ``culprits`` are the peers to drop."""

    def __init__(self, reason: str, culprits: frozenset[bytes]) -> None:
        super().__init__(reason)
        self.reason, self.culprits = reason, culprits


class Rejected(MergeFailed):
    """Validation kept the candidate from being published: ``culprits`` hurt the loss alone (or,
    when none did, are the whole round); ``helped`` lowered it alone."""

    def __init__(
        self,
        reason: str,
        culprits: frozenset[bytes],
        helped: frozenset[bytes],
        whole: bool,
        severity: Mapping[bytes, float] | None = None,
    ) -> None:
        super().__init__(reason, culprits)
        self.helped, self.whole = helped, whole
        self.severity = dict(severity or {})  # per culprit: its harm in noise margins


class Fenced(MergeFailed):
    """A replica refused this owner's next version: another owner has taken over."""


@dataclass(frozen=True, slots=True, eq=False)
class Work:
    """A round's contributions as the merger decided them, in entry order."""

    peers: list[bytes]
    deltas: list[Delta]  # flat fp32 vectors, or contributions kept compressed
    weights: list[float]
    clips: list[float]
    norms: list[float | None]  # measured on arrival: the merge reuses them
    scale: float
    aggregate: str | None

    @classmethod
    def of(cls, decision: Decision, aggregate: str) -> Work:
        entries = decision.entries
        return cls(
            peers=[e.peer for e in entries],
            deltas=[cast(Delta, e.payload) for e in entries],  # set by the intake
            weights=[e.weight for e in entries],
            clips=[e.clip for e in entries],
            norms=[e.norm for e in entries],
            scale=decision.scale,
            aggregate=decision.aggregate(aggregate),
        )

    def only(self, peer: bytes) -> Work:
        """The work of ``peer`` alone."""
        mine = [i for i, p in enumerate(self.peers) if p == peer]
        return Work(
            peers=[peer] * len(mine),
            deltas=[self.deltas[i] for i in mine],
            weights=[self.weights[i] for i in mine],
            clips=[self.clips[i] for i in mine],
            norms=[self.norms[i] for i in mine],
            scale=self.scale,
            aggregate=self.aggregate,
        )


@dataclass(frozen=True, slots=True)
class NextVersion:
    """A merge's next version, computed off the event loop."""

    theta: torch.Tensor
    buffer: torch.Tensor | None
    latest: Sealed  # the full state, sealed
    digest: bytes  # of the flat state
    message_digest: bytes  # of the sealed full state's message
    state: ReplicaState | None  # the whole state for the replica
    update: Sealed | None = None  # with updates: the sealed update over the version before
    residual: torch.Tensor | None = None  # and the error feedback it leaves
    state_update: ReplicaState | None = None  # ``state`` as that update (no momentum only)
    theta_digest: bytes | None = None  # BLAKE3 of ``state``'s blobs (fp32, no momentum), if known
    helped: frozenset[bytes] = frozenset()  # validation scored their work alone: it helped
    dissent: frozenset[bytes] = frozenset()  # their work agreed with none of the round's


class VersionMaker:
    """Makes an owner's next versions from ``state``: the outer step, the check, the seal."""

    def __init__(
        self,
        config: OwnerConfig,
        state: OwnerState,
        sealer: Sealer,
        validation: OwnerValidation | None,
        log: LoggedMerger | None,
        counts: OwnerCounts,
        agreeing: AgreementConfig = AgreementConfig(),
    ) -> None:
        self.config, self.state, self.sealer = config, state, sealer
        self.validation, self.log, self.counts = validation, log, counts
        self.agreeing = agreeing
        self.step_bounds = 0  # merges whose aggregate was scaled down to max_delta_ratio * |Theta|

    def make(
        self,
        version: int,
        work: Work,
        merged: Mapping[bytes, int],
        carry: Carried,
        *,
        for_replica: bool,
    ) -> NextVersion:
        """The merge's new state, sealed as ``version``, the state to hand to a replica (when
        ``for_replica``), and with updates the sealed update from ``version - 1`` and the new
        error-feedback residual. Raises ``MergeFailed``."""
        config, state = self.config, self.state
        # the agreement's Gram matrix is summed in the outer step's pass over the work, which
        # decodes each compressed contribution's slices once for both
        products = (
            GramSum([numel_of(d) for d in work.deltas], norms=work.norms)
            if judged(work.peers, self.agreeing)
            else None
        )
        theta, buffer = self._outer(work, products)
        tensors, residual = None, None
        if config.update_codec is not None:  # publish what learners compute from the update
            # the outer step's result is needed no more: the update is computed in its place,
            # and what it held is no longer the published state whose norm ``_outer`` noted
            state.known_norm = None
            tensors, theta, residual = encode_update(
                theta,
                state.theta,
                state.residual,
                config.shapes,
                config.update_codec,
                block_size=config.block_size,
                consume_target=True,
            )
        helped: frozenset[bytes] = frozenset()
        if self.validation is not None:  # before anything is sealed: a rejected one leaves no trace
            helped = self._validate(version, theta, work)
        dissent = self._agreement(version, work, products).dissent
        checked = tensors is None  # _outer checked theta and buffer; an update's is checked here
        latest, digest, message_digest = self.sealer.state(version, theta, known_finite=checked)
        replica = (
            self.sealer.replica_state(
                version,
                digest,
                theta,
                buffer,
                merged,
                epoch=state.epoch,
                carry=carry,
                known_finite=checked,
            )
            if for_replica
            else None
        )
        # an fp32 version's state digest is its bytes' BLAKE3, the handoff's blobs with no momentum
        theta_digest = digest if config.download_codec == "none" and buffer is None else None
        if tensors is None:
            return NextVersion(
                theta,
                buffer,
                latest,
                digest,
                message_digest,
                replica,
                theta_digest=theta_digest,
                helped=helped,
                dissent=dissent,
            )
        base_digest = state.digest_of(version - 1)
        update = self.sealer.update(version, tensors, base_digest, digest)
        state_update = (
            dataclasses.replace(
                replica,
                theta=tuple(tensors),
                momentum=(),
                base_version=version - 1,
                base_digest=base_digest,
            )
            if replica is not None and buffer is None
            else None
        )
        return NextVersion(
            theta,
            buffer,
            latest,
            digest,
            message_digest,
            replica,
            update,
            residual,
            state_update,
            theta_digest,
            helped,
            dissent,
        )

    def _step(
        self, work: Work, *, theta_norm: float | None = None, products: GramSum | None = None
    ) -> MergeUpdate:
        """The outer step over ``work`` from the state held (summing ``products`` on the way)."""
        return merge_update(
            self.state.theta,
            self.state.buffer,
            work.deltas,
            work.weights,
            work.clips,
            self.config.outer,
            embedding=self.config.fragment.is_embedding,
            scale=work.scale,
            norms=work.norms,
            aggregate=work.aggregate,
            theta_norm=theta_norm,
            observe=None if products is None else products.add,
        )

    def _outer(
        self, work: Work, products: GramSum | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Clip, aggregate, scale, bound and apply the outer step. Raises ``MergeFailed`` naming
        the peers to drop. (Every payload's shape, finiteness and norm were checked on arrival.)"""
        known = self.state.known_norm
        update = self._step(
            work,
            theta_norm=known[1] if known is not None and known[0]() is self.state.theta else None,
            products=products,
        )
        self.step_bounds += int(update.bounded)
        theta, buffer = update.theta, update.buffer
        theta_norm = norm64(theta)  # finite exactly when every value is; the next bound needs it
        if not (math.isfinite(theta_norm) and (buffer is None or all_finite(buffer))):
            raise MergeFailed(
                f"the outer step over {len(work.peers)} contributions is not finite; "
                "no single one is to blame, all are dropped",
                frozenset(work.peers),
            )
        self.state.known_norm = (weakref.ref(theta), theta_norm)  # once ``theta`` is published
        return theta, buffer

    def _agreement(self, version: int, work: Work, products: GramSum | None) -> Agreement:
        """Who of ``work``'s senders dissents from the round (``protocol.diloco.agreement``), logged
        for replay. The work to be published as ``version``, after validation let it through;
        ``products``: its Gram matrix, summed by the outer step."""
        verdict = agreement(
            work.peers,
            work.deltas,
            self.agreeing,
            norms=work.norms,
            products=None if products is None else products.matrix(),
        )
        if self.log is not None:
            self.log.note_agreement(version, verdict, self.agreeing)
        return verdict

    def _validate(self, version: int, theta: torch.Tensor, work: Work) -> frozenset[bytes]:
        """Check the candidate ``theta`` (``node.diloco.validation``); log the check. Returns the
        senders whose work, scored alone, lowered the loss; raises ``Rejected`` when it is not to
        be published."""
        assert self.validation is not None

        def alone() -> Mapping[
            bytes, torch.Tensor
        ]:  # per sender, the outer step over its work only
            return _Alone(work, lambda only: self._step(only).theta)

        fragment = self.config.fragment.index
        check = self.validation.check(fragment, version, self.state.theta, theta, alone)
        if check is None:
            return frozenset()
        self.counts.checks += 1
        self.counts.rejected += int(not check.verdict.publish)
        self.counts.check_seconds += check.seconds
        if self.log is not None:
            self.log.note_validation(check.record)
        verdict = check.verdict
        if not verdict.publish:
            raise Rejected(
                verdict.reason,
                verdict.drop,
                verdict.helped,
                whole=verdict.whole,
                severity=verdict.severity,
            )
        return verdict.helped


class _Alone(Mapping[bytes, torch.Tensor]):
    """Per sender of ``work``, the outer step over its work only, computed when read: validation
    scores them one after another, so one fragment-sized result is held at a time, not one per
    sender."""

    def __init__(self, work: Work, step: Callable[[Work], torch.Tensor]) -> None:
        self.work, self.step = work, step
        self.senders = list(dict.fromkeys(work.peers))

    def __getitem__(self, peer: bytes) -> torch.Tensor:
        if peer not in self.senders:
            raise KeyError(peer)
        return self.step(self.work.only(peer))

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.senders)

    def __len__(self) -> int:
        return len(self.senders)
