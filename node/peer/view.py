"""What a peer's services read of its view of the members (``Presence`` provides it)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["MemberView"]


class MemberView(Protocol):
    """Who owns a fragment, whom this peer routes around, and how fresh our own record is."""

    @property
    def record_published_at(self) -> float | None:
        """Monotonic time our member record was last stored (from before the store)."""
        ...

    def owner_of(self, p: int) -> tuple[bytes, str] | None:
        """Fragment ``p``'s owner in our view, suspects left out."""
        ...

    def suspects(self) -> set[bytes]:
        """Members routed around until they republish."""
        ...

    def unreachable(self, peer_id: bytes) -> None:
        """``peer_id`` refused our connection: route around it."""
        ...
