"""Where a group's next failure comes from: one process per failure domain, or one per chip.

Every chip fails as a Poisson process with rate ``1 / mtbi_s`` while its slice is up; a failure
takes its whole slice down until the group brings it back. Two equivalent sources:

- ``DomainFailures`` (the one to use): the up slices together fail as one Poisson process of
  rate ``up slices * chips per slice / mtbi_s`` (a superposition of Poisson processes is one),
  and the slice hit is uniform among the up slices (each holds the same number of chips). The
  next failure is redrawn whenever the up set changes (memorylessness makes that exact), so a
  million chips cost one random draw per event, not a million clocks.
- ``PerChipFailures``: a clock per chip in a heap, for checking the above at a size where
  both run (``tests/protocol/test_sim_failures.py``).
"""

from __future__ import annotations

import heapq
import math
import random
from typing import Protocol

from protocol.errors import LocalProtocolError

__all__ = ["DomainFailures", "FailureSource", "PerChipFailures"]


class FailureSource(Protocol):
    def next_failure(self, now: float) -> tuple[float, int]:
        """(time, slice) of the next failure among the up slices; (inf, -1) when none is up."""
        ...

    def remove(self, slice_id: int) -> None:
        """Slice ``slice_id`` went down: its chips stop failing."""
        ...

    def add(self, slice_id: int, now: float) -> None:
        """Slice ``slice_id`` is up again from ``now``."""
        ...


class _UpSet:
    """The up slices, with O(1) add, remove and uniform choice."""

    def __init__(self, n_slices: int) -> None:
        if n_slices < 1:
            raise LocalProtocolError(f"a group needs at least one slice, got {n_slices}")
        self.ids = list(range(n_slices))
        self.pos = {i: i for i in self.ids}

    def remove(self, slice_id: int) -> None:
        i = self.pos.pop(slice_id, None)
        if i is None:
            raise LocalProtocolError(f"slice {slice_id} is not up")
        last = self.ids.pop()
        if last != slice_id:
            self.ids[i], self.pos[last] = last, i

    def add(self, slice_id: int) -> None:
        if slice_id in self.pos:
            raise LocalProtocolError(f"slice {slice_id} is already up")
        self.pos[slice_id] = len(self.ids)
        self.ids.append(slice_id)


class DomainFailures:
    """The up slices fail as one Poisson process (see the module docstring)."""

    def __init__(
        self, n_slices: int, chips_per_slice: float, mtbi_s: float, rng: random.Random
    ) -> None:
        self._up = _UpSet(n_slices)
        self._slice_rate = chips_per_slice / mtbi_s
        self._rng = rng

    def next_failure(self, now: float) -> tuple[float, int]:
        ids = self._up.ids
        if not ids:
            return math.inf, -1
        when = now + self._rng.expovariate(len(ids) * self._slice_rate)
        return when, ids[self._rng.randrange(len(ids))]

    def remove(self, slice_id: int) -> None:
        self._up.remove(slice_id)

    def add(self, slice_id: int, now: float) -> None:
        self._up.add(slice_id)


class PerChipFailures:
    """A failure clock per chip (``chips_per_slice`` whole chips per slice)."""

    def __init__(
        self, n_slices: int, chips_per_slice: int, mtbi_s: float, rng: random.Random
    ) -> None:
        if chips_per_slice < 1:
            raise LocalProtocolError(
                f"chips_per_slice must be a whole number >= 1, got {chips_per_slice}"
            )
        self._per_slice, self._mtbi, self._rng = chips_per_slice, mtbi_s, rng
        self._epoch = [0] * n_slices  # bumped when a slice goes down: its chips' clocks are void
        self._up = [True] * n_slices
        self._heap: list[tuple[float, int, int]] = []  # (time, slice, epoch)
        for s in range(n_slices):
            self._arm(s, 0.0)

    def _arm(self, slice_id: int, now: float) -> None:
        for _ in range(self._per_slice):
            when = now + self._rng.expovariate(1.0 / self._mtbi)
            heapq.heappush(self._heap, (when, slice_id, self._epoch[slice_id]))

    def next_failure(self, now: float) -> tuple[float, int]:
        heap = self._heap
        while heap and heap[0][2] != self._epoch[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            return math.inf, -1
        return heap[0][0], heap[0][1]

    def remove(self, slice_id: int) -> None:
        if not self._up[slice_id]:
            raise LocalProtocolError(f"slice {slice_id} is not up")
        self._up[slice_id] = False
        self._epoch[slice_id] += 1

    def add(self, slice_id: int, now: float) -> None:
        if self._up[slice_id]:
            raise LocalProtocolError(f"slice {slice_id} is already up")
        self._up[slice_id] = True
        self._arm(slice_id, now)
