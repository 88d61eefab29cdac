"""Where a ``bench.swarm_scale`` worker's CPU goes: a stack sampler on its event loop's thread.

A real-time interval timer (``SIGALRM``, 50 Hz by default) interrupts the main thread, which runs
the event loop; the signal's handler looks at the Python stack it interrupted while ``counting``
is set, and counts each look under an *activity* and a *module*:

activity  what the loop was running, named by the task or callback it was in: the first Atoll
          frame after the event loop's own (``asyncio/events.py`` ``Handle._run``), skipping the
          harness's wrappers; a served DHT request is named by its handler (``serve DHT
          FindNode``); a look with no Atoll frame is ``aiohttp/asyncio`` (connections, parsing,
          the loop's own work); the loop waiting in ``select`` is ``idle``
module    the innermost frame's package (``protocol/wire/signing.py``, ``aiohttp``,
          ``cryptography``, ...): what the time was spent *in*

The stack is walked by the thread that owns it: a sampler thread walking the loop thread's frames
(``sys._current_frames``) raced the frames it walked, which CPython 3.11 frees as their functions
return (a 128-peer worker's sampler read a ``Member`` where a frame had been; a 96-peer worker
segfaulted). A look lands between two bytecodes of the main thread (or in ``select``, which the
signal interrupts and Python resumes), so shares are estimates to a few percent; the handler
costs tens of microseconds a look, well under 1 % of a core.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from types import FrameType
from typing import Any

__all__ = ["StackSampler", "activity_of", "module_of", "request_cost"]

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
    "Presence._store_record": "own record republication",
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
    """Samples the main thread's stack (the event loop's) from a ``SIGALRM`` timer."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.counting = threading.Event()  # set: looks are counted
        self.activities: Counter[str] = Counter()
        self.modules: Counter[str] = Counter()
        self._previous: Any = None

    def start(self) -> None:
        """Raises RuntimeError off the main thread: only it runs Python signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StackSampler samples the main thread: start it there")
        self._previous = signal.signal(signal.SIGALRM, self._look)
        signal.setitimer(signal.ITIMER_REAL, self.period_s, self.period_s)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        if self._previous is not None:
            signal.signal(signal.SIGALRM, self._previous)
            self._previous = None

    def _look(self, signum: int, frame: FrameType | None) -> None:
        if not self.counting.is_set():
            return
        frames = _stack(frame)
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


# --- what one DHT request costs, alone ---------------------------------------------------------


async def request_cost(requests: int = 1000, members: int = 16) -> dict[str, float]:
    """CPU microseconds (this process, both ends) per DHT request over the real loopback
    transport between two bare ``DHTNode``s in one loop (no admission middleware, no other load):
    a Ping, and a FindValue naming ``members`` records by content, all unchanged (the reply
    carries none). What a request costs as such, apart from what a peer does with its answer;
    ``ed25519_us``: the two signs and two verifies (request and reply envelopes) in it."""
    import hashlib

    from node.dht.kademlia import DHTConfig, DHTNode
    from node.dht.route import DHTRouter
    from node.wire.transport import Transport
    from protocol.dht.messages import FindValue, Ping
    from protocol.dht.records import sign_record
    from protocol.ids import key_id
    from protocol.wire.signing import Signer

    def signer(i: int) -> Signer:
        return Signer(hashlib.sha256(f"request-cost/{i}".encode()).digest())

    transport = Transport()
    router = DHTRouter(transport)
    await transport.start()
    cfg = DHTConfig(maintenance_period_s=0)
    a, b = (DHTNode(signer(i), transport, router.url(str(i)), cfg) for i in range(2))
    for i, node in enumerate((a, b)):
        router.mount(node, str(i))
        await node.start()
    try:
        key, now = key_id("request-cost/members"), time.time()
        records = [sign_record(signer(10 + i), key, bytes(300), now + 600) for i in range(members)]
        for rec in records:
            b.records.put(rec, now)
        same = FindValue(sender=a.me, key=key, same=tuple(_tags(records)))
        out: dict[str, float] = {}
        for name, msg in (("Ping", Ping(sender=a.me)), ("FindValue same", same)):
            out[name] = await _cpu_us(functools.partial(a.caller.call, b.me.address, msg), requests)
        out["ed25519_us"] = 2 * _verify_us() + 2 * _sign_us()
        return {k: round(v, 1) for k, v in out.items()}
    finally:
        for node in (a, b):
            await node.close()
        await transport.close()


def _tags(records: Sequence[Any]) -> list[bytes]:
    from protocol.dht.records import content_tag

    return [content_tag(r) for r in records]


async def _cpu_us(call: Callable[[], Awaitable[object]], n: int) -> float:
    for _ in range(20):  # warm: connections, imports
        await call()
    t = time.process_time()
    for _ in range(n):
        await call()
    return (time.process_time() - t) / n * 1e6


def _verify_us(n: int = 2000) -> float:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.from_private_bytes(bytes(32))
    pub, data = key.public_key(), bytes(300)
    sig = key.sign(data)
    t = time.process_time()
    for _ in range(n):
        pub.verify(sig, data)
    return (time.process_time() - t) / n * 1e6


def _sign_us(n: int = 2000) -> float:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, data = Ed25519PrivateKey.from_private_bytes(bytes(32)), bytes(300)
    t = time.process_time()
    for _ in range(n):
        key.sign(data)
    return (time.process_time() - t) / n * 1e6


if __name__ == "__main__":
    import asyncio
    import json

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    print(json.dumps(asyncio.run(request_cost(count))))
