"""Fetching versions (``VersionFetcher``, held by ``IslandNet``): from a fragment's owner, from the
holders it points at, or, for fragments this peer owns, from its own owner in process; as the full state or
as the owner's update over the version held (``protocol.diloco.updates``).

Everything fetched is checked as the owner's before it counts: its signature (the owner this
learner's view names, whoever sent the bytes), swarm, fragment and version, the version fence,
shapes and finiteness, and for an update the digest of its base and of its result. An update
that does not apply here is not the sender's fault (``UpdateNotApplicable``): the full version is
fetched instead.

A version that passes the checks is kept for other learners as the pooled buffer it arrived in
(``Reply.take``, then ``Holdings.put``), not a copy; it is verified on a worker thread through
``Reply.settle``, so a cancelled fetch does not give its buffer back while the thread reads it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import numpy as np
import torch

from node.diloco.flat import (
    flat_digest,
    flat_from_tensors,
    flat_is_wire_form,
    new_flat,
    wire_flat_span,
)
from node.diloco.learner_config import LearnerNetConfig, LearnerStats
from node.diloco.reach import Reach
from node.diloco.received import ReceivedVersions
from node.diloco.replica import Handed
from node.diloco.spread import (
    DECLINED_STATUS,
    FINAL_HELD_STATUS,
    POINTER_STATUS,
    REPLICA_HELD_STATUS,
    UPDATE_NOT_HELD_STATUS,
    Spreading,
    parse_pointer,
    pointed_version,
)
from node.wire.bodies import keep_while_viewed
from node.wire.transport import LinkDropped, Reply
from protocol.diloco.norms import all_finite
from protocol.diloco.updates import apply_update
from protocol.errors import DecodeError, RemoteProtocolError
from protocol.wire.messages import Ack, Contribution, FragmentState, FragmentUpdate
from protocol.wire.signing import Signer, split_sealed
from protocol.wire.tensors import EncodedTensor

__all__ = [
    "LocalOwners",
    "OwnerLinks",
    "RoundDeclined",
    "UpdateNotApplicable",
    "VersionFetcher",
    "VersionRefused",
]

log = logging.getLogger("node.diloco.learner")

HOLDERS_TRIED = 8  # holders asked for one version (pointers followed) before asking the owner again
HOLDER_WAIT_S = 10.0  # how long a holder may take to have the version it was named for


class LocalOwners(Protocol):
    """The fragments this peer owns, reached in process by its own learner (no HTTP, no seal)."""

    async def contribute_local(self, msg: Contribution, flat: torch.Tensor | None = None) -> Ack:
        """Our own contribution to a fragment we own; raises ``RemoteProtocolError`` as the RPC does.
        ``flat``: its tensors as one flat fp32 vector, when they are views of one (``none``): taken
        as it is, not copied (nothing writes to it; the owner never reuses it for another)."""
        ...

    async def version_local(
        self, p: int, *, after: int, wait_s: float, final: bool
    ) -> tuple[int, torch.Tensor, bytes] | None:
        """(version, flat state, digest) of the first version of ``p`` above ``after`` (the final
        one with ``final``) within ``wait_s``, else None; raises ``RemoteProtocolError`` when
        ``p`` is not owned here (any more). The flat state is the owner's, never written to."""
        ...

    def replica_version(self, p: int, owner_id: bytes) -> Handed | None:
        """``p``'s state as ``owner_id`` handed it to this peer as its replica, else None. The
        flat state is never written to."""
        ...


@dataclass(frozen=True, slots=True)
class OwnerLinks:
    """How a learner reaches the owners of its fragments: its contributions sealed with
    ``signer`` and sent, and versions asked for, over ``reach``; or, to an owner that is this
    peer (``signer``'s id), in process through ``local`` (None: this peer owns nothing)."""

    signer: Signer
    reach: Reach
    local: LocalOwners | None = None


class RoundDeclined(Exception):
    """The owner of ``fragment`` declined (validation) the candidate that held our work on
    ``base``: no version will hold it. Not a fault: the learner goes on from the version it holds."""

    def __init__(self, fragment: int, base: int) -> None:
        super().__init__(f"fragment {fragment}: the owner declined our work on version {base}")
        self.fragment, self.base = fragment, base


class VersionRefused(RemoteProtocolError):
    """The owner (or a holder) refused a version for now (429: busy, or its uploads of the
    version are spent and no holder served it): not a fault of the version, the learner waits
    and asks again."""


class UpdateNotApplicable(RemoteProtocolError):
    """An update over a version we do not hold (or not as its owner does), or whose result does
    not hash to the owner's signed digest: the full version is fetched instead."""


@dataclass(frozen=True, slots=True)
class _Pointer:
    """A 303: the holders an owner (or holder) pointed at, and the version it names (if any)."""

    holders: list[bytes]
    version: int | None


@dataclass(frozen=True, slots=True)
class _ReplicaHeld:
    """A 208: our replica store took the version from its owner (nothing was sent)."""


def _declined_base(headers: Mapping[str, str], p: int) -> int:
    """The base version a 205 names. Raises ``RemoteProtocolError`` for a missing or bad one."""
    base = pointed_version(headers)
    if base is None:
        raise RemoteProtocolError(f"fragment {p}: a declined round's answer names no base version")
    return base


class VersionFetcher:
    """Fetches and checks the versions of a learner's fragments."""

    def __init__(
        self,
        cfg: LearnerNetConfig,
        links: OwnerLinks,
        known: ReceivedVersions,
        stats: LearnerStats,
        *,
        spreading: Spreading,
    ) -> None:
        """``links``: the way to the owners (their signer's id is this peer's); ``known``: the
        versions received, which the checks read and ``fetch`` adds digests to; ``spreading``:
        where fetched versions are kept for other learners and what fetching from holders did."""
        self.cfg, self.known, self.stats = cfg, known, stats
        self.me, self.reach, self.local = links.signer.peer_id, links.reach, links.local
        self.spread, self.holdings = spreading.stats, spreading.holdings

    async def fetch(
        self,
        p: int,
        *,
        after: int,
        wait_s: float,
        final: bool = False,
        owner: tuple[bytes, str] | None = None,
    ) -> tuple[int, torch.Tensor] | None:
        """Fetch the owner's first version of fragment ``p`` above ``after`` (verified).

        With ``final``, ask instead for the latest version once the owner declares it final: when
        we hold version ``after`` (named by its digest), the owner answers that it is the final one
        (304, and we keep it), or sends the update over it, or the full version.
        Returns None if nothing new arrived within ``wait_s``. Raises ``RemoteProtocolError``
        for a version that fails verification.
        """
        owner = owner or self.reach.owner_of(p)
        if owner is None:
            await asyncio.sleep(min(wait_s, 1.0))
            return None
        owner_id, url = owner
        if self.local is not None and owner_id == self.me:
            return await self._fetch_local(p, after=after, wait_s=wait_s, final=final)
        if not final and (held := await self._from_replica(p, owner_id, after)) is not None:
            return held
        kind = "final" if final else "next"
        upd = ""
        if self.known.holds(p, after):
            upd = "&update=1" + (f"&digest={self.known.digests[p][after].hex()}" if final else "")
        try:
            return await self._fetch(
                p, owner_id, url, kind, after=after, wait_s=wait_s, final=final, upd=upd
            )
        except UpdateNotApplicable as exc:  # take the full version instead, at once
            if self.known.received[p] > max(after, 0):
                return None  # another fetch (the final one, a resync) moved us past it meanwhile
            self.stats.update_mismatches += 1
            log.warning("fragment %d: %s; fetching the full version", p, exc)
            async with self._from_owner_itself(owner_id, url, p, kind, after=after) as r:
                return await self._accept(p, owner_id, r, after=after, final=final)

    async def _fetch_local(
        self, p: int, *, after: int, wait_s: float, final: bool
    ) -> tuple[int, torch.Tensor] | None:
        """A version of a fragment we own, from our owner in process (its state, not a copy)."""
        assert self.local is not None
        got = await self.local.version_local(p, after=after, wait_s=wait_s, final=final)
        if got is None or (got[0] <= after and not final):
            return None
        version, flat, digest = got
        self.known.know(p, version, digest)
        self.stats.versions_received += 1
        self.stats.versions_local += 1
        return version, flat

    async def _from_replica(
        self, p: int, owner_id: bytes, after: int
    ) -> tuple[int, torch.Tensor] | None:
        """Fragment ``p``'s version above ``after`` as ``owner_id`` handed it to this peer's
        replica store (before publishing it: the same content, under the fence), when its state
        hashes to the digest the owner signed; else None (it is downloaded)."""
        held = self.local.replica_version(p, owner_id) if self.local is not None else None
        # never below a version received: a resync asks for "the latest" (after -1), which a
        # store entry from the owner's earlier tenure is not
        if held is None or held.version <= max(after, self.known.received[p] - 1):
            return None
        version, flat, digest = held.version, held.theta, held.digest
        if self.known.version_jump(p, version) is not None:
            return None
        if not held.hashed and await asyncio.to_thread(flat_digest, flat) != digest:
            log.warning(
                "fragment %d: version %d as handed to our replica store does not hash to its "
                "digest; downloading it",
                p,
                version,
            )
            return None
        self.known.know(p, version, digest)
        self.stats.versions_received += 1
        self.stats.versions_replica += 1
        return version, flat

    async def _fetch(
        self,
        p: int,
        owner_id: bytes,
        url: str,
        kind: str,
        *,
        after: int,
        wait_s: float,
        final: bool,
        upd: str,
    ) -> tuple[int, torch.Tensor] | None:
        """Ask the owner; follow a 208 to our replica store and a pointer to the holders."""
        asked = f"{url}/v1/fragments/{p}/{kind}?after={after}&wait={wait_s}{upd}"
        async with self.reach.reply(
            owner_id, "GET", asked, timeout_s=wait_s + 30, max_reply=self.cfg.max_message
        ) as r:
            answer = await self._answer(p, owner_id, r, after=after, final=final, upd=upd)
        if isinstance(answer, _ReplicaHeld):  # our replica store took it from the owner
            held = await self._from_replica(p, owner_id, after)
            if held is not None:
                return held
            async with self._from_owner_itself(owner_id, url, p, kind, after=after, upd=upd) as r:
                answer = await self._answer(
                    p, owner_id, r, after=after, final=final, upd=upd, replica=False
                )
        if isinstance(answer, _Pointer):  # the owner served its share: ask the holders it names
            return await self._follow(
                p, owner_id, url, kind, answer, after=after, final=final, upd=upd
            )
        assert not isinstance(answer, _ReplicaHeld)  # asked once only
        return answer

    async def _answer(
        self,
        p: int,
        owner_id: bytes,
        r: Reply,
        *,
        after: int,
        final: bool,
        upd: str,
        replica: bool = True,
    ) -> tuple[int, torch.Tensor] | _Pointer | _ReplicaHeld | None:
        """An owner's reply to a fetch: the version it sent (checked), ours when it says the
        final one is the one we hold, a pointer to holders, or (``replica``) a 208. Raises
        ``RoundDeclined`` when it declined our work."""
        if r.status == DECLINED_STATUS and not final:
            raise RoundDeclined(p, _declined_base(r.headers, p))
        if r.status == REPLICA_HELD_STATUS and not final and replica:
            return _ReplicaHeld()
        if r.status == FINAL_HELD_STATUS and final and upd:  # the version we hold is final
            self.stats.finals_held += 1
            return self.known.held(p)
        if r.status == POINTER_STATUS:
            return _Pointer(parse_pointer(r.body), pointed_version(r.headers))
        return await self._accept(p, owner_id, r, after=after, final=final)

    async def _follow(
        self,
        p: int,
        owner_id: bytes,
        url: str,
        kind: str,
        pointer: _Pointer,
        *,
        after: int,
        final: bool,
        upd: str,
    ) -> tuple[int, torch.Tensor] | None:
        """Fetch from the holders an owner pointed at; failing that, ask the owner itself."""
        pointed = pointer.version
        if final and pointed is None:
            raise RemoteProtocolError(
                f"fragment {p}: a pointer for the final version names no version"
            )
        got = await self._from_holders(
            p, owner_id, pointed - 1 if final and pointed else after, pointer.holders, upd
        )
        if got is not None and (not final or got[0] == pointed):
            return got
        self.spread.fallbacks_asked += 1
        async with self._from_owner_itself(
            owner_id, url, p, kind, after=after, wait_s=5 if final else 0, upd=upd
        ) as r:
            if r.status != POINTER_STATUS or final:
                return await self._accept(p, owner_id, r, after=after, final=final)
            # the owner's upload budget for this version is spent: the peers likely to hold it
            # by now, asked for a fallback (a holder serves each requester one)
            spent = _Pointer(parse_pointer(r.body), pointed_version(r.headers))
        got = await self._from_holders(p, owner_id, after, spent.holders, upd, fallback=True)
        if got is not None:
            return got
        raise VersionRefused(
            f"fragment {p}: the owner's uploads of version {spent.version} "
            "are spent and the peers it named did not serve it; waiting for a later one"
        )

    def _from_owner_itself(
        self,
        owner_id: bytes,
        url: str,
        p: int,
        kind: str,
        *,
        after: int,
        wait_s: float = 0,
        upd: str = "",
    ) -> AbstractAsyncContextManager[Reply]:
        """Ask the owner again with ``fallback=1``: it serves the version itself (once per
        requester and version), not a pointer or a 208."""
        return self.reach.reply(
            owner_id,
            "GET",
            f"{url}/v1/fragments/{p}/{kind}?after={after}&wait={wait_s}&fallback=1{upd}",
            timeout_s=60,
            max_reply=self.cfg.max_message,
        )

    async def _from_holders(
        self,
        p: int,
        owner_id: bytes,
        after: int,
        holders: list[bytes],
        upd: str = "",
        *,
        fallback: bool = False,
    ) -> tuple[int, torch.Tensor] | None:
        """Fragment ``p``'s first version above ``after`` from the holders named (and those they
        point at, in order), checked as the owner's; None when none served one. ``fallback``:
        ask each for a fallback (the owner pointed here instead of serving one)."""
        queue, tried = collections.deque(holders), {self.me, owner_id}
        looked: set[bytes] = set()  # ids looked up in this fetch (each once)
        upd += "&fallback=1" if fallback else ""
        while queue and len(tried) < HOLDERS_TRIED + 2:
            holder = queue.popleft()
            if holder in tried:
                continue
            tried.add(holder)
            url = self.reach.url_of(holder)
            if url is None and holder not in looked:
                # a bounded view lacks most learners: look the pointed ones up now, all those
                # queued in one lookup, not at the next membership pass (2-6 s) after this
                # fetch gave up on them and fell back to the owner
                others = (h for h in queue if h not in looked and h not in tried)
                unknown = [
                    holder,
                    *dict.fromkeys(h for h in others if self.reach.url_of(h) is None),
                ]
                looked.update(unknown)
                await self.reach.find(unknown)
                url = self.reach.url_of(holder)
            if url is not None and holder in looked:  # found by this lookup or an earlier one
                self.spread.holders_found += 1
            if url is None:
                self.spread.holders_unknown += 1
                continue
            query = f"after={after}&wait={HOLDER_WAIT_S}&owner={owner_id.hex()}{upd}"
            try:
                async with self.reach.reply(
                    holder,
                    "GET",
                    f"{url}/v1/fragments/{p}/held?{query}",
                    timeout_s=HOLDER_WAIT_S + 30,
                    max_reply=self.cfg.max_message,
                ) as r:
                    if r.status == POINTER_STATUS:
                        queue.extendleft(reversed(parse_pointer(r.body)))
                        continue
                    got = await self._accept(p, owner_id, r, after=after, final=False)
            except (aiohttp.ClientError, LinkDropped, TimeoutError, OSError) as exc:
                self.spread.holders_failed += 1
                log.debug("holder %s of fragment %d failed: %r", holder.hex()[:8], p, exc)
                continue
            except UpdateNotApplicable as exc:  # an update over another version: not its fault
                self.spread.holders_other_form += 1
                log.debug("holder %s of fragment %d: %s", holder.hex()[:8], p, exc)
                continue
            except VersionRefused as exc:  # its upload budget for the version is spent: not bad
                self.spread.holders_busy += 1
                log.debug("holder %s of fragment %d: %s", holder.hex()[:8], p, exc)
                continue
            except RemoteProtocolError as exc:
                self.spread.bad_from_holders += 1
                log.warning("holder %s served fragment %d badly: %s", holder.hex()[:8], p, exc)
                continue
            if got is not None:
                self.spread.from_holders += 1
                return got
            self.spread.holders_empty += 1
        if queue:
            self.spread.holders_exhausted += 1  # stopped at HOLDERS_TRIED
        else:
            self.spread.holders_ran_out += 1  # every holder named was asked (or skipped)
        return None

    async def _accept(
        self, p: int, owner_id: bytes, r: Reply, *, after: int, final: bool
    ) -> tuple[int, torch.Tensor] | None:
        """Check a fetched version of fragment ``p`` as ``owner_id``'s (whoever sent it) and
        decode it; keep its bytes for others (taking the reply's buffer). Raises
        ``RemoteProtocolError``."""
        if r.status == UPDATE_NOT_HELD_STATUS:
            raise UpdateNotApplicable(
                f"the holder has only an update over another version of fragment {p}"
            )
        if r.status == 204:
            return None
        if r.status == POINTER_STATUS:  # to a fallback: the owner's budget for the version is spent
            raise VersionRefused(
                f"fragment {p}: pointed at holders where the owner was asked to serve"
            )
        if r.status == 429:
            raise VersionRefused(f"fragment {p}: refused for now (429: {bytes(r.body[:300])!r})")
        if r.status != 200:
            raise RemoteProtocolError(f"answered {r.status} for fragment {p}")
        # one worker-thread hop: verify (the one hash of the payload), check, decode
        version, flat, digest, base = await r.settle(
            asyncio.to_thread(self._open_version, r.body, p, owner_id)
        )
        if version <= after and not final:
            raise RemoteProtocolError(f"owner sent version {version}, asked for one above {after}")
        jump = self.known.version_jump(p, version)
        if jump is not None:
            self.stats.version_jumps += 1
            log.warning("fragment %d: refused a version from %s: %s", p, owner_id.hex()[:8], jump)
            raise RemoteProtocolError(f"fragment {p}: {jump}")
        if self.holdings is not None:
            buf, used = r.take()
            await self.holdings.put(p, version, buf, used, owner_id, base=base)
        self.known.know(p, version, digest)
        self.stats.versions_received += 1
        self.stats.updates_applied += base is not None
        return version, flat

    def _open_version(
        self,
        wire: memoryview,
        p: int,
        owner_id: bytes,
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
        envelope, body = split_sealed(wire, max_size=self.cfg.max_message)
        if envelope.peer_id != owner_id:
            raise RemoteProtocolError(
                f"fragment {p} version signed by {envelope.peer_id.hex()[:8]}, not its owner"
            )
        opened = envelope.verify_body(body)
        msg = opened.message
        swarm = self.cfg.swarm
        if isinstance(msg, FragmentUpdate) and msg.swarm == swarm and msg.fragment == p:
            return msg.version, self._apply_update(p, msg), msg.state_digest, msg.base_version
        if not isinstance(msg, FragmentState) or msg.swarm != swarm or msg.fragment != p:
            raise RemoteProtocolError(f"owner sent the wrong message for fragment {p}")
        if msg.content_hash != opened.blobs_digest:  # the blobs are the tensors: checked at no cost
            raise RemoteProtocolError(
                f"fragment {p} version {msg.version}: its content hash is not its tensors'"
            )
        digest = msg.content_hash if flat_is_wire_form(msg.tensors) else envelope.digest
        shapes = self.cfg.shapes[p]
        flat = _flat_in_body(msg.tensors, shapes)
        if flat is None:
            flat = flat_from_tensors(msg.tensors, shapes)
        return msg.version, flat, digest, None

    def _apply_update(self, p: int, msg: FragmentUpdate) -> torch.Tensor:
        held = self.known.held(p)
        if held[0] != msg.base_version or self.known.digest(p, msg.base_version) != msg.base_digest:
            raise UpdateNotApplicable(
                f"an update over version {msg.base_version} of fragment {p} does not "
                f"apply to ours (version {held[0]})"
            )
        flat = apply_update(
            held[1], msg.tensors, self.cfg.shapes[p], out=new_flat(held[1].numel())
        )  # DecodeError: remote
        if flat_digest(flat) != msg.state_digest:
            raise UpdateNotApplicable(
                f"fragment {p}: version {msg.version} from the update does not hash to "
                "the owner's signed digest"
            )
        return flat


def _flat_in_body(
    tensors: Sequence[EncodedTensor], shapes: Sequence[tuple[int, ...]]
) -> torch.Tensor | None:
    """A full fp32 version's state as one flat view of the reply buffer it arrived in (checked
    finite), which the view keeps out of the buffer pool until it is collected
    (``keep_while_viewed``); None when its tensors do not lie end to end in one buffer. A
    version is a value that is replaced, never written into, and its buffer is otherwise only
    read (``Holdings`` serves it to other learners): adopting it in place saves a copy of the
    whole fragment, and a second fragment-sized buffer, at every version received (at 124M
    parameters the copy into fresh memory was 5-13 % of a peer's busy time in a round). Raises
    ``DecodeError`` for NaN or Inf values, as ``flat_from_tensors`` does."""
    span = wire_flat_span(tensors, shapes)
    if span is None:
        return None
    buf, offset, count = span
    array = np.frombuffer(buf, dtype=np.float32, count=count, offset=offset)
    flat = torch.from_numpy(array)
    if not all_finite(flat):
        raise DecodeError("the version holds NaN or Inf values")
    keep_while_viewed(buf, array)
    return flat
