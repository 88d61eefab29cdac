"""What a peer builds once it is bound and serving: its DHT node, the membership read from it,
the learner's network side and the task group everything runs in. ``PeerNode.serve`` fills it in;
the peer's services read it (all None before ``serve``, and after it for tests that drive a
service by hand)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from node.dht.kademlia import DHTNode
from node.dht.membership import Membership
from node.diloco.learner import IslandNet
from node.wire.transport import Transport
from protocol.wire.signing import Signer

__all__ = ["PeerShared", "Started"]


@dataclass(eq=False)
class Started:
    """The parts of a peer that exist only while it serves."""

    dht: DHTNode | None = None
    membership: Membership | None = None
    net: IslandNet | None = None
    tg: asyncio.TaskGroup | None = None


@dataclass(frozen=True, slots=True)
class PeerShared:
    """What every service of one peer is built with: its key (``signer``), the ``transport`` it
    asks and answers over, and the parts it ``started`` once serving (filled in later)."""

    signer: Signer
    transport: Transport
    started: Started
