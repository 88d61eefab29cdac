"""``PeerStatus``: one frozen reading of a peer, all that its status page and ``/metrics`` show.

The board, the metrics and the page read a ``PeerStatus``, never the peer itself; the peer builds
it (``node.peer.status.PeerReader``), so ``node/status/`` knows nothing of a peer's insides.

Every string another peer chose (a lab name, an address, a role) is cut to a few hundred
characters (``cut``), and the member list to ``MAX_MEMBERS`` (``members_total`` says how many
there are), so a snapshot is small whatever the swarm holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node.status.totals import Totals

__all__ = [
    "MAX_MEMBERS",
    "MAX_TEXT",
    "FragmentStatus",
    "MemberStatus",
    "cut",
    "PeerStatus",
]

MAX_MEMBERS = 256  # members listed (``members_total`` says how many there are)
MAX_TEXT = 200  # characters of any string another peer chose
MAX_ROLES = 8
STANDING_LOWEST = 3  # the lowest standing scores shown per fragment owned


def cut(value: object, limit: int = MAX_TEXT) -> str:
    """``value`` as text of at most ``limit`` characters (strings another peer chose)."""
    return str(value)[:limit]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberStatus:
    """One member as this peer sees it (strings cut); ``is_self``: this peer's own record."""

    peer_id: str  # hex
    lab: str  # from its certificate; "" without one
    url: str
    roles: tuple[str, ...]
    reachable: bool
    learning: bool
    step: int
    is_self: bool
    suspect: bool  # it refused this peer's connections lately


@dataclass(frozen=True, slots=True, kw_only=True)
class FragmentStatus:
    """One fragment: who owns it, the version this peer's island holds, and, when this peer owns
    it, the version, epoch and standing (senders refused, the lowest scores) of its owner."""

    fragment: int
    owner_id: str | None  # hex
    owner_url: str | None
    version: int | None  # the island's
    owned: int | None
    epoch: int | None
    standing: dict[str, Any] | None  # ``FragmentOwner.standing_status``: JSON-ready


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerStatus:
    """One reading of a peer (see the module docstring)."""

    swarm: str
    peer_id: str  # hex
    url: str
    reachable: bool
    learning: bool
    step: int
    members: tuple[MemberStatus, ...]  # this peer first, then by peer id; at most MAX_MEMBERS
    members_total: int
    versions: tuple[int, ...]  # the island's, per fragment (empty before it serves)
    fragments: tuple[FragmentStatus, ...]
    totals: Totals
