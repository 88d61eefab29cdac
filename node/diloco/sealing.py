"""What an owner hands out: each version sealed once, and the state its replicas and
checkpoints take.

``VersionSealing`` is mixed into ``FragmentOwner`` (which provides the attributes below). A
version is sealed with the owner's key as a ``FragmentState`` (and, with updates, a
``FragmentUpdate`` over the version before); the sealed bytes are kept verbatim, so any peer
holding them can re-serve the version. Each version is also known by the digest of its state as
learners decode it, which any owner holding the same content computes alike: contributions name
their base by it, and handoffs and fences compare it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from node.diloco.eventlog import LoggedMerger
from node.diloco.flat import (
    content_hash,
    encode_flat,
    flat_digest,
    flat_from_tensors,
    flat_is_wire_form,
)
from node.diloco.replica import Carried, Handed, encode_state
from protocol.diloco.fragments import Fragment
from protocol.wire.codec import encode
from protocol.wire.messages import FragmentState, FragmentUpdate, ReplicaState
from protocol.wire.signing import Sealed, Signer, seal
from protocol.wire.tensors import EncodedTensor

__all__ = ["VersionSealing"]


class VersionSealing:
    """The version-sealing side of ``FragmentOwner``."""

    swarm: str
    fragment: Fragment
    shapes: list[tuple[int, ...]]
    signer: Signer
    wall_clock: Callable[[], float]
    download_codec: str
    epoch: int
    version: int
    theta: torch.Tensor
    buffer: torch.Tensor | None
    latest: Sealed
    update: Sealed | None
    digests: dict[int, set[bytes]]
    log: LoggedMerger | None
    _state_digest: dict[int, bytes]
    _keep_digests: int
    _merged_base: dict[bytes, int]

    if TYPE_CHECKING:  # OwnerSuccession's

        def holds_final(self) -> bool: ...

        def _carried(self, version: int) -> Carried:  # FragmentOwner's
            ...

    def _remember_digests(self, version: int, state_digest: bytes, *others: bytes) -> None:
        """Know ``version`` by the digest of its state as learners decode it and by ``others``."""
        self.digests.setdefault(version, set()).update((state_digest, *others))
        self._state_digest[version] = state_digest
        if self.log is not None:
            self.log.note_version(version, state_digest)
        for old in [v for v in self.digests if v <= version - self._keep_digests]:
            del self.digests[old]
            self._state_digest.pop(old, None)

    def digest_of(self, version: int) -> bytes:
        """The digest of ``version``'s state as learners decode it: what another owner holding
        the same content computes (not the sealed message's, which differs per seal)."""
        return self._state_digest[version]

    def sealed_after(self, after: int, *, update_ok: bool, full_every: int = 0) -> Sealed:
        """What a learner holding version ``after`` should fetch of the latest version: the update
        over ``after`` when it asked for one and it exists (and the version is not one of every
        ``full_every`` that go out full), else the full state."""
        if (
            update_ok
            and self.update is not None
            and after == self.version - 1
            and not (full_every > 0 and self.version % full_every == 0)
        ):
            return self.update
        return self.latest

    def _seal_update(self, version: int, tensors: Sequence[EncodedTensor], digest: bytes) -> Sealed:
        """Seal ``tensors`` as the update from ``version - 1`` to ``version``, whose state has ``digest``."""
        msg = FragmentUpdate(
            swarm=self.swarm,
            fragment=self.fragment.index,
            version=version,
            base_version=version - 1,
            base_digest=self.digest_of(version - 1),
            state_digest=digest,
            tensors=tuple(tensors),
        )
        return seal(encode(msg), self.signer, now=self.wall_clock(), nonce=os.urandom(16))

    def _replica_state(
        self,
        version: int,
        digest: bytes,
        theta: torch.Tensor,
        buffer: torch.Tensor | None,
        merged: Mapping[bytes, int],
        *,
        known_finite: bool = False,
        final: bool = False,
        carry: Carried | None = None,
    ) -> ReplicaState:
        """``known_finite``: ``theta`` and ``buffer`` were checked for NaN/Inf when made (a merge's);
        ``final``: the version was handed out as final (``ReplicaState.final``); ``carry``: the
        reference and standing to hand on, taken on the event loop (``_carried``; taken here when
        None, so call it from the event loop then)."""
        norms, standing = carry if carry is not None else self._carried(version)
        return encode_state(
            swarm=self.swarm,
            fragment=self.fragment.index,
            epoch=self.epoch,
            version=version,
            digest=digest,
            theta=theta,
            momentum=buffer,
            merged=merged,
            known_finite=known_finite,
            final=final,
            norms=norms,
            standing=standing,
        )

    def snapshot(self) -> ReplicaState:
        """The whole state at the latest version (handed to the successor when retiring), marked
        final while this owner holds that version final (``holds_final``)."""
        digest = self.digest_of(self.version)
        return self._replica_state(
            self.version,
            digest,
            self.theta,
            self.buffer,
            dict(self._merged_base),
            final=self.holds_final(),
        )

    def state(self) -> Handed:
        """The whole state at the latest version, as held (for an owner checkpoint)."""
        norms, standing = self._carried(self.version)
        return Handed(
            self.fragment.index,
            self.epoch,
            self.version,
            self.digest_of(self.version),
            self.theta,
            self.buffer,
            self.signer.peer_id,
            dict(self._merged_base),
            norms=norms,
            standing=standing,
        )

    def _seal_state(
        self, version: int, theta: torch.Tensor, *, known_finite: bool = False
    ) -> tuple[Sealed, bytes, bytes]:
        """Seal ``theta`` as ``version`` (its tensors are views of ``theta``, which is never
        written to). Returns the sealed state and the two digests a learner may name it by: of
        the flat state as decoded (``flat_digest``; for ``none`` it is the content hash) and of
        the sealed message (a learner that took this version from the wire has verified that
        digest already; the same state always encodes to the same message bytes). ``known_finite``:
        ``theta`` was checked for NaN/Inf when it was made (a merge's result), not read again."""
        tensors = encode_flat(
            theta, self.shapes, self.download_codec, copy=False, known_finite=known_finite
        )
        chash = content_hash(tensors)
        state = FragmentState(
            swarm=self.swarm,
            fragment=self.fragment.index,
            version=version,
            tensors=tuple(tensors),
            content_hash=chash,
        )
        sealed = seal(
            encode(state),
            self.signer,
            now=self.wall_clock(),
            nonce=os.urandom(16),
            blobs_digest=chash,
        )  # the tensors are the message's blobs: hashed once
        digest = (
            chash
            if flat_is_wire_form(tensors)
            else flat_digest(flat_from_tensors(tensors, self.shapes))
        )
        return sealed, digest, sealed.digest
