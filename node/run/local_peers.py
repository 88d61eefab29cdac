"""A peer process of ``atoll local`` as the launcher sees it, and the error its log ends with.

``PeerProcess`` is the launcher's record of one process (one incarnation of a peer index): its
address once it listens, its latest progress and final result, and whether it was started or
killed. ``Timeline`` is when things happened in the run, for its accounting. ``last_error``
reads a peer's exception from its log, for the launcher's messages.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.run.prefork import ForkedProcess

__all__ = ["PeerProcess", "Timeline", "last_error"]


@dataclass
class PeerProcess:
    index: int
    proc: asyncio.subprocess.Process | ForkedProcess  # exec'd, or forked (node.run.prefork)
    log_path: Path
    url: str = ""
    peer_id: str = ""
    progress: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    incarnation: int = 0  # 0: the first process of this index; n: its n-th restart
    resumed_from_step: int = 0  # the checkpoint's step it resumed from (0: a fresh island)
    started: bool = False  # told to start training
    killed: bool = False  # SIGKILLed by fault injection or chaos
    listening: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # joined, waiting for "start"
    finished: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Timeline:
    """When things happened in a local run, on the monotonic clock: the launch, the start of
    training, each progress line, each version's first publication, each peer's end."""

    t0_mono: float  # the launch
    duration_s: float | None  # --duration: training ends this long after it starts
    train_started: float | None = None  # {"start": true} sent
    progress_log: list[tuple[float, int, int]] = field(
        default_factory=list
    )  # (time, incarnation id, step)
    version_times: dict[tuple[int, int], float] = field(
        default_factory=dict
    )  # (fragment, version) -> first seen
    done_times: list[float] = field(default_factory=list)  # "done" events

    def training_end(self) -> float | None:
        """When a ``--duration`` run stops training (None: no duration, or not started yet)."""
        if self.duration_s is None or self.train_started is None:
            return None
        return self.train_started + self.duration_s


def last_error(log_path: Path) -> str:
    """The last line of a peer's log that is not part of a traceback's frames: its exception."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    top = [
        ln for ln in lines if ln.strip() and not ln[0].isspace() and not ln.startswith("Traceback")
    ]
    return top[-1][:300] if top else "its log is empty"
