"""What a peer builds once it is bound and serving: its DHT node, the membership read from it,
the learner's network side and the task group everything runs in. ``PeerNode.serve`` fills it in;
the peer's services read it (all None before ``serve``, and after it for tests that drive a
service by hand)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from node.dht.kademlia import DHTNode
from node.dht.membership import Membership
from node.diloco.learner import IslandNet
from node.wire.transport import Transport
from protocol.wire.signing import Signer

__all__ = ["PeerShared", "Started"]

T = TypeVar("T")


@dataclass(eq=False)
class Started:
    """The parts of a peer that exist only while it serves."""

    dht: DHTNode | None = None
    membership: Membership | None = None
    net: IslandNet | None = None
    tg: asyncio.TaskGroup | None = None

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
        """``coro`` as a task of the peer's group; None (and ``coro`` closed, never run) when
        the peer is not serving or its group is closing: work scheduled by a callback while the
        peer stops is dropped, not left as a coroutine nobody awaits."""
        if self.tg is not None:
            try:
                return self.tg.create_task(coro)
            except RuntimeError:  # the group is finished or shutting down
                pass
        coro.close()
        return None


@dataclass(frozen=True, slots=True)
class PeerShared:
    """What every service of one peer is built with: its key (``signer``), the ``transport`` it
    asks and answers over, and the parts it ``started`` once serving (filled in later)."""

    signer: Signer
    transport: Transport
    started: Started
