"""What an owner hands out: each version sealed once, and the state its replicas and
checkpoints take.

``Sealer`` seals for one ``FragmentOwner`` (its key, fragment and codec). A version is sealed with the owner's key as a ``FragmentState`` (and, with updates, a
``FragmentUpdate`` over the version before); the sealed bytes are kept verbatim, so any peer
holding them can re-serve the version. Each version is also known by the digest of its state as
learners decode it, which any owner holding the same content computes alike: contributions name
their base by it, and handoffs and fences compare it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch

from node.diloco.flat import (
    content_hash,
    encode_flat,
    flat_digest,
    flat_from_tensors,
    flat_is_wire_form,
)
from node.diloco.owner_state import OwnerConfig
from node.diloco.replica import Carried, encode_state
from protocol.wire.codec import encode
from protocol.wire.messages import FragmentState, FragmentUpdate, ReplicaState
from protocol.wire.signing import Sealed, Signer, seal
from protocol.wire.tensors import EncodedTensor

__all__ = ["Sealer"]


class Sealer:
    """Seals an owner's versions with its key: full states, updates, and replica states."""

    def __init__(
        self, config: OwnerConfig, signer: Signer, wall_clock: Callable[[], float]
    ) -> None:
        self.swarm, self.fragment, self.shapes = config.swarm, config.fragment.index, config.shapes
        self.download_codec = config.download_codec
        self.signer, self.wall_clock = signer, wall_clock

    def state(
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
            fragment=self.fragment,
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

    def update(
        self, version: int, tensors: Sequence[EncodedTensor], base_digest: bytes, digest: bytes
    ) -> Sealed:
        """Seal ``tensors`` as the update from ``version - 1`` (whose state has ``base_digest``) to
        ``version``, whose state has ``digest``."""
        msg = FragmentUpdate(
            swarm=self.swarm,
            fragment=self.fragment,
            version=version,
            base_version=version - 1,
            base_digest=base_digest,
            state_digest=digest,
            tensors=tuple(tensors),
        )
        return seal(encode(msg), self.signer, now=self.wall_clock(), nonce=os.urandom(16))

    def replica_state(
        self,
        version: int,
        digest: bytes,
        theta: torch.Tensor,
        buffer: torch.Tensor | None,
        merged: Mapping[bytes, int],
        *,
        epoch: int,
        carry: Carried,
        known_finite: bool = False,
        final: bool = False,
    ) -> ReplicaState:
        """The whole state of ``version`` for a replica or successor. ``carry``: the reference and
        standing to hand on; ``known_finite``: ``theta`` and ``buffer`` were checked for NaN/Inf
        when made (a merge's); ``final``: the version was handed out as final."""
        norms, standing = carry
        return encode_state(
            swarm=self.swarm,
            fragment=self.fragment,
            epoch=epoch,
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
