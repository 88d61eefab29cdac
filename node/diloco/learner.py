"""The island's network side: ship contributions, long-poll owners, deliver verified versions.

Runs on the node's event loop. ``IslandNet`` holds the parts, each an object of its own:

- ``ContributionSender`` (``node.diloco.contributing``): ``submit`` is called from the trainer
  thread and only enqueues; compression (with error feedback), sealing and sending happen on the
  loop, off the trainer's path; accepted work is sent again when its owner leaves (or,
  synchronous, stays silent); a non-finite pseudo-gradient is never sent.
- ``VersionFetcher`` (``node.diloco.fetching``): fetches and checks versions, from owners,
  holders or as updates, and from our own owners in process.
- ``ReceivedVersions`` (``node.diloco.received``): the versions received and their digests,
  which both read.

``IslandNet`` itself runs one long-poll per fragment, asking the fragment's owner for "the next
version after v" and handing what passes the checks to ``Island.deliver``, and ``resync``, which
has the island adopt every fragment's latest version whole. A long-poll waits up to
``POLL_WAIT_S`` (a version ends it at once) and is cancelled and aimed again as soon as our view
names another owner for its fragment (read every ``OWNER_CHECK_S``), so the long wait costs
fewer requests without a new owner being polled later (docs/scale_peers.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import torch

from node.diloco.contributing import RESEND_AFTER_S, ContributionSender
from node.diloco.fetching import (
    LocalOwners,
    OwnerLinks,
    RoundDeclined,
    UpdateNotApplicable,
    VersionFetcher,
    VersionRefused,
)
from node.diloco.island import Island, Outgoing
from node.diloco.learner_config import LearnerNetConfig, LearnerStats
from node.diloco.reach import Reach
from node.diloco.received import ReceivedVersions
from node.diloco.spread import Spreading
from node.wire.transport import LinkDropped
from protocol.errors import RemoteProtocolError

__all__ = [
    "RESEND_AFTER_S",
    "IslandNet",
    "LearnerNetConfig",
    "LearnerStats",
    "LocalOwners",
    "OwnerLinks",
    "Reach",
    "UpdateNotApplicable",
]

log = logging.getLogger(__name__)

# A `next` long-poll's wait (the server holds it up to ``node.peer.serving.MAX_WAIT_S``, 30 s): 5 s
# made 4 fragments ask >= 0.8 times a second with no version at all (docs/scale_peers.md).
POLL_WAIT_S = 25.0
# How often a parked long-poll reads who owns its fragment: a new owner is asked this soon.
OWNER_CHECK_S = 1.0

_FAILED = (aiohttp.ClientError, LinkDropped, TimeoutError, OSError, RemoteProtocolError)


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark how a poll nobody awaits any more ended as seen: cancelled, or failed as we were
    cancelled, it may end with the error its closing connection raised (asyncio would log it
    as never retrieved)."""
    if not task.cancelled():
        task.exception()


class IslandNet:
    """Connects one ``Island`` to the owners of its fragments."""

    poll_wait_s = POLL_WAIT_S
    owner_check_s = OWNER_CHECK_S

    def __init__(
        self,
        island: Island,
        cfg: LearnerNetConfig,
        links: OwnerLinks,
        *,
        spreading: Spreading | None = None,
        initial: Sequence[torch.Tensor] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``links``: how to reach the owners (``OwnerLinks``: the signer, who owns what and how
        to ask them, and our own owners, reached in process, not over HTTP); ``spreading``: where
        fetched versions are kept for other learners and its counters (None: kept for nobody,
        counted here); ``initial``: version 0 of every fragment, for a first owner (the island's
        own unless it resumed)."""
        self.island, self.cfg = island, cfg
        self.stats = LearnerStats()
        spreading = spreading if spreading is not None else Spreading()
        self.spread = spreading.stats
        self.known = ReceivedVersions(
            initial if initial is not None else island.global_flat,
            wall_clock=wall_clock,
            created=cfg.created,
            max_rounds_per_s=cfg.max_rounds_per_s,
        )
        self.fetcher = VersionFetcher(cfg, links, self.known, self.stats, spreading=spreading)
        self.sender = ContributionSender(
            cfg, island, links, self.known, self.stats, resync=self.resync
        )

    # --- what the peer's other parts call ------------------------------------------------------
    def submit(self, out: Outgoing) -> None:
        """Enqueue a due fragment without waiting (safe from any thread)."""
        self.sender.submit(out)

    async def flush(self) -> None:
        """Wait until every contribution submitted so far has been sent and answered (or failed)."""
        await self.sender.flush()

    def owners_changed(self) -> int:
        """Call when the owners may have changed: resends accepted work they may have lost
        (``ContributionSender.owners_changed``)."""
        return self.sender.owners_changed()

    async def fetch(
        self,
        p: int,
        *,
        after: int,
        wait_s: float,
        final: bool = False,
        owner: tuple[bytes, str] | None = None,
    ) -> tuple[int, torch.Tensor] | None:
        """``VersionFetcher.fetch``: the owner's first version of ``p`` above ``after``."""
        return await self.fetcher.fetch(p, after=after, wait_s=wait_s, final=final, owner=owner)

    def remember(
        self, p: int, version: int, flat: torch.Tensor, digest: bytes | None = None
    ) -> None:
        """``ReceivedVersions.remember``: keep a verified version of ``p`` and its digest."""
        self.known.remember(p, version, flat, digest)

    def version_jump(self, p: int, version: int) -> str | None:
        """Why ``p``'s ``version`` cannot be an honest owner's (None when it can be)."""
        return self.known.version_jump(p, version)

    def held_state(self, p: int) -> tuple[int, bytes, torch.Tensor] | None:
        """``ReceivedVersions.held_state``: the newest version of ``p`` held, with its digest."""
        return self.known.held_state(p)

    @property
    def received(self) -> list[int]:
        """The highest version delivered, per fragment."""
        return self.known.received

    @property
    def received_at(self) -> dict[int, float]:
        """Fragment -> when its newest version arrived (wall clock)."""
        return self.known.received_at

    @property
    def latest(self) -> dict[int, tuple[int, torch.Tensor]]:
        """Fragment -> its newest verified version."""
        return self.known.latest

    @property
    def island_initial(self) -> list[torch.Tensor]:
        """Version 0 of every fragment (for a first owner)."""
        return self.known.initial

    @property
    def created(self) -> float | None:
        """The swarm's creation time, from its manifest (None: unknown)."""
        return self.cfg.created

    @property
    def residuals(self) -> dict[tuple[int, int], torch.Tensor]:
        """The contributions' error-feedback residuals, per (fragment, tensor)."""
        return self.sender.residuals

    # --- event loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Send contributions and poll every fragment's owner until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.sender.run())
            for p in range(len(self.cfg.shapes)):
                tg.create_task(self._poll_loop(p))

    async def _poll_loop(self, p: int) -> None:
        backoff = 0.2
        while True:
            try:
                after = max(self.known.received[p], self.island.versions[p])
                got = await self._poll(p, after)
                if got is not None:
                    self.known.remember(p, *got)
                    self.island.deliver(p, *got)
                    self.sender.version_came(p, got[0])
                backoff = 0.2
            except RoundDeclined as declined:  # our work is in no version: go on without it
                self.sender.declined(p, declined.base)
            except _FAILED as exc:
                if isinstance(exc, VersionRefused):
                    self.spread.refusals += 1
                elif isinstance(exc, RemoteProtocolError):
                    self.stats.bad_versions += 1
                log.debug("poll for fragment %d failed: %r", p, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _poll(self, p: int, after: int) -> tuple[int, torch.Tensor] | None:
        """One long-poll of ``p``'s owner for a version above ``after``, up to ``poll_wait_s``;
        None, with the request cancelled, as soon as our view names another owner for ``p``."""
        owner = self.fetcher.reach.owner_of(p)
        if owner is None:  # nobody to ask yet: ``fetch`` waits a second for the view to fill
            return await self.fetcher.fetch(p, after=after, wait_s=self.poll_wait_s)
        poll = asyncio.ensure_future(
            self.fetcher.fetch(p, after=after, wait_s=self.poll_wait_s, owner=owner)
        )
        try:
            while not poll.done():
                await asyncio.wait({poll}, timeout=self.owner_check_s)
                if not poll.done() and self.fetcher.reach.owner_of(p) != owner:
                    self.stats.polls_reaimed += 1
                    poll.cancel()
                    await asyncio.wait({poll})  # raises nothing; our own cancellation still does
                    if poll.cancelled():
                        return None
                    # it ended another way as it was cancelled (a version came, or the request
                    # failed as its connection closed): take what it holds, so nothing is lost
                    # and asyncio does not log an exception never retrieved
                    if poll.exception() is not None:
                        log.debug("fragment %d: a re-aimed poll ended with %r", p, poll.exception())
                        return None
                    return poll.result()
            return poll.result()
        finally:
            if not poll.done():  # we were cancelled ourselves: so is the request
                poll.cancel()
            # however it ends (it may have failed in the very turn we were cancelled), its
            # error is taken: nobody awaits it any more
            poll.add_done_callback(_retrieved)

    async def resync(self) -> int:
        """Fetch every fragment's latest version from its owner and have the island adopt them
        whole, in one step, even at the versions it holds (its own copy is not to be trusted).
        Returns how many fragments it got; one that fails is retried at its next contribution."""
        got: dict[int, tuple[int, torch.Tensor]] = {}
        for p in range(len(self.cfg.shapes)):
            try:
                version = await self.fetcher.fetch(p, after=-1, wait_s=0.0)
            except _FAILED as exc:
                log.warning("resync of fragment %d failed: %r", p, exc)
                continue
            if version is not None:
                self.known.remember(p, *version)
                got[p] = version
        self.island.deliver_many(got, force=True)
        self.stats.resyncs += 1
        return len(got)
