"""The island's network side: ship contributions, long-poll owners, deliver verified versions.

Runs on the node's event loop. ``submit`` is called from the trainer thread and only enqueues;
compression (with error feedback), sealing and sending happen here, off the trainer's path.
One long-poll per fragment asks the fragment's owner for "the next version after v", checks
the owner's signature, that the signer is the fragment's owner, the swarm, fragment and version,
then decompresses and hands the flat tensor to ``Island.deliver`` (the fetching and checking of
versions, from owners, holders or as updates, is ``node.diloco.fetching``).

Sending one contribution, committing its error feedback when the owner's Ack accepts it, and
sending accepted work again when its owner leaves (or, synchronous, stays silent) is
``node.diloco.contributing`` (``ContributionSending``); a non-finite pseudo-gradient is never
sent and ``resync`` here has the island adopt every fragment's latest version whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch

from node.diloco.contributing import RESEND_AFTER_S, ContributionSending
from node.diloco.fetching import LocalOwners, UpdateNotApplicable, VersionFetching, VersionRefused
from node.diloco.flat import flat_digest
from node.diloco.island import Island, Outgoing
from node.diloco.spread import Holdings, SpreadStats
from node.wire.transport import LinkDropped, Transport
from protocol.diloco.versions import MAX_ROUNDS_PER_S
from protocol.errors import RemoteProtocolError
from protocol.wire.signing import ReplayWindow, Signer

__all__ = ["RESEND_AFTER_S", "IslandNet", "LearnerStats", "LocalOwners", "UpdateNotApplicable"]

log = logging.getLogger(__name__)


@dataclass
class LearnerStats:
    contributions_sent: int = 0
    contributions_accepted: int = 0
    contributions_refused: int = 0
    send_failures: int = 0
    versions_received: int = 0
    bad_versions: int = 0
    base_mismatches: int = 0  # contributions refused because their base state was not the owner's
    version_jumps: int = 0  # versions above what an owner can have reached (refused)
    updates_applied: int = 0  # versions taken as an update over the one held (not a full download)
    update_mismatches: int = (
        0  # updates that did not apply to our state (or hashed otherwise): full fetched
    )
    finals_held: int = 0  # final versions the owner said we held already (nothing downloaded)
    versions_local: int = 0  # versions of fragments we own, taken from our owner in process
    versions_replica: int = (
        0  # versions our replica store took from their owner (not downloaded again)
    )
    skipped_nonfinite: int = 0
    resyncs: int = 0
    resent_on_owner_change: int = (
        0  # accepted, then its owner was gone before merging it: sent again
    )
    resent_after_silence: int = (
        0  # synchronous: accepted, no version RESEND_AFTER_S later: sent again
    )


class IslandNet(ContributionSending, VersionFetching):
    """Connects one ``Island`` to the owners of its fragments."""

    def __init__(
        self,
        island: Island,
        transport: Transport,
        signer: Signer,
        *,
        swarm: str,
        shapes: Sequence[Sequence[tuple[int, ...]]],
        owner_of: Callable[[int], tuple[bytes, str] | None],
        codec: str = "int8",
        block_size: int = 64,
        max_message: int = 256 << 20,
        on_unreachable: Callable[[bytes], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        tamper: Callable[[Outgoing], Outgoing] | None = None,
        created: float | None = None,
        max_rounds_per_s: float = MAX_ROUNDS_PER_S,
        initial: Sequence[torch.Tensor] | None = None,
        holdings: Holdings | None = None,
        url_of: Callable[[bytes], str | None] | None = None,
        spread: SpreadStats | None = None,
        local: LocalOwners | None = None,
    ) -> None:
        # versions spread peer to peer: what we fetched is kept for others (``holdings``), and an
        # owner's pointer names holders by id, whose addresses ``url_of`` looks up in our own view
        self.holdings, self.url_of = holdings, url_of
        self.local = local  # our own owners: reached in process, not over HTTP
        self.spread = spread if spread is not None else SpreadStats()
        self.wall_clock, self.tamper = wall_clock, tamper
        # the version fence: the swarm's creation time (from its manifest) and the top merge rate
        self.created, self.max_rounds_per_s = created, max_rounds_per_s
        self.received_at: dict[int, float] = {}  # fragment -> when its newest version arrived
        self.island, self.transport, self.signer = island, transport, signer
        self.on_unreachable = on_unreachable  # told when an owner refuses connections
        self.swarm, self.shapes, self.owner_of = swarm, [list(s) for s in shapes], owner_of
        self.codec, self.block_size, self.max_message = codec, block_size, max_message
        self.stats = LearnerStats()
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}
        self._queue: asyncio.Queue[Outgoing] = asyncio.Queue()
        # contributions go out concurrently, one at a time per fragment (its residuals) and per
        # owner (an owner reads one body from us at a time, as before)
        self._sending: dict[tuple[str, object], asyncio.Lock] = {}
        try:  # built on the node's loop: submissions may queue before ``run`` starts
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._replay = ReplayWindow()
        self.received = [0] * len(self.shapes)  # highest version delivered, per fragment
        self.latest: dict[
            int, tuple[int, torch.Tensor]
        ] = {}  # newest verified version per fragment
        # version 0 (the initial weights), for a first owner: the island's own unless it resumed
        self.island_initial = [
            g.clone() for g in (initial if initial is not None else island.global_flat)
        ]
        # fragment -> version -> digest of that version's state as delivered to the island: what a
        # contribution names as its base, so an owner applies it only to that very state
        self.digests: list[dict[int, bytes]] = [{0: flat_digest(g)} for g in self.island_initial]
        # fragment -> the contribution an owner accepted and has not merged yet: if that owner
        # stops owning the fragment before a version above the base comes, the work is sent again
        # at once (``owners_changed``)
        self._accepted_by = {}
        # fragment -> an accepted contribution sent again after silence, and the residuals after
        # it: a "duplicate" refusal of the copy puts both back
        self._resent = {}

    # --- trainer thread ------------------------------------------------------------------------
    def submit(self, out: Outgoing) -> None:
        """Enqueue a due fragment without waiting (safe from any thread)."""
        if self._loop is None:
            raise RuntimeError("IslandNet.run() has not started")
        self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    # --- event loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Send contributions and poll every fragment's owner until cancelled."""
        self._loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._send_loop())
            for p in range(len(self.shapes)):
                tg.create_task(self._poll_loop(p))

    async def _send_loop(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                out = await self._queue.get()
                tg.create_task(self._send_queued(out))

    async def _send_queued(self, out: Outgoing) -> None:
        """Send one queued contribution once no other of its fragment, nor to its owner, is on
        its way: uploads to different owners overlap."""
        try:
            owner = self.owner_of(out.fragment)
            async with (
                self._lock("fragment", out.fragment),
                self._lock("owner", owner[0] if owner else None),
            ):
                await self.send(out)
        finally:
            self._queue.task_done()

    def _lock(self, kind: str, key: object) -> asyncio.Lock:
        lock = self._sending.get((kind, key))
        if lock is None:
            lock = self._sending[(kind, key)] = asyncio.Lock()
        return lock

    async def flush(self) -> None:
        """Wait until every contribution submitted so far has been sent and answered (or failed)."""
        await self._queue.join()

    async def _poll_loop(self, p: int) -> None:
        backoff = 0.2
        while True:
            try:
                after = max(self.received[p], self.island.versions[p])
                got = await self.fetch(p, after=after, wait_s=5.0)
                if got is not None:
                    self.remember(p, *got)
                    self.island.deliver(p, *got)
                backoff = 0.2
            except (
                aiohttp.ClientError,
                LinkDropped,
                TimeoutError,
                OSError,
                RemoteProtocolError,
            ) as exc:
                if isinstance(exc, VersionRefused):
                    self.spread.refusals += 1
                elif isinstance(exc, RemoteProtocolError):
                    self.stats.bad_versions += 1
                log.debug("poll for fragment %d failed: %r", p, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _request(
        self, owner_id: bytes, method: str, url: str, **kw: Any
    ) -> tuple[int, bytearray, int, dict[str, str]]:
        try:
            return await self.transport.request(method, url, **kw)
        except aiohttp.ClientConnectorError:
            if self.on_unreachable is not None:
                self.on_unreachable(owner_id)
            raise

    async def resync(self) -> int:
        """Fetch every fragment's latest version from its owner and have the island adopt them
        whole, in one step, even at the versions it holds (its own copy is not to be trusted).
        Returns how many fragments it got; one that fails is retried at its next contribution."""
        got: dict[int, tuple[int, torch.Tensor]] = {}
        for p in range(len(self.shapes)):
            try:
                version = await self.fetch(p, after=-1, wait_s=0.0)
            except (
                aiohttp.ClientError,
                LinkDropped,
                TimeoutError,
                OSError,
                RemoteProtocolError,
            ) as exc:
                log.warning("resync of fragment %d failed: %r", p, exc)
                continue
            if version is not None:
                self.remember(p, *version)
                got[p] = version
        self.island.deliver_many(got, force=True)
        self.stats.resyncs += 1
        return len(got)
