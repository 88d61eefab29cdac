"""An owner's settings, what it starts from, and the one mutable state its parts share.

``OwnerConfig`` holds the scalar settings of one ``FragmentOwner``; ``OwnerStart`` the state it
starts its term from (a fresh fragment, or a predecessor's, handed over); ``OwnerState`` the
global fragment at its latest version and everything that names it (sealed forms, digests, the
senders whose work it holds). The intake reads it, merges and takeovers write it, the owner alone
holds it.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from node.diloco.eventlog import LoggedMerger
from protocol.diloco.fragments import Fragment
from protocol.diloco.merge import MergeConfig
from protocol.diloco.norms import norm64
from protocol.diloco.outer import OuterConfig
from protocol.diloco.reference import HandedNorm
from protocol.wire.signing import Sealed

__all__ = ["MERGED_BASES_KEPT", "OwnerConfig", "OwnerCounts", "OwnerStart", "OwnerState"]

MERGED_BASES_KEPT = 100_000  # senders whose newest merged base is remembered


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerConfig:
    """One owner's settings. ``update_codec``: also publish each version as an update over the
    one before, compressed with it (``protocol.diloco.updates``; the full versions are then fp32,
    ``download_codec`` none); ``round_steps``: the inner steps a learner may train between two
    contributions to a fragment (2H), which tells how long one at work may stay silent
    (``protocol.diloco.activity``); ``event_log``: log every merger call and decision there for
    ``atoll replay``."""

    swarm: str
    fragment: Fragment
    shapes: tuple[tuple[int, ...], ...]
    merge: MergeConfig
    outer: OuterConfig
    download_codec: str = "none"
    update_codec: str | None = None
    block_size: int = 64
    round_steps: int = 0
    event_log: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))
        if self.update_codec is not None and self.download_codec != "none":
            raise ValueError(
                "updates are applied to fp32 full versions: download_codec must be none"
            )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class OwnerStart:
    """What an owner's term starts from. ``epoch``: this ownership's (a takeover starts one above
    the state it took over); ``momentum``: the outer Nesterov buffer taken over with ``theta``;
    ``merged``: per sender, the newest base of its work merged into ``theta``, so that work is
    refused if it is sent again; ``reference``: the predecessor's clip reference, taken when it
    is plausible against ``measured`` (estimates from published updates this peer could
    measure, ``protocol.diloco.reference``), which seed it otherwise; ``standing``: the
    predecessor's standing per sender key (``Standing.export``)."""

    theta: torch.Tensor
    version: int = 0
    epoch: int = 0
    momentum: torch.Tensor | None = None
    merged: Mapping[bytes, int] = field(default_factory=dict)
    reference: Sequence[HandedNorm | float] = ()
    measured: Sequence[float] = ()
    standing: tuple[tuple[bytes, ...], tuple[float, ...]] | None = None


@dataclass(eq=False, slots=True)
class OwnerState:
    """The global fragment at its latest version, as held, and what names it.

    ``digests``: each recent version's state digests as learners decode it (a contribution is
    applied only to the state it was measured against: version numbers alone can name two
    contents); ``state_digests``: the one of them any owner computes (handoffs, fences);
    ``merged_base``: per sender, the newest base of its merged work."""

    theta: torch.Tensor  # [numel_p] fp32, never written to in place
    buffer: torch.Tensor | None  # Nesterov momentum, created on the first merge (or taken over)
    version: int
    epoch: int
    latest: Sealed  # the full state, sealed
    keep: int  # versions whose digests are kept
    update: Sealed | None = None  # with updates: the sealed update from version - 1 to version
    residual: torch.Tensor | None = None  # and what it rounded away (sent with the next)
    digests: dict[int, set[bytes]] = field(default_factory=dict)
    state_digests: dict[int, bytes] = field(default_factory=dict)
    merged_base: dict[bytes, int] = field(default_factory=dict)
    # a merge's result and its norm64, measured as it was made (``theta_norm``)
    known_norm: tuple[weakref.ref[torch.Tensor], float] | None = None
    log: LoggedMerger | None = None  # with an event log, each state and version is noted there

    def note_state(self) -> None:
        """Note the state held in the event log (a start or a takeover: replay starts from it)."""
        if self.log is not None:
            self.log.note_state(self.theta, self.buffer)

    def remember(self, version: int, state_digest: bytes, *others: bytes) -> None:
        """Know ``version`` by the digest of its state as learners decode it and by ``others``;
        forget versions older than the last ``keep``."""
        self.digests.setdefault(version, set()).update((state_digest, *others))
        self.state_digests[version] = state_digest
        if self.log is not None:
            self.log.note_version(version, state_digest)
        for old in [v for v in self.digests if v <= version - self.keep]:
            del self.digests[old]
            self.state_digests.pop(old, None)

    def digest_of(self, version: int) -> bytes:
        """The digest of ``version``'s state as learners decode it: what another owner holding
        the same content computes (not the sealed message's, which differs per seal)."""
        return self.state_digests[version]

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

    def theta_norm(self) -> float:
        """|Theta| of the version held (the norm measured as it was merged, else measured now)."""
        known = self.known_norm
        if known is not None and known[0]() is self.theta:
            return known[1]
        # kept for the next contribution screened against this state (``theta`` is never
        # written to in place): one pass over it per version, not one per contribution
        norm = norm64(self.theta)
        self.known_norm = (weakref.ref(self.theta), norm)
        return norm

    def merged_with(self, entries: Iterable[tuple[bytes, int]]) -> dict[bytes, int]:
        """``merged_base`` as it will be once the work in ``entries`` (sender, base) is merged."""
        merged = dict(self.merged_base)
        for peer, base in entries:
            merged[peer] = max(merged.get(peer, -1), base)
        return merged

    def set_merged(self, merged: dict[bytes, int]) -> None:
        """Hold ``merged`` as the senders' merged bases (the oldest beyond the cap go)."""
        self.merged_base = merged
        while len(self.merged_base) > MERGED_BASES_KEPT:
            self.merged_base.pop(next(iter(self.merged_base)))

    def take_merged(self, handed: Mapping[bytes, int]) -> None:
        """Add a predecessor's merged bases (the newer of each sender's wins)."""
        for peer, base in handed.items():
            if self.merged_base.get(peer, -1) < base:
                self.merged_base[peer] = base


@dataclass
class OwnerCounts:
    """What an owner did, in counts: all a peer keeps of an owner once it retires (its tensors,
    buffers and sealed versions go with it; a peer whose fragments change hands often would
    otherwise hold every retired owner's state). A merge that finishes after the retirement
    still counts here."""

    RECENT = 16  # merge reasons kept (the report shows the last few)

    fragment: int
    merges_done: int = 0
    merge_seconds: float = 0.0  # from each published round's close to its publication, in all
    checks: int = 0  # candidate versions validated before publication (node.diloco.validation)
    rejected: int = 0  # of them, not published
    check_seconds: float = 0.0  # spent evaluating them
    recent: collections.deque[str] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=OwnerCounts.RECENT)
    )
    # per sender: how often a bound bit (clipped, weight_capped, steps_bounded, tokens_bounded, work_capped),
    # its contribution was dropped from a failed merge, or refused (refused_<why>)
    penalties: collections.defaultdict[bytes, collections.Counter[str]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )

    def merged(self, reason: str) -> None:
        self.merges_done += 1
        self.recent.append(reason)

    def fold(self, other: OwnerCounts) -> None:
        """Add ``other``'s counts to these (a peer keeps one ``OwnerCounts`` per fragment for all
        the owners of it it retired, however often the fragment comes and goes)."""
        self.merges_done += other.merges_done
        self.merge_seconds += other.merge_seconds
        self.checks += other.checks
        self.rejected += other.rejected
        self.check_seconds += other.check_seconds
        self.recent.extend(other.recent)
        for peer, counts in other.penalties.items():
            self.penalties[peer].update(counts)
