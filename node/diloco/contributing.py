"""Sending contributions (``ContributionSender``, held by ``IslandNet``): queue them from the
trainer thread, compress with error feedback, seal, send, take the owner's Ack; and send accepted
work again when it may have been lost.

Contributions go out concurrently, one at a time per fragment (its residuals) and per owner (an
owner reads one body from us at a time). Each closes its ``Outgoing.handoff`` when answered (and
marks it compressed once Δ is released), which paces fragments shipped together
(``node.diloco.ship_window``).

An owner's Ack counts only when it is signed by the owner the contribution was sent to. Error
feedback is committed only when the owner accepts: a refused or undelivered contribution leaves
the residual as it was. A non-finite pseudo-gradient (a diverged island, or a poisoned version it
adopted) is never sent: it is counted, logged, and the island is resynced: every fragment's
latest version is fetched from its owner and adopted whole in one step (a NaN anywhere reaches
every weight through the forward pass, so resyncing one fragment alone would be re-poisoned by
the others), with inner-optimizer moments reset where they are not finite.

An accepted contribution is sent again when its owner leaves before merging it
(``owners_changed``), and, for a synchronous island (``wait_for_merge``: the merge waits for
every learner) and for any island during its end-of-run flush (``Island.flushing``), also when no newer version has come ``resend_after_s()`` after the Ack
(``RESEND_AFTER_S``, or 4x the slowest recent merge once merges were seen): an owner that was
fenced off and then owned the fragment again is the same peer but a new instance that never saw
it. An owner whose validation declined a round's candidate tells the senders of the work it drops
at their next long-poll (``declined``: the island drops that work and goes on at once); silence
remains the fallback where it cannot (an unsigned poll). An owner that still holds it refuses the
copy as a duplicate, which changes nothing.
The work goes again with its fragment's error-feedback residuals dropped, not restored to what
they were before the lost send: the residuals it left count a quantisation of work that never
arrived, and keeping the ones from before every accepted send for this rare case held up to a
whole model's fp32 bytes until each version came (docs/scale.md); what is lost is at most the
quantisation error carried from before that send.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, replace

import aiohttp
import torch

from node.diloco.fetching import OwnerLinks
from node.diloco.island import Island, Outgoing
from node.diloco.learner_config import LearnerNetConfig, LearnerStats
from node.diloco.received import ReceivedVersions
from node.wire.transport import LinkDropped
from protocol.diloco.compression import compress
from protocol.diloco.device_codec import ON_DEVICE, encode_on_device, wire_tensor
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.wire.codec import encode
from protocol.wire.messages import Ack, Contribution
from protocol.wire.signing import ReplayWindow, Sealed, open_sealed, seal
from protocol.wire.tensors import EncodedTensor

__all__ = ["RESEND_AFTER_S", "RESEND_MIN_S", "ContributionSender"]

log = logging.getLogger("node.diloco.learner")

RESEND_AFTER_S = 30.0  # synchronous islands: an accepted contribution with no newer version this long is sent again
# ...or sooner once merges have been seen: RESEND_FACTOR x the slowest of the last RESEND_SAMPLES
# Ack-to-version waits, at least RESEND_MIN_S: a synchronous swarm would stand still the whole
# RESEND_AFTER_S for work an owner dropped and could not tell us about (``declined``).
RESEND_MIN_S = 5.0
RESEND_FACTOR = 4.0
RESEND_SAMPLES = 8


@dataclass(frozen=True, slots=True)
class _Accepted:
    """A contribution an owner accepted: who, on which base version, the keys of the
    error-feedback residuals it left, and when (wall clock)."""

    owner: bytes
    base: int
    keys: tuple[tuple[int, int], ...]
    at: float


class ContributionSender:
    """Sends one island's contributions to the owners of its fragments."""

    def __init__(
        self,
        cfg: LearnerNetConfig,
        island: Island,
        links: OwnerLinks,
        known: ReceivedVersions,
        stats: LearnerStats,
        *,
        resync: Callable[[], Awaitable[int]],
    ) -> None:
        """``links``: the way to the owners; ``known``: the versions received (a contribution
        names its base state's digest), whose wall clock also stamps seals and Acks (one clock
        for the learner); ``resync``: has the island adopt every fragment's latest version whole
        (after a non-finite pseudo-gradient or a base the owner does not know)."""
        self.cfg, self.island, self.known, self.stats = cfg, island, known, stats
        self.signer, self.reach, self.local = links.signer, links.reach, links.local
        self.resync, self.wall_clock = resync, known.wall_clock
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}  # error feedback, per tensor
        self._replay = ReplayWindow()
        self._queue: asyncio.Queue[Outgoing] = asyncio.Queue()
        self._sending: dict[tuple[str, object], asyncio.Lock] = {}
        try:  # built on the node's loop: submissions may queue before ``run`` starts
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        # fragment -> the contribution an owner accepted and has not merged yet: if that owner
        # stops owning the fragment before a version above the base comes, the work is sent again
        # at once (``owners_changed``)
        self._accepted_by: dict[int, _Accepted] = {}
        self._merge_waits: deque[float] = deque(maxlen=RESEND_SAMPLES)  # Ack to version, seconds
        # fragment -> an accepted contribution sent again after silence, and the residuals after
        # it: a "duplicate" refusal of the copy puts both back
        self._resent: dict[int, tuple[_Accepted, dict[tuple[int, int], torch.Tensor | None]]] = {}

    # --- trainer thread ------------------------------------------------------------------------
    def submit(self, out: Outgoing) -> None:
        """Enqueue a due fragment without waiting (safe from any thread)."""
        if self._loop is None:
            raise RuntimeError("IslandNet.run() has not started")
        self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    # --- event loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Send what is submitted, concurrently, until cancelled."""
        self._loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            while True:
                out = await self._queue.get()
                tg.create_task(self._send_queued(out))

    async def _send_queued(self, out: Outgoing) -> None:
        """Send one queued contribution once no other of its fragment, nor to its owner, is on
        its way: uploads to different owners overlap."""
        try:
            owner = self.reach.owner_of(out.fragment)
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

    async def send(self, out: Outgoing) -> None:
        """Compress, seal and send one contribution; tell the island how it went. Never raises
        for the network's or the owner's doing (counted in ``stats`` and logged instead). Closes
        ``out.handoff`` when done: its buffers no longer count against the island's window."""
        try:
            await self._send(out)
        except (
            aiohttp.ClientError,
            LinkDropped,
            TimeoutError,
            OSError,
            RemoteProtocolError,
        ) as exc:
            self.stats.send_failures += 1
            self._resent.pop(out.fragment, None)  # a copy that never arrived: nothing to put back
            log.warning("contribution for fragment %d not delivered: %r", out.fragment, exc)
            self.island.resolved(out.fragment, accepted=False)
        finally:
            if out.handoff is not None:
                out.handoff.close()

    def _compress(
        self, out: Outgoing, host_key: Hashable | None = None
    ) -> tuple[Contribution, dict[tuple[int, int], torch.Tensor]]:
        """The contribution and the residuals it leaves (committed only if it is accepted); with
        the ``none`` codec its tensors are views of ``out.delta`` (a fresh tensor that nothing
        else writes to) and it leaves no residual (it would be zero). On a staged link (a GPU)
        the codes are computed on the device and copied into ``host_key``'s host buffer (None:
        a fresh one), held until ``island.device_link.release(host_key)``.

        Raises ``LocalProtocolError`` for a non-finite pseudo-gradient (``compress`` checks)."""
        if self.island.device_link.staged and self.cfg.codec in ON_DEVICE:
            tensors, residuals = self._encode_on_device(out, host_key)
        else:
            tensors, residuals = self._encode(out)
        return self._contribution(out, tensors), residuals

    def _encode(
        self, out: Outgoing
    ) -> tuple[list[EncodedTensor], dict[tuple[int, int], torch.Tensor]]:
        """``_compress``'s tensors and residuals, encoded where ``out.delta`` lies, tensor by tensor
        (on a device: one copy of Δ to the host first, for the codecs not encoded on devices)."""
        if out.delta.device.type != "cpu":
            with self.island.device_link.side(out.ready, out.delta):
                (host,) = self.island.device_link.to_host([out.delta], None)
            out = replace(out, delta=host, ready=None)
            for key, residual in self.residuals.items():  # kept on the host from now on
                if key[0] == out.fragment and residual.device.type != "cpu":
                    self.residuals[key] = residual.cpu()
        tensors, residuals, offset = [], {}, 0
        for i, shape in enumerate(self.cfg.shapes[out.fragment]):
            n = int(torch.Size(shape).numel())
            part = out.delta[offset : offset + n].view(shape)
            try:
                enc, residual = compress(
                    part,
                    self.cfg.codec,
                    block_size=self.cfg.block_size,
                    residual=self.residuals.get((out.fragment, i)),
                    copy=False,
                )
            except LocalProtocolError as exc:
                raise LocalProtocolError(
                    f"fragment {out.fragment}: the pseudo-gradient has NaN or Inf values ({exc})"
                ) from exc
            if self.cfg.codec != "none":
                residuals[(out.fragment, i)] = residual
            tensors.append(enc)
            offset += n
        return tensors, residuals

    def _encode_on_device(
        self, out: Outgoing, host_key: Hashable | None
    ) -> tuple[list[EncodedTensor], dict[tuple[int, int], torch.Tensor]]:
        """``_encode`` on the island's device: every tensor's codes, scales and residual there
        (``encode_on_device``, on the network side's stream), then all payloads and finite flags
        to the host at once. Raises ``LocalProtocolError`` for a non-finite pseudo-gradient (or
        one whose sum overflows fp32: no finite training run comes near it)."""
        link, codec = self.island.device_link, self.cfg.codec
        shapes = self.cfg.shapes[out.fragment]
        with link.side(out.ready, out.delta):
            encoded, offset = [], 0
            for i, shape in enumerate(shapes):
                n = int(torch.Size(shape).numel())
                part = out.delta[offset : offset + n].view(shape)
                residual = self.residuals.get((out.fragment, i))
                if residual is not None and residual.device != part.device:
                    residual = residual.to(part.device)  # from a host fallback
                encoded.append(
                    encode_on_device(part, codec, block_size=self.cfg.block_size, residual=residual)
                )
                offset += n
            flags = torch.stack([e.finite for e in encoded]) if encoded else out.delta[:0].bool()
            parts = [flags] + [t for e in encoded for t in (e.data, e.scales)]
            host = link.to_host(parts, host_key)
        if not bool(host[0].all()):
            raise LocalProtocolError(
                f"fragment {out.fragment}: the pseudo-gradient has NaN or Inf values "
                "(or values whose sum overflows float32)"
            )
        tensors = [
            wire_tensor(e, _readonly_bytes(host[1 + 2 * i]), _readonly_bytes(host[2 + 2 * i]))
            for i, e in enumerate(encoded)
        ]
        residuals = (
            {}
            if codec == "none"
            else {(out.fragment, i): e.residual for i, e in enumerate(encoded)}
        )
        return tensors, residuals

    def _contribution(self, out: Outgoing, tensors: list[EncodedTensor]) -> Contribution:
        """The contribution message for ``out`` with its encoded ``tensors``. Raises
        ``LocalProtocolError`` when the state of its base version is not known here."""
        digest = self.known.digest(out.fragment, out.base_version)
        if digest is None:
            raise LocalProtocolError(
                f"fragment {out.fragment}: the state of base version {out.base_version} "
                "is not known here"
            )
        msg = Contribution(
            swarm=self.cfg.swarm,
            fragment=out.fragment,
            base_version=out.base_version,
            base_digest=digest,
            tokens=out.tokens,
            steps=out.steps,
            step_time=out.step_time,
            sender_step=out.sender_step,
            tensors=tuple(tensors),
            last=out.last,
        )
        return msg

    def _seal_contribution(
        self, out: Outgoing, owner_id: bytes
    ) -> tuple[Sealed, dict[tuple[int, int], torch.Tensor]]:
        """The contribution sealed for ``owner_id`` (who refuses one addressed to another), and
        its residuals. Raises ``LocalProtocolError`` as ``_compress``."""
        msg, residuals = self._compress(out, host_key=("out", out.fragment))
        sealed = seal(
            encode(msg),
            self.signer,
            now=self.wall_clock(),
            nonce=os.urandom(16),
            recipient=owner_id,
        )
        return sealed, residuals

    async def _send(self, out: Outgoing) -> None:
        owner = self.reach.owner_of(out.fragment)
        if owner is None:
            raise RemoteProtocolError(f"no live owner for fragment {out.fragment}")
        owner_id, url = owner
        if self.cfg.tamper is not None:
            out = self.cfg.tamper(out)
        if self.local is not None and owner_id == self.signer.peer_id:
            await self._send_local(out)
            return
        try:
            await self._send_remote(out, owner_id, url)
        finally:  # the contribution's host bytes (on a GPU) are sent or dropped: reuse them
            self.island.device_link.release(("out", out.fragment))

    async def _send_remote(self, out: Outgoing, owner_id: bytes, url: str) -> None:
        try:  # one worker-thread hop: compress and seal (hashing the whole payload once)
            sealed, residuals = await asyncio.to_thread(self._seal_contribution, out, owner_id)
        except LocalProtocolError as exc:
            await self._skip(out, exc)
            return
        self._compressed(out)
        self.stats.contributions_sent += 1
        async with self.reach.reply(
            owner_id,
            "POST",
            f"{url}/v1/rpc",
            chunks=sealed.iter_chunks(),
            size=sealed.size,
            timeout_s=60,
            kind="Contribution",
        ) as r:
            if r.status != 200:
                reason = bytes(r.body).decode(errors="replace")
                self.stats.contributions_refused += 1
                log.info(
                    "fragment %d contribution refused (%d): %s", out.fragment, r.status, reason
                )
                self.island.resolved(out.fragment, accepted=False)
                return
            opened = open_sealed(
                r.body, now=self.wall_clock(), replay=self._replay, max_size=1 << 16
            )
        if opened.peer_id != owner_id:
            raise RemoteProtocolError(
                f"fragment {out.fragment}: Ack signed by {opened.peer_id.hex()[:8]}, "
                f"not by the owner {owner_id.hex()[:8]} it was sent to"
            )
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
        self._compressed(out)
        self.stats.contributions_sent += 1
        try:
            given = (
                out.delta if self.cfg.codec == "none" and out.delta.device.type == "cpu" else None
            )
            reply = await self.local.contribute_local(msg, given)
        except RemoteProtocolError as exc:
            self.stats.contributions_refused += 1
            log.info(
                "fragment %d contribution refused by our own owner: %s", out.fragment, exc.reason
            )
            self.island.resolved(out.fragment, accepted=False)
            return
        await self._answered(out, self.signer.peer_id, reply, residuals)

    def _compressed(self, out: Outgoing) -> None:
        """``out``'s pseudo-gradient is compressed: its memory (a fragment's fp32 bytes, the
        network side's private copy) goes now, not once the upload and the owner's answer are
        done, while ``out`` is still held for them. Not with ``none``, whose message is views of
        it, nor off the CPU, where the device link still orders its use."""
        if self.cfg.codec != "none" and out.delta.device.type == "cpu":
            empty = out.delta.new_empty(0)  # the tensor made empty: its storage is released
            out.delta.set_(empty.untyped_storage(), 0, (0,), (1,))
            if out.handoff is not None:  # the island may snapshot its next fragment's Δ
                out.handoff.compressed()

    async def _answered(
        self,
        out: Outgoing,
        owner_id: bytes,
        reply: Ack,
        residuals: dict[tuple[int, int], torch.Tensor],
    ) -> None:
        """The owner's answer to a contribution: commit its residuals (accepted) or free the
        fragment (refused; a base mismatch resyncs the island)."""
        resent = self._resent.pop(out.fragment, None)
        if not reply.accepted and resent is not None and reply.reason.startswith("duplicate"):
            # the owner still holds the first copy: as if this one was never sent
            first, after = resent
            self._restore(after)
            self._accepted_by[out.fragment] = replace(first, at=self.wall_clock())
            log.info(
                "fragment %d: the owner still holds our contribution (%s)",
                out.fragment,
                reply.reason,
            )
            return
        if reply.accepted:
            self._accepted_by[out.fragment] = _Accepted(
                owner_id, out.base_version, tuple(residuals), self.wall_clock()
            )
            self.residuals.update(residuals)
            self.stats.contributions_accepted += 1
        else:
            self.stats.contributions_refused += 1
            log.info("fragment %d contribution refused: %s", out.fragment, reply.reason)
        self.island.resolved(
            out.fragment, accepted=reply.accepted, joined=reply.version if reply.accepted else -1
        )
        if not reply.accepted and reply.reason.startswith("resync"):
            self.stats.base_mismatches += 1
            await self.resync()  # our base state is not the owner's: take the owners' states whole

    def version_came(self, p: int, version: int) -> None:
        """A version of fragment ``p`` was delivered: work accepted on a base below it was merged
        and is not to be sent again (``owners_changed`` would forget it at its next call)."""
        accepted = self._accepted_by.get(p)
        if accepted is not None and version > accepted.base:
            self._merge_waits.append(max(0.0, self.wall_clock() - accepted.at))
            del self._accepted_by[p]

    def declined(self, p: int, base: int) -> None:
        """The owner of ``p`` declined (validation) the candidate holding our accepted work on
        ``base``: no version will hold it. The island drops that work and goes on from the
        version it holds at once (``Island.declined``), as if the round had published that
        version again, instead of waiting for a version that will not come and sending the
        refused work again after a silence; the residuals the send left go with it (the
        quantisation error of work no one took). Ignored unless that work is still waiting."""
        accepted = self._accepted_by.get(p)
        if accepted is None or accepted.base != base or self.island.in_flight[p] is None:
            log.debug("fragment %d: a decline of work on version %d that no longer waits", p, base)
            return
        del self._accepted_by[p]
        self._resent.pop(p, None)
        self._restore(dict.fromkeys(accepted.keys))
        self.stats.declined += 1
        log.info(
            "fragment %d: %s declined the candidate holding our work on version %d; going on "
            "from the version held",
            p,
            accepted.owner.hex()[:8],
            base,
        )
        self.island.declined(p, base)

    def resend_after_s(self) -> float:
        """How long a synchronous island waits for a version after an Ack before sending the
        work again: ``RESEND_FACTOR`` x the slowest recent merge, within [``RESEND_MIN_S``,
        ``RESEND_AFTER_S``]; ``RESEND_AFTER_S`` before any merge was seen. A copy the owner still
        holds is refused as a duplicate, so sending early costs bytes, never a double count."""
        if not self._merge_waits:
            return RESEND_AFTER_S
        return min(RESEND_AFTER_S, max(RESEND_MIN_S, RESEND_FACTOR * max(self._merge_waits)))

    def owners_changed(self) -> int:
        """Call when the owners may have changed (a membership pass, an unreachable owner).

        A contribution that an owner accepted but had not merged when it stopped owning the
        fragment (it failed, or retired) would be lost: the island sends its cumulative
        pseudo-gradient again at its next step, to the new owner, with the fragment's
        error-feedback residuals dropped (see the module docstring). If the old owner had merged
        it after all, its successor knows (the handoff names merged work) and refuses it with
        "resync". A synchronous or flushing island also sends it again, to the same owner,
        ``resend_after_s()`` without a version (see the module docstring). Returns how many
        fragments are sent again."""
        resent = 0
        wait_s = self.resend_after_s()
        for p, accepted in list(self._accepted_by.items()):
            owner_id, base, keys = accepted.owner, accepted.base, accepted.keys
            if self.island.in_flight[p] is None or self.island.versions[p] > base:
                del self._accepted_by[p]  # merged (a newer version came) or already resolved
                continue
            now = self.reach.owner_of(p)
            if now is None:
                continue
            # silence counts for a synchronous island, and for any during its end-of-run flush,
            # which would otherwise wait its whole FLUSH_WAIT_S for a declined round's version
            waits = self.island.cfg.wait_for_merge or self.island.flushing
            silent = waits and self.wall_clock() - accepted.at > wait_s
            if now[0] == owner_id and not silent:
                continue
            del self._accepted_by[p]
            if now[0] == owner_id:  # the same owner, silent: it may hold the first copy still
                self._resent[p] = (accepted, {k: self.residuals.get(k) for k in keys})
                self.stats.resent_after_silence += 1
                log.info(
                    "fragment %d: no version %.0f s after %s accepted our contribution (base %d); "
                    "sending it again",
                    p,
                    wait_s,
                    owner_id.hex()[:8],
                    base,
                )
            else:
                self.stats.resent_on_owner_change += 1
                log.info(
                    "fragment %d: owner %s left before merging our contribution (base %d); sending it "
                    "again to %s",
                    p,
                    owner_id.hex()[:8],
                    base,
                    now[0].hex()[:8],
                )
            self._restore(dict.fromkeys(keys))  # dropped: see the docstring
            self.island.resend(p)
            resent += 1
        return resent

    def _restore(self, residuals: dict[tuple[int, int], torch.Tensor | None]) -> None:
        """Put error-feedback residuals back as they were (None: none, or dropped)."""
        for key, residual in residuals.items():
            if residual is None:
                self.residuals.pop(key, None)
            else:
                self.residuals[key] = residual


def _readonly_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a 1-D host tensor (any dtype)."""
    return t.view(torch.uint8).numpy().data.toreadonly()
