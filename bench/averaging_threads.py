"""Where one peer's round CPU goes, by thread: user and kernel seconds and minor page faults.

``bench.averaging_perf`` splits a round's CPU by native function (BLAKE3, torch, the kernel's
copies) but sees Python only as "the interpreter", and cProfile inflates every Python call by
its own hooks. Reading each thread's counters from ``/proc/self/task/<tid>/stat`` around a round
costs nothing the round sees, and says which thread did the work: Atoll's event loop (requests,
replies, the sockets' system calls), its worker threads (hashing, the merge's arithmetic, the
codecs) and the trainer (pseudo-gradients, adoption). Minor faults count fresh pages: a round
after the first that faults in megabytes is allocating where it should reuse.

``ThreadTimes.now()`` before and after a round; ``since(before)`` the difference by role. Linux
only (empty elsewhere).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["ThreadTimes", "role_of"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def role_of(name: str) -> str:
    """A thread's role by its name: ``loop`` (an Atoll node's event loop, ``atoll-node``),
    ``workers`` (``asyncio.to_thread``'s pool, ``asyncio_<n>``), ``raw`` (the raw side's loop),
    ``trainer`` (the main thread, which drives the island), else ``other``."""
    if name == "atoll-node":
        return "loop"
    if name.startswith("asyncio_"):
        return "workers"
    if name == "raw-http":
        return "raw"
    if name == "MainThread":
        return "trainer"
    return "other"


@dataclass(frozen=True, slots=True)
class ThreadTimes:
    """Per role: user seconds, kernel seconds, minor page faults (summed over its threads)."""

    by_role: Mapping[str, tuple[float, float, int]]

    @classmethod
    def now(cls, threads: Iterable[threading.Thread] | None = None) -> ThreadTimes:
        """This process's ``threads`` (default: every live one) as they stand now."""
        out: dict[str, tuple[float, float, int]] = {}
        for t in threading.enumerate() if threads is None else threads:
            counters = _read(t.native_id)
            if counters is None:
                continue
            user, kernel, faults = out.get(role_of(t.name), (0.0, 0.0, 0))
            out[role_of(t.name)] = (
                user + counters[0],
                kernel + counters[1],
                faults + counters[2],
            )
        return cls(out)

    def since(self, before: ThreadTimes) -> dict[str, dict[str, float]]:
        """What each role spent since ``before`` (a thread started since counts whole):
        ``{role: {"user_s", "sys_s", "minflt"}}``, roles that did nothing left out."""
        out: dict[str, dict[str, float]] = {}
        for role, (user, kernel, faults) in self.by_role.items():
            u0, k0, f0 = before.by_role.get(role, (0.0, 0.0, 0))
            d = {
                "user_s": round(user - u0, 3),
                "sys_s": round(kernel - k0, 3),
                "minflt": faults - f0,
            }
            if any(d.values()):
                out[role] = d
        return out


def _read(tid: int | None) -> tuple[float, float, int] | None:
    """(user s, kernel s, minor faults) of thread ``tid`` of this process; None when unknown."""
    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            # the fields after the command name, which may hold spaces and parentheses
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # proc(5): minflt is field 10, utime 14, stime 15; fields[0] here is field 3
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK, int(fields[7])
