"""Peer-level attacks for measuring issue 48's fences end to end (``atoll local --attack N:KIND``).

Unlike ``node.run.attack`` (which rewrites a learner's contributions), these act as a member of
the swarm would against the other members:

- ``forge-handoffs``: an owner-certified peer hands every other member a forged ``ReplicaState``
  for each fragment it does not own, every ``PERIOD_S``: epoch 2^62, the newest version it knows
  plus one, its own weights (the swarm's version shifted by ``SHIFT`` everywhere: recognisable,
  and ruinous if taken), every member's merged base at that version (locking their work out) and
  ``final`` set. Every forged state's digest is announced (``forged`` events), so the launcher can
  check that no owner ever published it, and every answer is counted by kind (``taken`` > 0 means
  a member took one: the fence failed).
- ``claim-address``: a learner-only member publishes its member record under another member's
  address (the owner of fragment 0's ``scheme://host:port``), so that the others pin that origin
  to its key, refuse the real owner's connections and route around it.

The peer trains like the others otherwise. ``start`` runs the attack on the node's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from node.diloco.flat import flat_digest
from node.diloco.replica import encode_state, hand_over
from protocol.wire.signing import ReplayWindow

if TYPE_CHECKING:
    from node.peer import PeerNode

__all__ = ["PEER_KINDS", "PeerAttack", "is_peer_attack"]

log = logging.getLogger("atoll.attack")

PEER_KINDS = ("forge-handoffs", "claim-address")
PERIOD_S = 2.0  # between two rounds of forged handoffs (and checks of the claimed address)
FORGED_EPOCH = 2**62
SHIFT = 1.0  # the forged weights: the swarm's version plus this, everywhere


def is_peer_attack(spec: str) -> bool:
    """Whether ``KIND[=X]`` names a peer-level attack (this module) rather than a contribution's."""
    return spec.strip().partition("=")[0] in PEER_KINDS


class PeerAttack:
    """One peer-level attack on ``node``, run on its event loop by ``start``; ``counts`` says
    what it did and how it was answered (for the peer's result)."""

    def __init__(self, kind: str, node: PeerNode, say: Callable[..., None]) -> None:
        if kind not in PEER_KINDS:
            raise ValueError(f"unknown peer attack {kind!r}; choose one of {', '.join(PEER_KINDS)}")
        self.kind, self.node, self.say = kind, node, say
        self.counts: collections.Counter[str] = collections.Counter()
        self._future: concurrent.futures.Future[None] | None = None
        self._replay = ReplayWindow()

    def start(self) -> None:
        """Run the attack on the node's event loop until ``stop`` (the node must be serving)."""
        assert self.node.loop is not None, "the node is not serving yet"
        run = self._forge_loop if self.kind == "forge-handoffs" else self._claim_loop
        self._future = asyncio.run_coroutine_threadsafe(run(), self.node.loop)

    def stop(self) -> dict[str, Any]:
        """Stop the attack; its counts."""
        if self._future is not None:
            self._future.cancel()
        return {"kind": self.kind, **dict(self.counts)}

    # --- forge-handoffs ---------------------------------------------------------------------------
    async def _forge_loop(self) -> None:
        while True:
            await asyncio.sleep(PERIOD_S)
            try:
                await self._forge_round()
            except Exception as exc:  # a measurement: keep attacking whatever one round met
                self.counts[f"round_failed_{type(exc).__name__}"] += 1
                log.warning("forge-handoffs: a round failed: %r", exc)

    async def _forge_round(self) -> None:
        node, me = self.node, self.node.signer.peer_id
        if node.membership is None or node.net is None:
            return
        members = [
            (pid, m.record.url)
            for pid, m in node.membership.members.items()
            if pid != me and m.record.url
        ]
        for p in range(len(node.plan.fragments)):
            if p in node.owners:
                continue  # its own fragments it owns honestly: the attack is on the others'
            version = node.net.received[p] + 1
            _, base = node.net.latest.get(p, (0, node.net.island_initial[p]))
            theta = (
                base.detach().float() + SHIFT
            )  # a new tensor: the learner's copy is never written to
            digest = await asyncio.to_thread(flat_digest, theta)
            state = encode_state(
                swarm=node.cfg.swarm,
                fragment=p,
                epoch=FORGED_EPOCH,
                version=version,
                digest=digest,
                theta=theta,
                momentum=torch.zeros_like(theta),
                merged={pid: version for pid in [me, *(pid for pid, _ in members)]},
                final=True,
            )
            self.say("forged", fragment=p, version=version, digest=digest.hex()[:32])
            self.counts["forged_states"] += 1
            for target in members:
                await self._send(p, target, state)

    async def _send(self, p: int, target: tuple[bytes, str], state: Any) -> None:
        self.counts["sent"] += 1
        try:
            ack = await hand_over(
                self.node.transport, self.node.signer, target, state, self._replay, timeout_s=10.0
            )
        except Exception as exc:  # refused unsigned, unreachable, ...: counted by kind
            self.counts[f"error_{type(exc).__name__}"] += 1
            return
        if ack.accepted:
            self.counts["taken"] += 1  # the fence failed: a member took a forged state
            log.warning(
                "forge-handoffs: %s TOOK the forged fragment %d: %s", target[1], p, ack.reason
            )
        else:
            why = ack.reason.partition(":")[0][:40]  # "refused", "fenced", "not a member here"
            self.counts["refused" if why == "refused" else f"refused_{why}"] += 1

    # --- claim-address ----------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        """Claim the address of the owner of fragment 0 (another member) in our member record:
        ``SwarmPresence`` republishes a record whose address changed at once."""
        node, me = self.node, self.node.signer.peer_id
        while True:
            await asyncio.sleep(PERIOD_S)
            if node.membership is None:
                continue
            owner = node.membership.owner_of(node.cfg.swarm, 0, exclude={me})
            with contextlib.suppress(Exception):
                real = node.transport.url
                victim = owner[1] if owner is not None else None
                if victim and victim != node.public_address and victim != real:
                    node.public_address = victim
                    self.counts["claims"] += 1
                    self.say("claimed", url=victim, victim=owner[0].hex() if owner else "")
                    log.warning("claim-address: our member record now claims %s", victim)
