"""What can happen to an owner's round, one class each: with the phase, the keys of
``FragmentMerger``'s transition table (``protocol.diloco.merge``). The contribution event,
``ContributionEvent``, lives in ``merge_admission`` with the rules that read it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Drop", "Expect", "Hold", "MergeFailed", "Published", "Rebase", "Tick"]


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class Expect:
    n: int | None
    finished: int = 0
    learners: frozenset[bytes] | None = None  # who the n are, when the node knows


@dataclass(frozen=True, slots=True)
class Published:
    new_version: int
    sync_time: float


@dataclass(frozen=True, slots=True)
class Rebase:
    version: int


@dataclass(frozen=True, slots=True)
class Hold:
    until: float


@dataclass(frozen=True, slots=True)
class Drop:
    reason: str


@dataclass(frozen=True, slots=True)
class MergeFailed:
    reason: str
    discard: frozenset[bytes]
