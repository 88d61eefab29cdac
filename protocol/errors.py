"""The two kinds of error in Atoll (h11's split).

``LocalProtocolError`` is our own misuse of the protocol objects: a bug on this side, so it
raises and is not caught by the node. ``RemoteProtocolError`` is a peer's misbehaviour: bad bytes,
a bad signature, a replay, an oversized or stale message. The node turns it into a 4xx reply,
counts it, may penalise the peer, and keeps running. Every remote error carries a ``reason``
that says what was wrong, and a ``penalty`` the node may charge the sender.
"""

from __future__ import annotations

__all__ = [
    "BadSignature",
    "DecodeError",
    "LocalProtocolError",
    "NotAuthorized",
    "Oversize",
    "RemoteProtocolError",
    "Replay",
    "Stale",
    "UnknownFragment",
]


class LocalProtocolError(Exception):
    """This side used a protocol object wrongly (a bug here, not a peer's fault)."""


class RemoteProtocolError(Exception):
    """A peer sent something we refuse; ``reason`` says what, ``penalty`` how bad."""

    status: int = 400

    def __init__(self, reason: str, penalty: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.penalty = penalty

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason!r})"


class DecodeError(RemoteProtocolError):
    """Bytes that are not a valid Atoll message: malformed, truncated, unknown type or field."""


class BadSignature(RemoteProtocolError):
    """An envelope whose signature or content hash does not verify."""

    status = 401


class Replay(RemoteProtocolError):
    """An envelope seen before, or one whose timestamp lies outside the allowed clock skew."""

    status = 409


class Oversize(RemoteProtocolError):
    """A message, field or tensor larger than the configured cap."""

    status = 413


class Stale(RemoteProtocolError):
    """A contribution or record based on a version too old to use; the peer should resync."""

    status = 409


class NotAuthorized(RemoteProtocolError):
    """A sender that is not a member of this swarm, or not allowed this action."""

    status = 403


class UnknownFragment(RemoteProtocolError):
    """A message about a fragment that does not exist in this swarm's plan, or is not ours."""

    status = 404
