"""The hand-off between an island's network side and its trainer thread.

The network side ``put``s verified versions from any thread; the trainer ``take``s them after an
inner step. The lock is held for a dict swap, which the trainer's hook never waits for (a busy
inbox is taken a step later). Every delivery, refusal and resend is news: a count that a loop
driving the optimizer only when there is something to do can wait on (``wait_for_news``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from node.diloco.device import Landed

__all__ = ["Arrival", "Inbox"]

Arrival = tuple[int, Landed, bool]  # (version, flat state, force: adopt it whole)


class Inbox:
    """Per fragment, the newest version arrived and not yet adopted."""

    def __init__(self) -> None:
        self._arrived: dict[int, Arrival] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._news = 0  # deliveries, refusals and resends so far
        self._declined: dict[int, int] = {}  # fragment -> base of in-flight work an owner declined

    def put_many(self, arrived: dict[int, tuple[int, Landed]], *, force: bool) -> None:
        """Versions arrived (any thread); ``force``: adopt them whole even at the version held."""
        with self._lock:
            for fragment, (version, flat) in arrived.items():
                self._put(fragment, version, flat, force)
            self._announce()

    def _put(self, fragment: int, version: int, flat: Landed, force: bool) -> None:
        held = self._arrived.get(fragment)  # the caller holds the lock
        if held is None or held[0] < version or (force and held[0] == version):
            self._arrived[fragment] = (version, flat, force or (held is not None and held[2]))
        elif force:  # a newer version is already waiting: adopt that one whole
            self._arrived[fragment] = (held[0], held[1], True)

    def decline(self, fragment: int, base: int) -> None:
        """The owner declined the candidate holding ``fragment``'s work on ``base`` (any thread)."""
        with self._changed:
            self._declined[fragment] = base
            self._announce()

    def take_declined(self) -> dict[int, int]:
        """The declines noted since the last call, per fragment its base (trainer thread)."""
        with self._lock:
            declined, self._declined = self._declined, {}
        return declined

    def declined(self, p: int, base: int) -> bool:
        """Whether a decline of ``p``'s work on ``base`` waits (inside ``wait_while`` only)."""
        return self._declined.get(p) == base

    def announce(self) -> None:
        """News without a version (a refusal, a resend): wakes whoever waits."""
        with self._changed:
            self._announce()

    def _announce(self) -> None:
        self._news += 1  # the caller holds the lock
        self._changed.notify_all()

    def take(
        self, *, block: bool = True, keep: Callable[[int, Arrival], bool] | None = None
    ) -> dict[int, Arrival] | None:
        """Everything arrived, except what ``keep`` says stays for later; None when ``block`` is
        False and the inbox is busy (trainer thread)."""
        if not self._lock.acquire(blocking=block):
            return None
        try:
            arrived, self._arrived = self._arrived, {}
            if keep is not None:
                self._arrived = {p: a for p, a in arrived.items() if keep(p, a)}
                for p in self._arrived:
                    del arrived[p]
        finally:
            self._lock.release()
        return arrived

    def newer(self, p: int, version: int) -> bool:
        """Whether a version of ``p`` above ``version`` waits (inside ``wait_while`` only)."""
        return p in self._arrived and self._arrived[p][0] > version

    def wait_while(self, busy: Callable[[], bool], deadline: float, poll_s: float) -> None:
        """Block while ``busy()`` (called with the lock held) until ``deadline`` (monotonic),
        waking at each news and at least every ``poll_s``."""
        with self._changed:
            while busy() and time.monotonic() < deadline:
                self._changed.wait(timeout=min(poll_s, max(0.0, deadline - time.monotonic())))

    @property
    def news(self) -> int:
        return self._news

    def wait_for_news(self, seen: int, timeout_s: float) -> bool:
        """Block (at most ``timeout_s``) until there is news since ``news`` read ``seen``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._news == seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(timeout=left)
        return True
