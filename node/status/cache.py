"""``Cached``: a value computed at most once per ``max_age_s``, for what visitors may ask often.

A status page, ``/metrics`` and ``/v1/status`` answer whoever asks, as often as they ask; what
they show costs milliseconds to compute (summing every owner's per-sender counts, walking the
DHT store). ``Cached(compute, max_age_s=1.0)`` computes on the first ``get()`` and again only
once ``max_age_s`` has passed on its clock; in between ``get()`` returns the same object.

A clock that goes back (a fake clock reset in a test, a wall clock stepped by NTP) makes the
value stale at once: it is computed again on the next ``get()``, never kept until the clock
catches up with the time it was computed at.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Cached"]

T = TypeVar("T")


class Cached(Generic[T]):
    """``compute()``'s value, computed at most once per ``max_age_s`` of ``clock`` (see above)."""

    def __init__(
        self,
        compute: Callable[[], T],
        *,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= max_age_s < math.inf:
            raise ValueError(f"max_age_s must be finite and >= 0, not {max_age_s!r}")
        self.compute, self.max_age_s, self.clock = compute, max_age_s, clock
        self._value: tuple[float, T] | None = None  # (when computed, value)
        self.computed = 0  # times compute() ran

    def get(self) -> T:
        """The value, computed again if it is older than ``max_age_s`` or the clock went back."""
        now = self.clock()
        kept = self._value
        if kept is None or not 0 <= now - kept[0] < self.max_age_s:
            kept = self._value = (now, self.compute())
            self.computed += 1
        return kept[1]

    def clear(self) -> None:
        """Forget the value: the next ``get()`` computes it."""
        self._value = None
