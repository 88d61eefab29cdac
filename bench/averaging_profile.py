"""A bench-only sampling profile of one averaging peer's rounds, every thread at once.

``BENCH_PROFILE=DIR python -m bench.averaging ...``: each peer samples the Python stacks of all
its threads (``sys._current_frames``) every ``BENCH_PROFILE_MS`` (default 5) milliseconds while a
round runs (between ``go`` and its reply) and writes ``DIR/peer<i>.txt`` when it quits: the
innermost frames where its threads were busy, by share of busy samples. A thread parked in a
wait (a selector, a lock, a queue, a future) counts as idle. Not a CPU profile: a thread inside a
C call that released the GIL (BLAKE3, torch, a socket) is busy at the frame that called it, which
is the attribution wanted; cProfile sees one thread only, and py-spy is not installed here.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from types import FrameType

__all__ = ["Sampler", "from_env"]

# innermost functions of a thread that waits rather than works
_IDLE = {
    "select",
    "wait",
    "_wait_for_tstate_lock",
    "get",
    "_worker",
    "poll",
    "run_forever",
    "_run_once",
    "sleep",
    "readline",
    "acquire",
    "wait_for_news",
    "_sample",
}


class Sampler:
    """Samples every other thread's stack every ``interval_s`` while ``active``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.active = False
        self.leaf: Counter[str] = Counter()  # innermost frame, with its caller
        self.stack: Counter[str] = Counter()  # any frame on a busy stack (inclusive)
        self.busy = self.idle = 0
        self._me = 0
        self._thread = threading.Thread(target=self._run, name="bench-profile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._me = threading.get_ident()
        while True:
            time.sleep(self.interval_s)
            if self.active:
                self._sample()

    def _sample(self) -> None:
        for ident, frame in sys._current_frames().items():
            if ident == self._me:
                continue
            if frame.f_code.co_name in _IDLE:
                self.idle += 1
                continue
            self.busy += 1
            names = _names(frame)
            self.leaf[" <- ".join(names[:3])] += 1
            for name in set(names):
                self.stack[name] += 1

    def report(self) -> str:
        lines = [f"busy samples {self.busy}, idle {self.idle}", "", "innermost (with callers):"]
        total = max(self.busy, 1)
        lines += [f"{100 * n / total:6.1f}%  {k}" for k, n in self.leaf.most_common(40)]
        lines += ["", "inclusive:"]
        lines += [f"{100 * n / total:6.1f}%  {k}" for k, n in self.stack.most_common(60)]
        return "\n".join(lines) + "\n"


def _names(frame: FrameType | None) -> list[str]:
    out: list[str] = []
    while frame is not None and len(out) < 40:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return out


def from_env() -> Sampler | None:
    """A sampler when ``BENCH_PROFILE`` names a directory, else None."""
    if not os.environ.get("BENCH_PROFILE"):
        return None
    return Sampler(float(os.environ.get("BENCH_PROFILE_MS", "5")) / 1000)
