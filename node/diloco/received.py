"""What versions a learner has received: per fragment the newest verified one, when it came, and
the state digests of recent ones (a contribution names its base by digest; an update applies only
over a state that hashes as the owner's did)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from node.diloco.flat import flat_digest
from protocol.diloco.versions import MAX_ROUNDS_PER_S, version_jump_reason

__all__ = ["DIGESTS_KEPT", "ReceivedVersions"]

DIGESTS_KEPT = 8  # versions per fragment whose state digest a learner remembers


class ReceivedVersions:
    """Per fragment, the newest version received and the digests of the versions delivered."""

    def __init__(
        self,
        initial: Sequence[torch.Tensor],
        *,
        wall_clock: Callable[[], float] = time.time,
        created: float | None = None,
        max_rounds_per_s: float = MAX_ROUNDS_PER_S,
    ) -> None:
        """``initial``: version 0 of every fragment (the initial weights), held as given, not
        copied: a version is a value that is replaced, never written into (the island's
        ``global_flat``, which it usually is, too), and a copy was a whole model's fp32 bytes
        until every fragment's first version came (docs/scale.md)."""
        self.wall_clock = wall_clock
        # the version fence: the swarm's creation time (from its manifest) and the top merge rate
        self.created, self.max_rounds_per_s = created, max_rounds_per_s
        self.initial = list(initial)
        self.received = [0] * len(self.initial)  # highest version delivered, per fragment
        self.received_at: dict[int, float] = {}  # fragment -> when its newest version arrived
        self.latest: dict[int, tuple[int, torch.Tensor]] = {}  # newest verified version
        # fragment -> version -> digest of that version's state as delivered to the island: what a
        # contribution names as its base, so an owner applies it only to that very state
        self.digests: list[dict[int, bytes]] = [{0: flat_digest(g)} for g in self.initial]

    def remember(
        self, p: int, version: int, flat: torch.Tensor, digest: bytes | None = None
    ) -> None:
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
            # version 0 serves only until a later one is held (``held``; ``latest`` keeps its
            # entries): its copy is a whole model's fp32 bytes once every fragment moved on
            self.initial[p] = self.initial[p].new_empty(0)

    def know(self, p: int, version: int, digest: bytes) -> None:
        """The digest of fragment ``p``'s ``version``, verified as the owner's."""
        self.digests[p][version] = digest

    def digest(self, p: int, version: int) -> bytes | None:
        """The state digest of fragment ``p``'s ``version``, when it is known here."""
        return self.digests[p].get(version)

    def version_jump(self, p: int, version: int) -> str | None:
        """Why fragment ``p``'s ``version`` cannot be an honest owner's (None when it can be)."""
        return version_jump_reason(
            version,
            held=self.received[p],
            held_at=self.received_at.get(p),
            now=self.wall_clock(),
            created=self.created,
            max_rounds_per_s=self.max_rounds_per_s,
        )

    def held(self, p: int) -> tuple[int, torch.Tensor]:
        """The newest version of fragment ``p`` we hold (version 0: the initial weights)."""
        return self.latest.get(p) or (0, self.initial[p])

    def holds(self, p: int, version: int) -> bool:
        """Whether we hold fragment ``p``'s ``version`` with its state digest (an update over it
        can be applied here)."""
        return self.held(p)[0] == version and version in self.digests[p]

    def held_state(self, p: int) -> tuple[int, bytes, torch.Tensor] | None:
        """The newest version of fragment ``p`` this learner holds, with its verified state
        digest, as ``(version, digest, flat)`` (a replica here applies an owner's update handoff
        over it); None when its digest is not known."""
        version, flat = self.held(p)
        digest = self.digests[p].get(version)
        return None if digest is None else (version, digest, flat)
