"""Where a ``bench.swarm_scale`` worker's CPU goes: a stack sampler on its event loop's thread.

A daemon thread looks at the main thread's Python stack every ``period_s`` (50 Hz by default)
while ``counting`` is set, and counts each look under an *activity* and a *module*:

activity  what the loop was running, named by the task or callback it was in: the first Atoll
          frame after the event loop's own (``asyncio/events.py`` ``Handle._run``), skipping the
          harness's wrappers; a served DHT request is named by its handler (``serve DHT
          FindNode``); a look with no Atoll frame is ``aiohttp/asyncio`` (connections, parsing,
          the loop's own work); the loop waiting in ``select`` is ``idle``
module    the innermost frame's package (``protocol/wire/signing.py``, ``aiohttp``,
          ``cryptography``, ...): what the time was spent *in*

The sampler holds the GIL only while it walks one stack (~40 frames, tens of microseconds), so
its own cost is well under 1 % of a core. A look lands where the main thread gave up the GIL
(every 5 ms at the latest, or in ``select``), so shares are estimates to a few percent.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Sequence
from types import FrameType

__all__ = ["StackSampler", "activity_of", "module_of"]

IDLE = "idle"
LOOP = "aiohttp/asyncio"
# frames of the harness that only wrap the loop or a peer's own tasks (its serve, join retries)
WRAPPERS = {"<module>", "main", "worker_main", "Worker.run", "Worker.serve", "Worker.serve_once"}
OURS = ("/node/", "/protocol/", "/bench/")
# what a few of the tasks are, named for the docs' table
NAMES = {
    "PeerNode.serve": "join (bootstrap, sync, first reads)",
    "PeerNode._membership_loop": "membership loop (reads, ownership, expectations)",
    "Presence.record_loop": "own record republication",
    "DHTNode.run": "DHT maintenance (bucket refresh, republish)",
    "DHTNode._verifier": "DHT claim pings",
    "DHTNode._verify": "DHT claim pings",
    "DHTNode._probe": "DHT bucket pings",
    "train": "harness: stand-in steps",
    "Worker.sample_loop": "harness: sampling",
    "Worker.apply": "harness: building and stopping peers",
}


def _ours(filename: str) -> bool:
    return any(part in filename for part in OURS) and "/site-packages/" not in filename


def activity_of(frames: Sequence[tuple[str, str]]) -> str:
    """The activity of one stack, ``frames`` as (file name, qualified name), outermost first."""
    if not frames:
        return LOOP
    inner_file, inner_name = frames[-1]
    if inner_name.rsplit(".", 1)[-1] in ("select", "poll") and inner_file.endswith("selectors.py"):
        return IDLE
    start = 0
    for i, (filename, name) in enumerate(frames):
        if name == "Handle._run" and filename.endswith("events.py"):
            start = i + 1  # the innermost such frame: what the loop is running now
    ours = [(f, n) for f, n in frames[start:] if _ours(f) and n not in WRAPPERS]
    for _, name in ours:
        if name.startswith("DHTNode._on_"):
            return "serve DHT " + "".join(w.title() for w in name[12:].split("_"))
    if not ours:
        return LOOP
    root_file, root = ours[0]
    if "/node/wire/" in root_file:  # a served request (its middleware first): name its handler
        handler = next((n for f, n in ours if "/node/wire/" not in f), None)
        return "serve " + (handler or "(admission, transport)")
    return NAMES.get(root, root)


def module_of(frames: Sequence[tuple[str, str]]) -> str:
    """The innermost frame's file, as a path from the repository root or a package name."""
    if not frames:
        return "?"
    filename = frames[-1][0]
    for part in OURS:
        if part in filename and "/site-packages/" not in filename:
            return part[1:] + filename.rsplit(part, 1)[1]
    tail = filename.rsplit("/site-packages/", 1)[-1]
    if tail != filename:
        return tail.split("/", 1)[0]
    return "python/" + filename.rsplit("/", 1)[-1]


def _stack(frame: FrameType | None, limit: int = 200) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append((code.co_filename, code.co_qualname))
        frame = frame.f_back
    out.reverse()
    return out


class StackSampler:
    """Samples the thread that built it (the event loop's) from a daemon thread."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.target = threading.get_ident()
        self.counting = threading.Event()  # set: looks are counted
        self.activities: Counter[str] = Counter()
        self.modules: Counter[str] = Counter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            if not self.counting.is_set():
                continue
            frames = _stack(sys._current_frames().get(self.target))
            activity = activity_of(frames)
            self.activities[activity] += 1
            if activity != IDLE:
                self.modules[module_of(frames)] += 1

    def report(self, top: int = 24) -> dict[str, object]:
        """Counts of looks (idle included) by activity, and busy looks by module."""
        return {
            "looks": sum(self.activities.values()),
            "by_activity": dict(self.activities.most_common(top)),
            "by_module": dict(self.modules.most_common(top)),
        }
