"""Owner replicas on the wire: the states a peer holds for fragments it may have to take over,
and handing an owner's state to a replica or successor (``protocol.diloco.replica`` decides).

A primary calls ``hand_over`` with its next version's whole state before publishing it; the
replica's ``ReplicaStore.offer`` takes it or refuses it ("fenced: ..."), and the primary
publishes only once a replica took it. The store keeps one state per fragment (the newest taken),
decoded to fp32, so a takeover starts from exactly the global fragment, momentum, version and
digest the failed primary had handed over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from node.diloco.flat import (
    flat_digest,
    flat_from_tensors,
    flat_is_wire_form,
    new_flat,
    view_in_request_body,
)
from node.wire.transport import Transport
from protocol.diloco.compression import compress
from protocol.diloco.norms import all_finite
from protocol.diloco.reference import HandedNorm, as_history, on_the_wire
from protocol.diloco.replica import Held, judge
from protocol.diloco.updates import apply_update
from protocol.errors import DecodeError, RemoteProtocolError
from protocol.wire.codec import encode
from protocol.wire.messages import MAX_NORM_HISTORY, MAX_STANDING, ReplicaAck, ReplicaState
from protocol.wire.signing import ReplayWindow, Signer, open_sealed, seal

__all__ = [
    "NOT_A_MEMBER",
    "BaseNotHeld",
    "Carried",
    "Handed",
    "NotAMemberThere",
    "ReplicaStore",
    "encode_state",
    "hand_over",
    "handed_from",
]

log = logging.getLogger(__name__)

MAX_MERGED = 4096  # senders whose merged work a handoff names (the most recent ones)
NOT_A_MEMBER = (
    "not a member here"  # how a replica's signed refusal of a non-member (or non-owner) starts
)


# what an owner's state carries besides its tensors: the merger's reference (recent accepted
# norms) and the standing per sender key (peer ids, scores), so a successor starts with both
Carried = tuple[tuple[HandedNorm, ...], tuple[tuple[bytes, ...], tuple[float, ...]]]


@dataclass(frozen=True, slots=True)
class Handed:
    """A fragment's owner state as handed over (fp32, on CPU)."""

    fragment: int
    epoch: int
    version: int
    digest: bytes
    theta: torch.Tensor
    momentum: torch.Tensor | None
    sender: bytes
    merged: dict[bytes, int]  # sender -> newest base version of its work merged into this state
    hashed: bool = (
        False  # ``theta`` is known to hash to ``digest`` (its learner need not hash it again)
    )
    final: bool = (
        False  # the sender handed ``version`` out as final: a successor holds it final too
    )
    # the merger's reference (recent accepted norms, each with its sender or None), oldest first;
    # bare norms (an older peer's, a test's) are anonymous
    norms: tuple[HandedNorm | float, ...] = ()
    standing: tuple[tuple[bytes, ...], tuple[float, ...]] = (
        (),
        (),
    )  # peer ids, scores (``Standing.export``)


def handed_from(
    sender: bytes,
    msg: ReplicaState,
    theta: torch.Tensor,
    momentum: torch.Tensor | None,
    *,
    hashed: bool = False,
) -> Handed:
    """``msg`` from ``sender`` as a ``Handed``, with its tensors as ``ReplicaStore.decode`` gave them."""
    return Handed(
        msg.fragment,
        msg.epoch,
        msg.version,
        msg.digest,
        theta,
        momentum,
        sender,
        dict(zip(msg.merged_peers, msg.merged_bases, strict=True)),
        hashed,
        msg.final,
        msg.handed_norms,  # an older sender's norms are all anonymous
        (msg.standing_peers, msg.standing_scores),
    )


def encode_state(
    *,
    swarm: str,
    fragment: int,
    epoch: int,
    version: int,
    digest: bytes,
    theta: torch.Tensor,
    momentum: torch.Tensor | None,
    merged: Mapping[bytes, int] | None = None,
    known_finite: bool = False,
    final: bool = False,
    norms: Sequence[HandedNorm | float] = (),
    standing: tuple[tuple[bytes, ...], tuple[float, ...]] = ((), ()),
) -> ReplicaState:
    """An owner's state as a ``ReplicaState`` (fp32, uncompressed: a replica must hold it exactly).
    ``merged``: sender -> newest base version of its merged work (the newest ``MAX_MERGED`` kept).
    The tensors are views of ``theta`` and ``momentum`` (an owner never writes to a state it
    has published or handed over: each version is a new tensor). ``known_finite``: the caller checked
    both when it made them (``compress``'s NaN/Inf pass is skipped). ``final``: see ``ReplicaState``;
    ``norms``, ``standing``: the merger's reference and the owner's standing per key (the newest
    ``MAX_NORM_HISTORY`` norms and the most recently seen ``MAX_STANDING`` keys are sent)."""
    t, _ = compress(
        theta.detach().float().contiguous(), "none", copy=False, known_finite=known_finite
    )
    m = (
        (
            compress(
                momentum.detach().float().contiguous(),
                "none",
                copy=False,
                known_finite=known_finite,
            )[0],
        )
        if momentum is not None
        else ()
    )
    recent = sorted((merged or {}).items(), key=lambda kv: kv[1], reverse=True)[:MAX_MERGED]
    norm_history, norm_senders = on_the_wire(as_history(norms)[-MAX_NORM_HISTORY:])
    return ReplicaState(
        swarm=swarm,
        fragment=fragment,
        epoch=epoch,
        version=version,
        digest=digest,
        theta=(t,),
        momentum=m,
        merged_peers=tuple(k for k, _ in recent),
        merged_bases=tuple(min(v, version) for _, v in recent),
        final=final,
        norm_history=norm_history,
        norm_senders=norm_senders,
        standing_peers=standing[0][-MAX_STANDING:],
        standing_scores=standing[1][-MAX_STANDING:],
    )


def _state_in_body(
    msg: ReplicaState, numel: int
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A whole fp32 handoff's global fragment (and momentum) as views of the request body it
    arrived in (``REQUEST_BODY``), checked finite, which then holds that buffer until the views
    are collected (``RequestBody.keep_for``); None when its tensors are not fp32 ``none``
    tensors lying end to end in this request's body (``decode`` copies them). A held state is
    never written to (a takeover clones it, a new handoff replaces it), so adopting the bytes
    where they arrived saves a copy of the fragment into fresh memory at every handoff (at
    124M parameters 7-10 % of a replica's busy time in a round, docs/benchmarks.md). Raises
    ``DecodeError`` for NaN or Inf values, as ``flat_from_tensors`` does."""
    parts = (*msg.theta, *msg.momentum)
    if len(msg.theta) != 1:
        return None
    flat = view_in_request_body(parts, [(numel,)] * len(parts))
    if flat is None:
        return None
    if not all_finite(flat):
        raise DecodeError("the handed state holds NaN or Inf values")
    return flat[:numel], (flat[numel:] if msg.momentum else None)


class NotAMemberThere(RemoteProtocolError):
    """A replica refused a handoff (a signed ``ReplicaAck`` starting ``NOT_A_MEMBER``; an unsigned
    403 is not trusted) because its view of the members does not hold ours: it
    routes around us, and another owner may be publishing this fragment's versions."""


class BaseNotHeld(DecodeError):
    """An update handoff over a state this peer holds neither as a replica nor as a learner:
    answered with a plain refusal, upon which the owner sends the whole state."""


class ReplicaStore:
    """The newest handed-over state per fragment, and the fence: the highest epoch seen."""

    def __init__(self, swarm: str, numels: Sequence[int]) -> None:
        self.swarm, self.numels = swarm, list(numels)
        self.states: dict[int, Handed] = {}
        self.held: dict[int, Held] = {}
        self.taken = 0
        self.refused = 0
        self.refusals: Counter[str] = Counter()  # handoffs refused (or claims ignored), by reason
        self.took_from: dict[
            int, bytes
        ] = {}  # the owner this peer's last pass saw before it owned p

    def decode(
        self,
        msg: ReplicaState,
        learned: tuple[int, bytes, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A handoff's global fragment and momentum as fp32 vectors (touches no state here: it
        may run in a worker thread). An update applies over the state handed here before, or
        over ``learned``: ``(version, digest, flat)`` this peer's learner holds (every learner
        holds the version an owner published last, so a replica needs no whole state to start
        from). Raises ``DecodeError`` for a malformed one, and for an update over a state held
        in neither (the owner then sends the whole state)."""
        self._check_fragment(msg)
        if msg.base_version == msg.version:
            return self._held_base(msg, learned), None
        if msg.base_version >= 0:
            return self._apply_update(msg, learned), None
        shape = [(self.numels[msg.fragment],)]
        viewed = _state_in_body(msg, shape[0][0])
        if viewed is not None:
            return viewed
        theta = flat_from_tensors(msg.theta, shape)
        return theta, (flat_from_tensors(msg.momentum, shape) if msg.momentum else None)

    def _held_base(
        self, msg: ReplicaState, learned: tuple[int, bytes, torch.Tensor] | None
    ) -> torch.Tensor:
        """The state of ``base_version`` with ``base_digest`` as this peer holds it, handed to it
        before (as a replica) or as its learner holds it (never written to); else ``BaseNotHeld``."""
        held = self.states.get(msg.fragment)
        if held is not None and (held.version, held.digest) == (msg.base_version, msg.base_digest):
            return held.theta
        if learned is not None and learned[:2] == (msg.base_version, msg.base_digest):
            return learned[2]
        what = "a handoff by reference to" if msg.base_version == msg.version else "an update over"
        raise BaseNotHeld(
            f"{what} version {msg.base_version} of fragment {msg.fragment}, but this peer holds "
            f"{'no state' if held is None else f'version {held.version}'} of it with that digest: "
            "hand over the whole state"
        )

    def _apply_update(
        self, msg: ReplicaState, learned: tuple[int, bytes, torch.Tensor] | None
    ) -> torch.Tensor:
        """The state an update handoff gives over the one held: it must hash to its digest."""
        base = self._held_base(msg, learned)
        shapes = [tuple(t.shape) for t in msg.theta]
        if sum(int(torch.Size(s).numel()) for s in shapes) != self.numels[msg.fragment]:
            raise DecodeError(
                f"the update's tensors do not add up to fragment {msg.fragment}'s "
                f"{self.numels[msg.fragment]} values"
            )
        theta = apply_update(base, msg.theta, shapes, out=new_flat(base.numel()))
        if flat_digest(theta) != msg.digest:
            raise DecodeError(
                f"fragment {msg.fragment}: the update over version {msg.base_version} does not "
                f"hash to version {msg.version}'s digest"
            )
        return theta

    def _check_fragment(self, msg: ReplicaState) -> None:
        if msg.swarm != self.swarm or not 0 <= msg.fragment < len(self.numels):
            raise DecodeError(
                f"handoff for swarm {msg.swarm!r} fragment {msg.fragment}: not a fragment of this swarm"
            )

    def hashes_to_digest(self, msg: ReplicaState, blobs_digest: bytes | None) -> bool:
        """Whether ``msg``'s state, as ``decode`` gives it, is known to hash to ``msg.digest``
        without hashing it here: a whole fp32 state without momentum whose verified body's blobs
        digest (``Opened.blobs_digest``) is that digest, an update (``decode`` checks its result's
        hash) or a reference to a state held here that was known so."""
        if msg.base_version == msg.version:
            held = self.states.get(msg.fragment)
            return (
                held is not None
                and held.hashed
                and (held.version, held.digest) == (msg.base_version, msg.base_digest)
            )
        if msg.base_version >= 0:
            return True
        return (
            not msg.momentum
            and flat_is_wire_form(msg.theta)
            and all(t.dtype == "float32" for t in msg.theta)
            and blobs_digest == msg.digest
        )

    def offer(
        self,
        sender: bytes,
        msg: ReplicaState,
        *,
        successor: bool = False,
        decoded: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        hashed: bool = False,
    ) -> ReplicaAck:
        """Judge and (if taken) keep one handoff (``successor``: see ``judge``); ``decoded``: its
        tensors from ``decode`` when the caller decoded them already (off its event loop);
        ``hashed``: what ``hashes_to_digest`` said of it. Raises ``DecodeError`` for a malformed one."""
        p = msg.fragment
        self._check_fragment(msg)
        verdict = judge(
            self.held.get(p),
            epoch=msg.epoch,
            version=msg.version,
            digest=msg.digest,
            fragment=p,
            successor=successor,
        )
        held = self.held.get(p)
        if not verdict.accepted:
            self.refused += 1
            self.refusals["fenced" if verdict.reason.startswith("fenced") else "refused"] += 1
            return ReplicaAck(
                accepted=False,
                reason=verdict.reason,
                epoch=held.epoch if held else -1,
                version=held.version if held else -1,
            )
        theta, momentum = decoded if decoded is not None else self.decode(msg)
        self.states[p] = handed_from(sender, msg, theta, momentum, hashed=hashed)
        held = self.held.get(p)
        self.held[p] = Held(max(msg.epoch, held.epoch if held else 0), msg.version, msg.digest)
        self.taken += 1
        return ReplicaAck(
            accepted=True, reason=verdict.reason, epoch=msg.epoch, version=msg.version
        )

    def version_from(self, p: int, sender: bytes) -> Handed | None:
        """Fragment ``p``'s state as ``sender`` handed it here, else None: this peer's learner
        takes it instead of downloading the version again. The state is never written to (a
        takeover clones it, a new handoff replaces it). None too when the store has been fenced
        past it (this peer owned ``p`` since, or took a later epoch's handoff of it): ``sender``
        handed it in an earlier tenure, so it is not ``sender``'s latest, and a learner resyncing
        to it would go back to a version its owner no longer knows."""
        held = self.states.get(p)
        if held is None or held.sender != sender:
            return None
        fence = self.held.get(p)
        if fence is not None and (fence.epoch, fence.version) > (held.epoch, held.version):
            return None
        return held

    def restore(self, state: Handed) -> None:
        """Hold ``state`` as if it had been handed over (an owner checkpoint read at start)."""
        held = self.held.get(state.fragment)
        if held is None or state.version > held.version:
            self.states[state.fragment] = state
            self.held[state.fragment] = Held(state.epoch, state.version, state.digest)

    def fence(self, p: int, epoch: int, version: int, digest: bytes) -> None:
        """This peer now owns ``p`` at ``epoch``: refuse handoffs from older epochs."""
        held = self.held.get(p)
        if held is None or (epoch, version) >= (held.epoch, held.version):
            self.held[p] = Held(epoch, version, digest)

    def status(self) -> dict[str, object]:
        return {
            "held": {
                str(p): {"epoch": h.epoch, "version": h.version} for p, h in self.held.items()
            },
            "taken": self.taken,
            "refused": self.refused,
            "handoff_refusals": dict(self.refusals),
        }


async def hand_over(
    transport: Transport,
    signer: Signer,
    target: tuple[bytes, str],
    msg: ReplicaState,
    replay: ReplayWindow,
    timeout_s: float = 30.0,
    *,
    blobs_digest: bytes | None = None,
) -> ReplicaAck:
    """Send ``msg`` to ``target`` (peer id, URL) and return its signed answer. ``blobs_digest``:
    the BLAKE3 of ``msg``'s tensor bytes end to end when the caller knows it (see ``seal``).

    Raises ``NotAMemberThere`` when the target's signed answer says we are not a member in its view,
    ``RemoteProtocolError`` for a refusal by status (unsigned: anyone on the path can forge it, so it
    fences nothing; the caller routes around it) or an answer not signed by the target, and the
    transport's errors when it cannot be reached."""
    peer_id, url = target
    # hashing a whole fragment takes tens of ms: off the event loop
    sealed = await asyncio.to_thread(
        seal,
        encode(msg),
        signer,
        now=time.time(),
        nonce=os.urandom(16),
        recipient=peer_id,
        blobs_digest=blobs_digest,
    )
    async with transport.reply(
        "POST",
        f"{url}/v1/rpc",
        chunks=sealed.iter_chunks(),
        size=sealed.size,
        timeout_s=timeout_s,
        max_reply=1 << 16,
        kind=type(msg).__name__,
    ) as r:
        if r.status != 200:
            raise RemoteProtocolError(
                f"handoff refused unsigned ({r.status}): {bytes(r.body[:300])!r}",
                penalty=0.0,
            )
        opened = open_sealed(
            r.body,
            now=time.time(),
            replay=replay,
            max_size=1 << 16,
            expected_recipient=signer.peer_id,
        )
    if opened.peer_id != peer_id or not isinstance(opened.message, ReplicaAck):
        raise RemoteProtocolError(
            f"handoff answered by {opened.peer_id.hex()[:8]} with "
            f"{type(opened.message).__name__}, not by the replica",
            penalty=0.0,
        )
    if not opened.message.accepted and opened.message.reason.startswith(NOT_A_MEMBER):
        raise NotAMemberThere(opened.message.reason, penalty=0.0)
    return opened.message
