"""A bounded history of a node's progress, for the status page's charts.

The trainer thread records one point about once a second (time, step, training loss, bytes sent
and received); the event loop reads them when the page asks. However long the run, the history
holds at most ``max_points`` points: when it is full every other point is dropped and from then
on only every second record is kept (then every fourth, ...), so the whole run stays drawn at
an even, coarser spacing and a reader never copies more than ``max_points`` points.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

__all__ = ["History", "Point"]

MAX_POINTS = 512


@dataclass(frozen=True, slots=True)
class Point:
    """One sample: wall-clock ``t`` (s), inner ``step``, training ``loss`` (NaN: none yet),
    cumulative ``sent`` and ``received`` bytes."""

    t: float
    step: int
    loss: float
    sent: int
    received: int

    def row(self) -> list[float | int | None]:
        """As a JSON row ``[t, step, loss, sent, received]`` (a non-finite loss becomes null)."""
        return [
            round(self.t, 3),
            self.step,
            self.loss if math.isfinite(self.loss) else None,
            self.sent,
            self.received,
        ]


class History:
    """Thread-safe, bounded, evenly thinned samples (see the module docstring)."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points must be >= 2, not {max_points}")
        self.max_points = max_points
        self._points: list[Point] = []
        self._stride = 1  # keep one record in this many
        self._since = 0  # records offered since the last kept point
        self._lock = threading.Lock()
        self.last: Point | None = None  # the newest record, kept or not

    def record(self, point: Point) -> None:
        with self._lock:
            self.last = point
            self._since += 1
            if self._points and self._since < self._stride:
                return
            self._points.append(point)
            self._since = 0
            if len(self._points) >= self.max_points:
                if (
                    len(self._points) % 2 == 0
                ):  # the newest point goes: the last kept is one stride back
                    self._since = self._stride
                self._points = self._points[::2]
                self._stride *= 2

    def points(self) -> list[Point]:
        """The kept points, oldest first, and the newest record when it was not kept."""
        with self._lock:
            out = list(self._points)
            if self.last is not None and (not out or out[-1] is not self.last):
                out.append(self.last)
            return out
