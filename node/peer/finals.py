"""Final versions: an owner's wait to declare one (``FinalVersions``: once no member is learning
and the last round is merged), and the learner's fetch of every fragment's (``FinalFetch``).

A ``final`` wait is woken by events, not a timer: the owner's publication or retirement
(``FragmentOwner.wait_after``) and the next membership read (``SharedReads``: one read at a time,
at most one per ``FINAL_READ_S``, shared by every waiter), which brings the last learners'
"stopped" records and lets silence bounds run out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

import torch

from node.diloco.owner import FragmentOwner
from node.peer.expected import LearnerExpectations
from node.peer.started import Started
from node.peer.view import MemberView
from protocol.wire.signing import Sealed

__all__ = ["FINAL_READ_S", "FinalFetch", "FinalVersions", "SharedReads"]

log = logging.getLogger("atoll.peer")

FINAL_READ_S = 0.5  # how often final waiters (all of them, together) read the member records
# once the final versions are in, the members are read again and a fragment whose owner moved is
# fetched again from the new one: up to FINAL_RECHECKS times, FINAL_SETTLE_S apart
FINAL_SETTLE_S = 2.0
FINAL_RECHECKS = 3


class SharedReads:
    """One ``read`` (a membership refresh) at a time, at most one per ``period_s``, shared by
    everyone waiting for it: ``next_read`` returns once a read that began after the call ended."""

    def __init__(
        self,
        read: Callable[[], Awaitable[object]],
        period_s: float = FINAL_READ_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read, self.period_s, self.clock = read, period_s, clock
        self._lock = asyncio.Lock()
        self._last = -math.inf
        self.reads = 0  # reads done (for tests and status)

    async def next_read(self) -> None:
        done = self.reads
        async with self._lock:  # one reader; the others wait here and find its read done
            if self.reads != done:
                return
            await asyncio.sleep(max(0.0, self._last + self.period_s - self.clock()))
            with contextlib.suppress(Exception):  # a failed read is retried by the next waiter
                await self.read()
            self._last = self.clock()
            self.reads += 1


class FinalVersions:
    """Final-version waits for the owners of a peer: asks ``expected`` how many learners are
    still awaited, and reads the members (``started.membership``) once for all waiters."""

    def __init__(self, started: Started, expected: LearnerExpectations) -> None:
        self.started, self.expected = started, expected
        self.final_checks = 0  # times a final wait checked whether the end is reached (per event)
        self._final_reads = SharedReads(self._read_members)

    async def wait(self, owner: FragmentOwner, wait_s: float) -> Sealed | None:
        """The final version, once no member is learning (members claiming to learn that have
        sent nothing for their silence bound left out) and the last round is merged; None if
        that takes longer than ``wait_s``. Checked again on each event that can change the
        answer (see the module docstring), never on a timer of its own."""
        deadline = time.monotonic() + wait_s
        while not owner.retired:
            self.final_checks += 1
            if await self.expected.tell_expected(owner, at_end=True) == 0 and owner.idle():
                return owner.declare_final()  # the first time, its on_final tells the replica
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self._final_change(owner, left)
        return None

    async def _final_change(self, owner: FragmentOwner, timeout_s: float) -> None:
        """Until ``owner`` publishes or retires, the next shared membership read ends (without a
        membership: ``FINAL_READ_S``, for silence bounds to run out), or ``timeout_s``."""
        waits = [asyncio.ensure_future(owner.wait_after(owner.version, timeout_s))]
        if self.started.membership is not None:
            waits.append(asyncio.ensure_future(self._final_reads.next_read()))
        try:
            await asyncio.wait(
                waits,
                timeout=timeout_s
                if self.started.membership is not None
                else min(timeout_s, FINAL_READ_S),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _read_members(self) -> None:
        if self.started.membership is not None:
            await self.started.membership.refresh()


class FinalFetch:
    """The learner's fetch of every fragment's final version from its current owner (``view``),
    through the learner's network side (``started.net``)."""

    def __init__(self, started: Started, view: MemberView, n_fragments: int) -> None:
        self.started, self.view, self.n_fragments = started, view, n_fragments

    async def fetch(
        self, *, settle_s: float = FINAL_SETTLE_S, rechecks: int = FINAL_RECHECKS
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """Every fragment's final version from its current owner (verified).

        An owner declares its fragment final once no member is learning and its last round is
        merged; until then this keeps asking (an owner may be finishing a merge or moving).
        Then the members are read afresh (a full read) and each fragment's owner looked up
        again: a fragment whose owner changed since it answered is fetched again from the new
        one, ``settle_s`` later, up to ``rechecks`` times. Views that differed while the machine
        was overloaded (records lapsing) converge once training stops, and a successor that split
        off and declared an older version final then no longer speaks for the fragment."""
        out: dict[int, tuple[int, torch.Tensor]] = {}
        answered: dict[int, bytes] = {}  # fragment -> the owner that declared its final version
        for check in range(rechecks + 1):
            await self._fetch_missing(out, answered)
            if check == rechecks:
                break
            if check > 0:
                await asyncio.sleep(settle_s)
            if self.started.membership is not None:
                with contextlib.suppress(Exception):
                    await self.started.membership.refresh(full=True)
            moved = [
                p
                for p in out
                if (current := self.view.owner_of(p)) is not None and current[0] != answered[p]
            ]
            for p in moved:
                log.warning(
                    "fragment %d: its owner changed after it declared version %d final; "
                    "asking the new owner",
                    p,
                    out[p][0],
                )
                del out[p]
            unsettled = await self._ask_again(out, answered)
            if not moved and not unsettled:
                break
        return out

    async def _ask_again(
        self, out: dict[int, tuple[int, torch.Tensor]], answered: dict[int, bytes]
    ) -> int:
        """Ask each fragment's owner, which has not moved, whether the final version we hold is
        still its final one: an owner that declared an older version final (a successor that
        split off, or came back from a checkpoint) may take over a newer one from a live owner's
        handoff just after. Holding it costs the owner a short answer (its final is the version
        we name by digest); a newer one replaces ours. Returns how many are not settled."""
        net = self.started.net
        assert net is not None
        unsettled = 0
        for p in sorted(out):
            owner = self.view.owner_of(p)
            if owner is None or owner[0] != answered[p]:  # moved since: the next check asks it
                unsettled += 1
                continue
            try:
                got = await net.fetch(p, after=out[p][0], wait_s=5.0, final=True, owner=owner)
            except Exception as exc:  # the next check asks again
                log.warning("final version of fragment %d not confirmed: %r", p, exc)
                unsettled += 1
                continue
            if got is None:  # its owner no longer says its version is final
                unsettled += 1
            elif got[0] != out[p][0]:
                log.warning(
                    "fragment %d: its owner declared version %d final after version %d",
                    p,
                    got[0],
                    out[p][0],
                )
                out[p] = got
                unsettled += 1
        return unsettled

    async def _fetch_missing(
        self, out: dict[int, tuple[int, torch.Tensor]], answered: dict[int, bytes]
    ) -> None:
        """Fill ``out`` with every fragment's final version, asking each one's owner until it
        declares it (an owner may be finishing a merge or moving); note who answered."""
        net = self.started.net
        assert net is not None
        while len(out) < self.n_fragments:
            for p in range(self.n_fragments):
                if p in out:
                    continue
                owner = self.view.owner_of(p)
                if owner is None:
                    await asyncio.sleep(0.5)
                    continue
                try:
                    got = await net.fetch(
                        p, after=net.received[p], wait_s=5.0, final=True, owner=owner
                    )
                except Exception as exc:  # keep trying: the owner may be finishing a merge
                    log.warning("final fetch of fragment %d failed: %r", p, exc)
                    await asyncio.sleep(0.5)
                    continue
                if got is not None:
                    out[p], answered[p] = got, owner[0]
