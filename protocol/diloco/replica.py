"""Owner replicas: which handoffs a replica takes, so that no version is published with two contents.

Theory of operation (primary-backup with the backup as the fence). Every fragment has an owner
(the primary) and a replica, the next member by rendezvous hash. Before the primary publishes
version v it hands the replica its whole state at v (global fragment, outer momentum, digest,
epoch), and publishes only once the replica took it. When the primary fails, the replica takes
over from exactly that state, under a higher epoch, and serves the same versions. A primary that
a view change or a partition left running hands its next version to the replica and is refused:
the replica has seen a higher epoch (the takeover) or already holds that version with another
content, so the old primary learns it is fenced and stops publishing. A version number is
therefore published with one content only, whoever publishes it.

``judge`` is that rule, pure: a handoff ``(epoch, version, digest)`` is taken when its epoch is
not below the held one and it moves the version forward; the same version with the same digest
is taken again (a retry); the same version with another digest, or an older epoch, is refused
with the reason ("fenced: ..."). An owner records every version it publishes the same way, so
after it retires it refuses a second content for any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Held", "Judgement", "judge"]


@dataclass(frozen=True, slots=True)
class Held:
    """What a replica holds for one fragment."""

    epoch: int
    version: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class Judgement:
    accepted: bool
    reason: str


def judge(held: Held | None, *, epoch: int, version: int, digest: bytes, fragment: int,
          successor: bool = False) -> Judgement:
    """Whether a replica holding ``held`` takes the handoff ``(epoch, version, digest)``.

    ``successor``: the receiver is the fragment's new owner, not yet merging, and the handoff is
    its predecessor's final state. The predecessor's epoch is then below the successor's own
    (which ``held`` records) by construction, so the epoch rule does not apply; the version and
    content rules still do."""
    if held is None:
        return Judgement(True, f"fragment {fragment}: took version {version} (epoch {epoch}); held nothing")
    if epoch < held.epoch and not successor:
        return Judgement(False, f"fenced: fragment {fragment} is at epoch {held.epoch} here (version "
                                f"{held.version}); a handoff from epoch {epoch} comes from a replaced owner")
    if version < held.version:
        return Judgement(False, f"fenced: fragment {fragment} version {held.version} is held here; "
                                f"version {version} is behind it")
    if version == held.version and digest != held.digest:
        return Judgement(False, f"fenced: fragment {fragment} version {version} was handed over with another "
                                f"content ({held.digest.hex()[:12]}, not {digest.hex()[:12]})")
    if version == held.version:
        return Judgement(True, f"fragment {fragment}: version {version} again (epoch {epoch}); same content")
    return Judgement(True, f"fragment {fragment}: took version {version} (epoch {epoch}); held {held.version}")
