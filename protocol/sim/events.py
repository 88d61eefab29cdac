"""A virtual clock: a queue of timed callbacks, run in time order (ties in scheduling order).

Nothing here reads a real clock; ``now`` is the time of the event being run. Callbacks schedule
further events with ``at``. Cancelling is by token: a callback that may be superseded checks its
own token against its owner's current one and returns if it is stale.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from protocol.errors import LocalProtocolError

__all__ = ["EventQueue"]


class EventQueue:
    """Timed callbacks; ``run(until)`` executes them in order and leaves ``now`` at the last."""

    def __init__(self) -> None:
        self.now = 0.0
        self.executed = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at ``when`` (not before ``now``; ``math.inf`` never runs)."""
        if math.isnan(when) or when < self.now:
            raise LocalProtocolError(f"event at {when} is before now {self.now}")
        if when == math.inf:
            return
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    def run(self, until: float = math.inf) -> None:
        """Run every event due at or before ``until``, including those they schedule."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.executed += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)
