"""What a peer's Python heap grew by, allocation site by site (``ATOLL_TRACEMALLOC=FRAMES``).

The report's memory fields say whether a peer grew; this says where. With the variable set, a
peer starts tracing its allocations with ``tracemalloc`` (FRAMES deep) once warm-up is over, and
when it finishes logs the allocation sites whose blocks allocated since are still held, largest
first. Tracing from the start would slow the import of torch and the start-up many times over
(32 peers on two cores then missed the launcher's deadline); from warm-up on it costs a peer
about a third of its speed: a diagnostic run, never a default.
"""

from __future__ import annotations

import logging
import os
import tracemalloc
from pathlib import Path

__all__ = ["MemTrace"]

log = logging.getLogger("atoll.memtrace")

TOP = 15


class MemTrace:
    """Start tracing if ``ATOLL_TRACEMALLOC`` asks for it; ``mark_warm`` once, ``report`` at the end."""

    def __init__(self, env: str | None = None) -> None:
        text = os.environ.get("ATOLL_TRACEMALLOC", "") if env is None else env
        try:
            frames = int(text) if text.strip() else 0
        except ValueError:
            raise ValueError(
                f"ATOLL_TRACEMALLOC={text!r}: give the number of frames to record (e.g. 1), "
                "or leave it unset"
            ) from None
        self.enabled = frames > 0
        self._baseline: tracemalloc.Snapshot | None = None
        self._fds_warm = 0
        self._frames = frames

    def mark_warm(self) -> None:
        if self.enabled and self._baseline is None:
            if not tracemalloc.is_tracing():
                tracemalloc.start(self._frames)
            self._baseline = tracemalloc.take_snapshot()
            self._fds_warm = open_fds()

    def report(self) -> list[str]:
        """The sites that grew most since ``mark_warm``, as log lines (also logged)."""
        if not self.enabled or self._baseline is None:
            return []
        now = tracemalloc.take_snapshot()
        key = "traceback" if tracemalloc.get_traceback_limit() > 1 else "lineno"
        lines = [
            f"{stat.size_diff / 1e6:+.3f} MB in {stat.count_diff:+d} blocks: "
            + " <- ".join(str(frame) for frame in stat.traceback)
            for stat in now.compare_to(self._baseline, key)[:TOP]
            if stat.size_diff > 0
        ]
        lines.append(
            f"open file descriptors (sockets, files): {self._fds_warm} at warm-up, {open_fds()} now"
        )
        for line in lines:
            log.info("grew since warm-up: %s", line)
        return lines


def open_fds() -> int:
    """How many file descriptors this process holds (sockets included); -1 where /proc is not."""
    try:
        return len(list(Path("/proc/self/fd").iterdir()))
    except OSError:
        return -1
