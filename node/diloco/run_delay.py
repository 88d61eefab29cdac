"""How long the calling thread has waited, runnable, for a CPU: Linux's per-thread run delay.

The island counts a step as stalled when handing work to the network side took long in wall
time. On a box with more runnable threads than cores, the scheduler can keep the trainer off
the CPU for longer than that threshold in the middle of a hand-off that never blocked: the
time is CPU contention, not the network side. ``run_delay_s`` lets the island subtract it.
"""

from __future__ import annotations

import threading

__all__ = ["run_delay_s"]

_unavailable = False


def run_delay_s() -> float:
    """Seconds the calling thread has spent runnable but not running since it started (the
    second field of ``/proc/thread-self/schedstat``); 0.0 where the kernel does not say
    (non-Linux, no scheduler statistics), so a caller's difference is then 0."""
    global _unavailable
    if _unavailable:
        return 0.0
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        _unavailable = True
        return 0.0
