"""The learner network side's settings (``LearnerNetConfig``) and counters (``LearnerStats``),
shared by ``IslandNet``, its contribution sender and its version fetcher."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from node.diloco.island import Outgoing
from protocol.diloco.versions import MAX_ROUNDS_PER_S

__all__ = ["LearnerNetConfig", "LearnerStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnerNetConfig:
    """How a learner talks to the swarm: what it sends, what it accepts."""

    swarm: str
    shapes: Sequence[Sequence[tuple[int, ...]]]  # per fragment, its tensors' shapes
    codec: str = "int8"  # contributions' compression
    block_size: int = 64  # the codec's block size
    max_message: int = 256 << 20  # the largest version reply taken
    # the version fence: the swarm's creation time (from its manifest; None: unknown) and the
    # top merge rate, above which a version cannot be an honest owner's
    created: float | None = None
    max_rounds_per_s: float = MAX_ROUNDS_PER_S
    # rewrites our own contributions before they are sealed: attack measurements only
    tamper: Callable[[Outgoing], Outgoing] | None = None


@dataclass
class LearnerStats:
    contributions_sent: int = 0
    contributions_accepted: int = 0
    contributions_refused: int = 0
    send_failures: int = 0
    versions_received: int = 0
    bad_versions: int = 0
    base_mismatches: int = 0  # contributions refused because their base state was not the owner's
    version_jumps: int = 0  # versions above what an owner can have reached (refused)
    updates_applied: int = 0  # versions taken as an update over the one held (not a full download)
    update_mismatches: int = 0  # updates that did not apply to our state (or hashed otherwise)
    finals_held: int = 0  # final versions the owner said we held already (nothing downloaded)
    versions_local: int = 0  # versions of fragments we own, taken from our owner in process
    versions_replica: int = 0  # versions our replica store took from their owner (not downloaded)
    skipped_nonfinite: int = 0
    resyncs: int = 0
    resent_on_owner_change: int = 0  # accepted, then its owner was gone before merging it: resent
    polls_reaimed: int = 0  # long-polls cancelled because our view named a new owner meanwhile
    resent_after_silence: int = 0  # synchronous: accepted, no version RESEND_AFTER_S later: resent
    declined: int = 0  # accepted, then its owner's validation declined the candidate holding it
