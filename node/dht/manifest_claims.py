"""Which members' claims of a newer swarm manifest to follow, and when to stop asking one.

Every member record carries the version of the swarm manifest its member holds, and a member
holding a higher one than ours is asked for it (``Presence.follow_manifest``). A claim is
free to make and says nothing until the founder's signature over what the member serves
verifies, while asking costs a request and a parse (up to ``MAX_MANIFEST_BYTES`` of TOML). A
record claiming version 2^63-1 once made every peer fetch and parse its URL every membership
pass, and since only the highest claim was tried, a founder's revocation held by honest members
was never adopted while the lie stood. So:

- a claim more than ``MAX_MANIFEST_STEP`` above our version is ignored (a founder's edits come
  a few a day; a running member follows each within a pass);
- claims are tried highest first, at most ``per_pass`` a pass, and one that fails does not hide
  the lower ones;
- a member whose claim failed (no answer, a bad signature, nothing newer than ours) is not asked
  again until it has published a new record since *and* a backoff has passed (``backoff_s``,
  doubling with each failure up to ``backoff_max_s``): one liar costs a peer one fetch per window.

Bookkeeping only: the time is passed in, the fetching is the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from node.dht.membership import Member
from protocol.wire.membership import MAX_MANIFEST_STEP

__all__ = ["ManifestClaims"]


@dataclass(slots=True)
class _Failed:
    expires_at: float  # the failed record's expiry: a record published since expires later
    retry_at: float
    failures: int


class ManifestClaims:
    """Members' manifest version claims worth fetching now, and their failures (see the module
    docstring). Counters: ``ignored`` (claims too far above ours), ``backed_off`` (claims skipped
    while their member is backed off), ``failures`` and ``adopted``."""

    def __init__(
        self,
        *,
        step: int = MAX_MANIFEST_STEP,
        backoff_s: float = 30.0,
        backoff_max_s: float = 600.0,
        per_pass: int = 3,
    ) -> None:
        self.step, self.backoff_s, self.backoff_max_s, self.per_pass = (
            step,
            backoff_s,
            backoff_max_s,
            per_pass,
        )
        self._failed: dict[bytes, _Failed] = {}
        self.ignored = self.backed_off = self.failures = self.adopted = 0

    def candidates(self, members: Iterable[Member], ours: int, now: float) -> list[Member]:
        """The members to ask, highest claim first (at most ``per_pass``): those with an address
        whose claim is above ``ours`` by at most ``step`` and that are not backed off."""
        members = list(members)
        live = {m.peer_id for m in members}
        for pid in [pid for pid in self._failed if pid not in live]:  # left: forget it
            del self._failed[pid]
        chosen = []
        for m in members:
            claim = m.record.manifest_version
            if not m.record.url or claim <= ours:
                continue
            if claim > ours + self.step:
                self.ignored += 1
                continue
            failed = self._failed.get(m.peer_id)
            if failed is not None and (m.expires_at <= failed.expires_at or now < failed.retry_at):
                self.backed_off += 1
                continue
            chosen.append(m)
        chosen.sort(key=lambda m: (-m.record.manifest_version, m.peer_id))
        return chosen[: self.per_pass]

    def failed(self, member: Member, now: float) -> float:
        """``member``'s claim failed at ``now``; returns when it may be asked again at the
        earliest (and only once it has published a new record)."""
        before = self._failed.get(member.peer_id)
        failures = 1 if before is None else before.failures + 1
        wait = min(self.backoff_s * 2 ** (failures - 1), self.backoff_max_s)
        self._failed[member.peer_id] = _Failed(member.expires_at, now + wait, failures)
        self.failures += 1
        return now + wait

    def succeeded(self, member: Member) -> None:
        """``member`` handed us a newer manifest."""
        self._failed.pop(member.peer_id, None)
        self.adopted += 1

    def status(self) -> dict[str, int]:
        return {
            "manifest_claims_ignored": self.ignored,
            "manifest_claims_backed_off": self.backed_off,
            "manifest_claim_failures": self.failures,
            "manifest_claims_adopted": self.adopted,
            "members_backed_off": len(self._failed),
        }
