"""How long threads have waited, runnable, for a CPU: Linux's per-thread run delay.

The island counts a step as stalled when handing work to the network side took long in wall
time. On a box with more runnable threads than cores, the scheduler can keep the trainer off
the CPU for longer than that threshold in the middle of a hand-off that never blocked, or keep
off the CPU the thread of this process that holds the GIL the trainer waits for: either time
is CPU contention, not the network side. ``waited_for_cpu`` lets the island subtract it.
"""

from __future__ import annotations

import os

__all__ = ["thread_run_delays", "waited_for_cpu"]

_unavailable = False


def _read_delay(tid: int) -> float:
    """Seconds thread ``tid`` of this process has spent runnable but not running since it
    started: the second field of its ``schedstat``."""
    fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
    try:  # a bare read: several threads' are read around every hand-off
        return int(os.read(fd, 128).split()[1]) / 1e9
    finally:
        os.close(fd)


def thread_run_delays() -> dict[int, float]:
    """Every live thread of this process: its native id → seconds it has spent runnable but not
    running. Empty where the kernel does not say (non-Linux, no scheduler statistics), so a
    caller's difference is then 0; a thread that ends while it is read is left out."""
    global _unavailable
    if _unavailable:
        return {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        _unavailable = True
        return {}
    delays: dict[int, float] = {}
    for name in tids:
        try:
            delays[int(name)] = _read_delay(int(name))
        except (OSError, IndexError, ValueError):
            continue
    _unavailable = not delays  # not even this thread's: the kernel keeps no such statistics
    return delays


def waited_for_cpu(before: dict[int, float], after: dict[int, float], me: int) -> float:
    """Of the time thread ``me`` took between two ``thread_run_delays`` snapshots, how much the
    scheduler explains: its own run delay, plus the longest run delay of any other thread alive
    at both (the one holding the GIL that ``me`` waited for may have been kept off the CPU; which
    thread held it is not known, so this is an upper bound of what contention explains)."""
    own = after.get(me, 0.0) - before.get(me, 0.0)
    others = (after[t] - before[t] for t in after.keys() & before.keys() if t != me)
    return max(0.0, own) + max(others, default=0.0)
