"""The island's network side: ship contributions, long-poll owners, deliver verified versions.

Runs on the node's event loop. ``submit`` is called from the trainer thread and only enqueues;
compression (with error feedback), sealing and sending happen here, off the trainer's path.
One long-poll per fragment asks the fragment's owner for "the next version after v", checks
the owner's signature, that the signer is the fragment's owner, the swarm, fragment and version,
then decompresses and hands the flat tensor to ``Island.deliver``.

An owner's Ack counts only when it is signed by the owner the contribution was sent to. Error
feedback is committed only when the owner accepts: a refused or undelivered contribution leaves
the residual as it was. A non-finite pseudo-gradient (a diverged island, or a poisoned version it
adopted) is never sent: it is counted, logged, and the island is resynced: every fragment's
latest version is fetched from its owner and adopted whole in one step (a NaN anywhere reaches
every weight through the forward pass, so resyncing one fragment alone would be re-poisoned by
the others), with inner-optimizer moments reset where they are not finite.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import torch

from node.diloco.flat import flat_digest, flat_from_tensors, flat_is_wire_form
from node.diloco.island import Island, Outgoing
from node.diloco.spread import (
    FINAL_HELD_STATUS,
    POINTER_STATUS,
    UPDATE_NOT_HELD_STATUS,
    Holdings,
    SpreadStats,
    parse_pointer,
    pointed_version,
)
from node.wire.transport import LinkDropped, Transport
from protocol.diloco.compression import compress
from protocol.diloco.updates import apply_update
from protocol.diloco.versions import MAX_ROUNDS_PER_S, version_jump_reason
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.wire.codec import encode
from protocol.wire.messages import Ack, Contribution, FragmentState, FragmentUpdate
from protocol.wire.signing import ReplayWindow, Sealed, Signer, open_sealed, seal, split_sealed

__all__ = ["IslandNet", "LearnerStats", "UpdateNotApplicable"]

log = logging.getLogger(__name__)

DIGESTS_KEPT = 8  # versions per fragment whose state digest a learner remembers
HOLDERS_TRIED = 8  # holders asked for one version (pointers followed) before asking the owner again
HOLDER_WAIT_S = 10.0  # how long a holder may take to have the version it was named for


class LocalOwners(Protocol):
    """The fragments this peer owns, reached in process by its own learner (no HTTP, no seal)."""

    async def contribute_local(self, msg: Contribution) -> Ack:
        """Our own contribution to a fragment we own; raises ``RemoteProtocolError`` as the RPC does."""
        ...

    async def version_local(self, p: int, *, after: int, wait_s: float,
                            final: bool) -> tuple[int, torch.Tensor, bytes] | None:
        """(version, flat state, digest) of the first version of ``p`` above ``after`` (the final
        one with ``final``) within ``wait_s``, else None; raises ``RemoteProtocolError`` when
        ``p`` is not owned here (any more). The flat state is the owner's, never written to."""
        ...


class UpdateNotApplicable(RemoteProtocolError):
    """An update over a version we do not hold (or not as its owner does), or whose result does
    not hash to the owner's signed digest: the full version is fetched instead."""


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
    update_mismatches: int = 0  # updates that did not apply to our state (or hashed otherwise): full fetched
    finals_held: int = 0  # final versions the owner said we held already (nothing downloaded)
    versions_local: int = 0  # versions of fragments we own, taken from our owner in process
    skipped_nonfinite: int = 0
    resyncs: int = 0
    resent_on_owner_change: int = 0  # accepted, then its owner was gone before merging it: sent again


class IslandNet:
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
        self.latest: dict[int, tuple[int, torch.Tensor]] = {}  # newest verified version per fragment
        # version 0 (the initial weights), for a first owner: the island's own unless it resumed
        self.island_initial = [g.clone() for g in (initial if initial is not None else island.global_flat)]
        # fragment -> version -> digest of that version's state as delivered to the island: what a
        # contribution names as its base, so an owner applies it only to that very state
        self.digests: list[dict[int, bytes]] = [{0: flat_digest(g)} for g in self.island_initial]
        # fragment -> (owner that accepted its contribution, the contribution's base version, the
        # error-feedback residuals from before it): if that owner stops owning the fragment before
        # a version above the base comes, the work is sent again at once (``owners_changed``)
        self._accepted_by: dict[int, tuple[bytes, int, dict[tuple[int, int], torch.Tensor | None]]] = {}

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
            async with self._lock("fragment", out.fragment), self._lock("owner", owner[0] if owner else None):
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

    async def send(self, out: Outgoing) -> None:
        """Compress, seal and send one contribution; tell the island how it went. Never raises
        for the network's or the owner's doing (counted in ``stats`` and logged instead)."""
        try:
            await self._send(out)
        except (aiohttp.ClientError, LinkDropped, TimeoutError, OSError, RemoteProtocolError) as exc:
            self.stats.send_failures += 1
            log.warning("contribution for fragment %d not delivered: %r", out.fragment, exc)
            self.island.resolved(out.fragment, accepted=False)

    def _compress(self, out: Outgoing) -> tuple[Contribution, dict[tuple[int, int], torch.Tensor]]:
        """The contribution and the residuals it leaves (committed only if it is accepted); with
        the ``none`` codec its tensors are views of ``out.delta`` (a fresh tensor that nothing
        else writes to) and it leaves no residual (it would be zero).

        Raises ``LocalProtocolError`` for a non-finite pseudo-gradient (``compress`` checks)."""
        tensors, residuals, offset = [], {}, 0
        for i, shape in enumerate(self.shapes[out.fragment]):
            n = int(torch.Size(shape).numel())
            part = out.delta[offset:offset + n].view(shape)
            try:
                enc, residual = compress(
                    part, self.codec, block_size=self.block_size,
                    residual=self.residuals.get((out.fragment, i)), copy=False,
                )
            except LocalProtocolError as exc:
                raise LocalProtocolError(f"fragment {out.fragment}: the pseudo-gradient has NaN or Inf "
                                         f"values ({exc})") from exc
            if self.codec != "none":
                residuals[(out.fragment, i)] = residual
            tensors.append(enc)
            offset += n
        digest = self.digests[out.fragment].get(out.base_version)
        if digest is None:
            raise LocalProtocolError(f"fragment {out.fragment}: the state of base version {out.base_version} "
                                     "is not known here")
        msg = Contribution(
            swarm=self.swarm, fragment=out.fragment, base_version=out.base_version, base_digest=digest,
            tokens=out.tokens, steps=out.steps, step_time=out.step_time,
            sender_step=out.sender_step, tensors=tuple(tensors),
        )
        return msg, residuals

    def _seal_contribution(self, out: Outgoing, owner_id: bytes) -> tuple[Sealed, dict[tuple[int, int], torch.Tensor]]:
        """The contribution sealed for ``owner_id`` (who refuses one addressed to another), and
        its residuals. Raises ``LocalProtocolError`` as ``_compress``."""
        msg, residuals = self._compress(out)
        sealed = seal(encode(msg), self.signer, now=self.wall_clock(), nonce=os.urandom(16), recipient=owner_id)
        return sealed, residuals

    async def _send(self, out: Outgoing) -> None:
        owner = self.owner_of(out.fragment)
        if owner is None:
            raise RemoteProtocolError(f"no live owner for fragment {out.fragment}")
        owner_id, url = owner
        if self.tamper is not None:
            out = self.tamper(out)
        if self.local is not None and owner_id == self.signer.peer_id:
            await self._send_local(out)
            return
        try:  # one worker-thread hop: compress and seal (hashing the whole payload once)
            sealed, residuals = await asyncio.to_thread(self._seal_contribution, out, owner_id)
        except LocalProtocolError as exc:
            await self._skip(out, exc)
            return
        self.stats.contributions_sent += 1
        status, buf, used, _ = await self._request(
            owner_id, "POST", f"{url}/v1/rpc", chunks=sealed.iter_chunks(), size=sealed.size, timeout_s=60,
        )
        try:
            if status != 200:
                reason = bytes(memoryview(buf)[:used]).decode(errors="replace")
                self.stats.contributions_refused += 1
                log.info("fragment %d contribution refused (%d): %s", out.fragment, status, reason)
                self.island.resolved(out.fragment, accepted=False)
                return
            opened = open_sealed(memoryview(buf)[:used], now=self.wall_clock(), replay=self._replay,
                                 max_size=1 << 16)
        finally:
            self.transport.pool.give(buf)
        if opened.peer_id != owner_id:
            raise RemoteProtocolError(f"fragment {out.fragment}: Ack signed by {opened.peer_id.hex()[:8]}, "
                                      f"not by the owner {owner_id.hex()[:8]} it was sent to")
        reply = opened.message
        if not isinstance(reply, Ack):
            raise RemoteProtocolError(f"owner replied {type(reply).__name__}, expected Ack")
        await self._answered(out, owner_id, reply, residuals)

    async def _skip(self, out: Outgoing, exc: LocalProtocolError) -> None:
        self.stats.skipped_nonfinite += "NaN" in str(exc)
        log.warning("contribution skipped: %s; resyncing the island from the owners", exc)
        self.island.resolved(out.fragment, accepted=False)
        await self.resync()

    async def _send_local(self, out: Outgoing) -> None:
        """A contribution to a fragment we own: compressed as any (error feedback alike), handed
        to our owner in process."""
        assert self.local is not None
        try:
            msg, residuals = await asyncio.to_thread(self._compress, out)
        except LocalProtocolError as exc:
            await self._skip(out, exc)
            return
        self.stats.contributions_sent += 1
        try:
            reply = await self.local.contribute_local(msg)
        except RemoteProtocolError as exc:
            self.stats.contributions_refused += 1
            log.info("fragment %d contribution refused by our own owner: %s", out.fragment, exc.reason)
            self.island.resolved(out.fragment, accepted=False)
            return
        await self._answered(out, self.signer.peer_id, reply, residuals)

    async def _answered(self, out: Outgoing, owner_id: bytes, reply: Ack,
                        residuals: dict[tuple[int, int], torch.Tensor]) -> None:
        """The owner's answer to a contribution: commit its residuals (accepted) or free the
        fragment (refused; a base mismatch resyncs the island)."""
        if reply.accepted:
            self._accepted_by[out.fragment] = (owner_id, out.base_version,
                                               {k: self.residuals.get(k) for k in residuals})
            self.residuals.update(residuals)
            self.stats.contributions_accepted += 1
        else:
            self.stats.contributions_refused += 1
            log.info("fragment %d contribution refused: %s", out.fragment, reply.reason)
        self.island.resolved(out.fragment, accepted=reply.accepted)
        if not reply.accepted and reply.reason.startswith("resync"):
            self.stats.base_mismatches += 1
            await self.resync()  # our base state is not the owner's: take the owners' states whole

    def owners_changed(self) -> int:
        """Call when the owners may have changed (a membership pass, an unreachable owner).

        A contribution that an owner accepted but had not merged when it stopped owning the
        fragment (it failed, or retired) would be lost: the island sends its cumulative
        pseudo-gradient again at its next step, to the new owner, with the error-feedback
        residuals restored to what they were before the lost send. If the old owner had merged
        it after all, its successor knows (the handoff names merged work) and refuses it with
        "resync". Returns how many fragments are sent again."""
        resent = 0
        for p, (owner_id, base, before) in list(self._accepted_by.items()):
            if self.island.in_flight[p] is None or self.island.versions[p] > base:
                del self._accepted_by[p]  # merged (a newer version came) or already resolved
                continue
            now = self.owner_of(p)
            if now is None or now[0] == owner_id:
                continue
            del self._accepted_by[p]
            for key, residual in before.items():
                if residual is None:
                    self.residuals.pop(key, None)
                else:
                    self.residuals[key] = residual
            self.island.resend(p)
            self.stats.resent_on_owner_change += 1
            resent += 1
            log.info("fragment %d: owner %s left before merging our contribution (base %d); sending it "
                     "again to %s", p, owner_id.hex()[:8], base, now[0].hex()[:8])
        return resent

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
            except (aiohttp.ClientError, LinkDropped, TimeoutError, OSError, RemoteProtocolError) as exc:
                if isinstance(exc, RemoteProtocolError):
                    self.stats.bad_versions += 1
                log.debug("poll for fragment %d failed: %r", p, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _request(self, owner_id: bytes, method: str, url: str, **kw: Any) -> tuple[int, bytearray, int, dict[str, str]]:
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
            except (aiohttp.ClientError, LinkDropped, TimeoutError, OSError, RemoteProtocolError) as exc:
                log.warning("resync of fragment %d failed: %r", p, exc)
                continue
            if version is not None:
                self.remember(p, *version)
                got[p] = version
        self.island.deliver_many(got, force=True)
        self.stats.resyncs += 1
        return len(got)

    def remember(self, p: int, version: int, flat: torch.Tensor, digest: bytes | None = None) -> None:
        """Keep the newest verified version of fragment ``p`` (a new owner starts from it), and
        the digest of every version delivered (hashed here unless given)."""
        known = self.digests[p]
        known[version] = digest or known.get(version) or flat_digest(flat)
        for old in sorted(known)[:-DIGESTS_KEPT]:
            del known[old]
        if version > self.received[p]:
            self.received[p] = version
            self.latest[p] = (version, flat)
            self.received_at[p] = self.wall_clock()

    def version_jump(self, p: int, version: int) -> str | None:
        """Why fragment ``p``'s ``version`` cannot be an honest owner's (None when it can be)."""
        return version_jump_reason(version, held=self.received[p], held_at=self.received_at.get(p),
                                   now=self.wall_clock(), created=self.created,
                                   max_rounds_per_s=self.max_rounds_per_s)

    async def fetch(self, p: int, *, after: int, wait_s: float, final: bool = False,
                    owner: tuple[bytes, str] | None = None) -> tuple[int, torch.Tensor] | None:
        """Fetch the owner's first version of fragment ``p`` above ``after`` (verified).

        With ``final``, ask instead for the latest version once the owner declares it final: when
        we hold version ``after`` (named by its digest), the owner answers that it is the final one
        (304, and we keep it), or sends the update over it, or the full version.
        Returns None if nothing new arrived within ``wait_s``. Raises ``RemoteProtocolError``
        for a version that fails verification.
        """
        owner = owner or self.owner_of(p)
        if owner is None:
            await asyncio.sleep(min(wait_s, 1.0))
            return None
        owner_id, url = owner
        if self.local is not None and owner_id == self.signer.peer_id:
            return await self._fetch_local(p, after=after, wait_s=wait_s, final=final)
        kind = "final" if final else "next"
        upd = ""
        if self._holds(p, after):
            upd = "&update=1" + (f"&digest={self.digests[p][after].hex()}" if final else "")
        try:
            return await self._fetch(p, owner_id, url, kind, after=after, wait_s=wait_s, final=final, upd=upd)
        except UpdateNotApplicable as exc:  # take the full version instead, at once
            if self.received[p] > max(after, 0):
                return None  # another fetch (the final one, a resync) moved us past it meanwhile
            self.stats.update_mismatches += 1
            log.warning("fragment %d: %s; fetching the full version", p, exc)
            status, buf, used, _ = await self._request(
                owner_id, "GET", f"{url}/v1/fragments/{p}/{kind}?after={after}&wait=0&fallback=1",
                timeout_s=60, max_reply=self.max_message,
            )
            return await self._accept(p, owner_id, status, buf, used, after=after, final=final)

    async def _fetch_local(self, p: int, *, after: int, wait_s: float,
                           final: bool) -> tuple[int, torch.Tensor] | None:
        """A version of a fragment we own, from our owner in process (its state, not a copy)."""
        assert self.local is not None
        got = await self.local.version_local(p, after=after, wait_s=wait_s, final=final)
        if got is None or (got[0] <= after and not final):
            return None
        version, flat, digest = got
        self.digests[p][version] = digest
        self.stats.versions_received += 1
        self.stats.versions_local += 1
        return version, flat

    def _holds(self, p: int, version: int) -> bool:
        """Whether we hold fragment ``p``'s ``version`` with its state digest (an update over it
        can be applied here)."""
        held = self._held(p)
        return held[0] == version and version in self.digests[p]

    def _held(self, p: int) -> tuple[int, torch.Tensor]:
        """The newest version of fragment ``p`` we hold (version 0: the initial weights)."""
        return self.latest.get(p) or (0, self.island_initial[p])

    async def _fetch(self, p: int, owner_id: bytes, url: str, kind: str, *, after: int, wait_s: float,
                     final: bool, upd: str) -> tuple[int, torch.Tensor] | None:
        status, buf, used, headers = await self._request(
            owner_id, "GET", f"{url}/v1/fragments/{p}/{kind}?after={after}&wait={wait_s}{upd}",
            timeout_s=wait_s + 30, max_reply=self.max_message,
        )
        if status == FINAL_HELD_STATUS and final and upd:  # the version we hold (and named) is final
            self.transport.pool.give(buf)
            self.stats.finals_held += 1
            return self._held(p)
        if status == POINTER_STATUS:  # the owner served its share: fetch from the holders it names
            try:
                holders = parse_pointer(memoryview(buf)[:used])
            finally:
                self.transport.pool.give(buf)
            pointed = pointed_version(headers)
            if final and pointed is None:
                raise RemoteProtocolError(f"fragment {p}: a pointer for the final version names no version")
            got = await self._from_holders(p, owner_id, pointed - 1 if final and pointed else after, holders, upd)
            if got is not None and (not final or got[0] == pointed):
                return got
            self.spread.fallbacks_asked += 1
            status, buf, used, _ = await self._request(
                owner_id, "GET",
                f"{url}/v1/fragments/{p}/{kind}?after={after}&wait={5 if final else 0}&fallback=1{upd}",
                timeout_s=60, max_reply=self.max_message,
            )
        return await self._accept(p, owner_id, status, buf, used, after=after, final=final)

    async def _from_holders(self, p: int, owner_id: bytes, after: int,
                            holders: list[bytes], upd: str = "") -> tuple[int, torch.Tensor] | None:
        """Fragment ``p``'s first version above ``after`` from the holders named (and those they
        point at, in order), checked as the owner's; None when none served one."""
        queue, tried = collections.deque(holders), {self.signer.peer_id, owner_id}
        while queue and len(tried) < HOLDERS_TRIED + 2:
            holder = queue.popleft()
            url = self.url_of(holder) if self.url_of is not None and holder not in tried else None
            tried.add(holder)
            if url is None:
                continue
            try:
                status, buf, used, _ = await self._request(
                    holder, "GET",
                    f"{url}/v1/fragments/{p}/held?after={after}&wait={HOLDER_WAIT_S}&owner={owner_id.hex()}{upd}",
                    timeout_s=HOLDER_WAIT_S + 30, max_reply=self.max_message,
                )
            except (aiohttp.ClientError, LinkDropped, TimeoutError, OSError) as exc:
                log.debug("holder %s of fragment %d failed: %r", holder.hex()[:8], p, exc)
                continue
            try:
                if status == POINTER_STATUS:
                    try:
                        queue.extendleft(reversed(parse_pointer(memoryview(buf)[:used])))
                    finally:
                        self.transport.pool.give(buf)
                    continue
                got = await self._accept(p, owner_id, status, buf, used, after=after, final=False)
            except UpdateNotApplicable as exc:  # an update over another version: not this holder's fault
                log.debug("holder %s of fragment %d: %s", holder.hex()[:8], p, exc)
                continue
            except RemoteProtocolError as exc:
                self.spread.bad_from_holders += 1
                log.warning("holder %s served fragment %d badly: %s", holder.hex()[:8], p, exc)
                continue
            if got is not None:
                self.spread.from_holders += 1
                return got
        return None

    async def _accept(self, p: int, owner_id: bytes, status: int, buf: bytearray, used: int, *,
                      after: int, final: bool) -> tuple[int, torch.Tensor] | None:
        """Check a fetched version of fragment ``p`` as ``owner_id``'s (whoever sent it) and
        decode it; keep its bytes for others. Raises ``RemoteProtocolError``."""
        kept = False
        try:
            if status == UPDATE_NOT_HELD_STATUS:
                raise UpdateNotApplicable(f"the holder has only an update over another version of fragment {p}")
            if status == 204:
                return None
            if status != 200:
                raise RemoteProtocolError(f"answered {status} for fragment {p}")
            # one worker-thread hop: verify (the one hash of the payload), check, decode
            version, flat, digest, base = await asyncio.to_thread(self._open_version, memoryview(buf)[:used],
                                                                  p, owner_id)
            if version <= after and not final:
                raise RemoteProtocolError(f"owner sent version {version}, asked for one above {after}")
            jump = self.version_jump(p, version)
            if jump is not None:
                self.stats.version_jumps += 1
                log.warning("fragment %d: refused a version from %s: %s", p, owner_id.hex()[:8], jump)
                raise RemoteProtocolError(f"fragment {p}: {jump}")
            if self.holdings is not None:
                await self.holdings.put(p, version, buf, used, owner_id, base=base)
                kept = True
        finally:
            if not kept:
                self.transport.pool.give(buf)
        self.digests[p][version] = digest
        self.stats.versions_received += 1
        self.stats.updates_applied += base is not None
        return version, flat

    def _open_version(self, wire: memoryview, p: int, owner_id: bytes,
                      ) -> tuple[int, torch.Tensor, bytes, int | None]:
        """Verify a sealed version of fragment ``p`` as signed by ``owner_id`` (before anything
        of its body is decoded), decode it (shapes checked, NaN/Inf refused) and name it by a
        digest the owner knows it by. Returns its version, flat state, digest, and the base
        version when it came as an update.

        A full fp32 version is named by its content hash (the digest of its flat state); any
        other by the digest its signature covers (the same state always seals to the same
        message bytes), so the payload is hashed once here. An update (``FragmentUpdate``) is
        applied to the state we hold of its base, which must hash as the owner's did, and the
        result must hash to the digest the owner signed: else ``UpdateNotApplicable`` (the full
        version is fetched instead). Raises ``RemoteProtocolError``."""
        envelope, body = split_sealed(wire, max_size=self.max_message)
        if envelope.peer_id != owner_id:
            raise RemoteProtocolError(f"fragment {p} version signed by {envelope.peer_id.hex()[:8]}, not its owner")
        msg = envelope.verify_body(body).message
        if isinstance(msg, FragmentUpdate) and msg.swarm == self.swarm and msg.fragment == p:
            return msg.version, self._apply_update(p, msg), msg.state_digest, msg.base_version
        if not isinstance(msg, FragmentState) or msg.swarm != self.swarm or msg.fragment != p:
            raise RemoteProtocolError(f"owner sent the wrong message for fragment {p}")
        digest = msg.content_hash if flat_is_wire_form(msg.tensors) else envelope.digest
        return msg.version, flat_from_tensors(msg.tensors, self.shapes[p]), digest, None

    def _apply_update(self, p: int, msg: FragmentUpdate) -> torch.Tensor:
        held = self._held(p)
        if held[0] != msg.base_version or self.digests[p].get(msg.base_version) != msg.base_digest:
            raise UpdateNotApplicable(f"an update over version {msg.base_version} of fragment {p} does not "
                                      f"apply to ours (version {held[0]})")
        flat = apply_update(held[1], msg.tensors, self.shapes[p])  # DecodeError: a remote error
        if flat_digest(flat) != msg.state_digest:
            raise UpdateNotApplicable(f"fragment {p}: version {msg.version} from the update does not hash to "
                                      "the owner's signed digest")
        return flat
