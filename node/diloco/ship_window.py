"""How many of an island's contributions hold buffers on the network side (``ShipWindow``).

A due fragment's contribution holds memory from the moment the island snapshots it until its
owner answers: its pseudo-gradient Δ (a fragment's fp32 bytes) until it is compressed, then the
error-feedback residuals it leaves (another fragment's fp32 bytes, kept beside the old ones until
the owner's answer commits or drops them) and its sealed body. While training, fragments fall due
one at a time; the end-of-run flush (and a synchronous island's step, and resends after an owner
left) had every fragment due at once, and all of them compressing and uploading together took a
124M peer from 8.0x to 8.9x the model's fp32 bytes (docs/scale.md). Shipping through the window
keeps at most ``depth`` contributions open, and at most one uncompressed Δ: the next fragment's
compression overlaps the previous one's upload, and no more.

Each contribution carries a ``Handoff`` (``Outgoing.handoff``). The network side calls
``compressed()`` once it has released Δ and ``close()`` once the contribution is answered, failed
or dropped; a handoff that nothing closes is closed when it is garbage-collected, so a dropped
``Outgoing`` never holds the window shut. Thread-safe: the trainer thread waits, the event loop
closes.
"""

from __future__ import annotations

import threading
import time
import weakref

__all__ = ["Handoff", "ShipWindow"]


class Handoff:
    """One contribution's claim on a ``ShipWindow``: open (Δ held), compressed, closed."""

    __slots__ = ("__weakref__", "_closer", "_window", "fragment")

    def __init__(self, window: ShipWindow, fragment: int) -> None:
        self._window, self.fragment = window, fragment
        # closed when collected, if nothing closed it: a dropped contribution holds no buffers
        self._closer = weakref.finalize(self, window._settle, id(self), True)

    def compressed(self) -> None:
        """Δ is released: the next fragment may snapshot its own (idempotent)."""
        self._window._settle(id(self), False)

    def close(self) -> None:
        """The contribution's buffers are all released (answered, failed or dropped; idempotent)."""
        self._closer()


class ShipWindow:
    """Counts open handoffs; ``wait_for_room`` blocks until one more may be shipped."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a ship window of depth {depth} never opens: use 1 or more")
        self.depth = depth
        self._changed = threading.Condition()
        self._open: dict[int, bool] = {}  # id(handoff) -> whether its Δ is still held
        self.peak_open = 0  # the most handoffs open at once (what the window bounds)
        self.peak_held = 0  # the most uncompressed Δ at once

    def open(self, fragment: int) -> Handoff:
        """A contribution of ``fragment`` is about to be snapshotted: its handoff, counted open."""
        handoff = Handoff(self, fragment)
        with self._changed:
            self._open[id(handoff)] = True
            self.peak_open = max(self.peak_open, len(self._open))
            self.peak_held = max(self.peak_held, self.held)
        return handoff

    @property
    def open_count(self) -> int:
        return len(self._open)

    @property
    def held(self) -> int:
        """Open handoffs whose Δ is not compressed yet."""
        return sum(self._open.values())

    def has_room(self) -> bool:
        """Whether one more contribution fits: no Δ uncompressed and fewer than ``depth`` open."""
        with self._changed:
            return self._room()

    def wait_for_room(self, deadline: float) -> bool:
        """Block until ``has_room`` or ``deadline`` (monotonic); return whether there is room."""
        with self._changed:
            while not self._room():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(timeout=left)
            return True

    def _room(self) -> bool:
        return self.held == 0 and len(self._open) < self.depth

    def _settle(self, key: int, close: bool) -> None:
        with self._changed:
            if key not in self._open:
                return
            if close:
                del self._open[key]
            else:
                self._open[key] = False
            self._changed.notify_all()
