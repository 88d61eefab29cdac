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

``admit`` comes first: *who* may hand a fragment over at all (issue 48: an owner-certified key
handed itself every fragment). A handoff for fragment p is taken only from the peer this peer's
view (or its last ownership pass, or the owner it took p from) names as p's owner, or from p's
immediate predecessor (who would own p without this peer: a replica's primary, or the owner a
successor displaces). Only an owner may raise the epoch by more than one, hand a version more
than ``PREDECESSOR_LEAD`` past the newest this peer knows, supersede an owner that has merged, or
declare a version final; no
one may hand an epoch above ``MAX_EPOCH`` (a takeover adds one to the epoch it holds, which past
the wire's signed 64 bits made every later handoff, and so every merge, fail) nor a version above what the rounds since allow (``versions.version_jump_reason``), and
the bases of its merged work are clamped below the handed version.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.diloco.versions import MAX_ROUNDS_PER_S, version_jump_reason

__all__ = [
    "MAX_EPOCH",
    "PREDECESSOR_LEAD",
    "Admission",
    "HandoffView",
    "Held",
    "Judgement",
    "admit",
    "judge",
]

# A predecessor's handoff may be this many versions past the newest known here: an owner that has
# not yet seen its successor hands it the version it merged next, before publishing it (a joiner
# that synced version v and owns p at once is handed v + 1 by the owner it displaces); refusing
# that split a late joiner's swarm in two (two contents of v + 1, and the successor fenced).
PREDECESSOR_LEAD = 2
# The highest epoch a peer takes from another (a handoff, or a fence it bumps its own above): a
# takeover or a stale fence adds one each, so an honest epoch never nears it, and what is taken
# leaves 2^62 increments below the wire's signed 64-bit cap.
MAX_EPOCH = 1 << 62


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


def judge(
    held: Held | None,
    *,
    epoch: int,
    version: int,
    digest: bytes,
    fragment: int,
    successor: bool = False,
) -> Judgement:
    """Whether a replica holding ``held`` takes the handoff ``(epoch, version, digest)``.

    ``successor``: the receiver is the fragment's new owner, not yet merging, and the handoff is
    its predecessor's final state. The predecessor's epoch is then below the successor's own
    (which ``held`` records) by construction, so the epoch rule does not apply; the version and
    content rules still do."""
    if held is None:
        return Judgement(
            True, f"fragment {fragment}: took version {version} (epoch {epoch}); held nothing"
        )
    if epoch < held.epoch and not successor:
        return Judgement(
            False,
            f"fenced: fragment {fragment} is at epoch {held.epoch} here (version "
            f"{held.version}); a handoff from epoch {epoch} comes from a replaced owner",
        )
    if version < held.version:
        return Judgement(
            False,
            f"fenced: fragment {fragment} version {held.version} is held here; "
            f"version {version} is behind it",
        )
    if version == held.version and digest != held.digest:
        return Judgement(
            False,
            f"fenced: fragment {fragment} version {version} was handed over with another "
            f"content ({held.digest.hex()[:12]}, not {digest.hex()[:12]})",
        )
    if version == held.version:
        return Judgement(
            True, f"fragment {fragment}: version {version} again (epoch {epoch}); same content"
        )
    return Judgement(
        True, f"fragment {fragment}: took version {version} (epoch {epoch}); held {held.version}"
    )


@dataclass(frozen=True, slots=True)
class HandoffView:
    """Who this peer's view names for one fragment, as ``admit`` needs it.

    ``owners``: the peers named as the fragment's owner, by the view now or by the last ownership
    pass (and the owner this peer took the fragment from); this peer's own id is ignored.
    ``predecessor``: who would own the fragment without this peer (a replica's primary, or the
    owner this peer displaces), or None. ``merged``: this peer owns the fragment and has merged.
    ``sources``: while this peer owns the fragment and has not merged, the members it asks for its
    predecessor's newer versions (its catch-up): the one that did own it may not be the one ranked
    first without us (it owned while alone, say), and its handoff as it retires is what ends our
    hold on the first merge. They hand over as a predecessor does (bounded epoch and version)."""

    me: bytes
    owners: frozenset[bytes]
    predecessor: bytes | None
    merged: bool = False
    sources: frozenset[bytes] = frozenset()


@dataclass(frozen=True, slots=True)
class Admission:
    """Whether a handoff may be judged at all; ``kind`` names a refusal for counting ("" when
    admitted); ``final`` and ``merged_bases`` are what of the handoff is honoured."""

    accepted: bool
    kind: str
    reason: str
    final: bool = False
    merged_bases: tuple[int, ...] = ()


def admit(
    sender: bytes,
    view: HandoffView,
    held: Held | None,
    *,
    fragment: int,
    epoch: int,
    version: int,
    final: bool,
    merged_bases: tuple[int, ...],
    known_version: int,
    received: int,
    received_at: float | None,
    created: float | None,
    now: float,
    max_rounds_per_s: float = MAX_ROUNDS_PER_S,
) -> Admission:
    """Whether ``sender``'s handoff of ``fragment`` (``epoch``, ``version``, ``final``,
    ``merged_bases``) may be taken here, before ``judge`` looks at its content.

    ``held``: the replica fence held here for the fragment; ``known_version``: the newest version
    of it this peer holds or has received. Version jumps are bounded as a learner bounds them: from
    the newest version ``received`` from the swarm (at ``received_at``, wall clock; None: never)
    and the swarm's creation time ``created`` (a fence's own version says nothing of the swarm's
    newest: a peer that owned a fragment briefly from version 0 while joining holds that)."""
    owners = view.owners - {view.me}
    is_owner = sender in owners
    predecessor = view.predecessor if view.predecessor != view.me else None
    p = fragment
    if not is_owner and not view.merged and sender != view.me and sender in view.sources:
        predecessor = sender  # one of our catch-up sources, before our first merge
    if not is_owner and sender != predecessor:
        named = ", ".join(sorted(o.hex()[:8] for o in owners)) or "no one"
        return Admission(
            False,
            "not-entitled",
            f"refused: this peer's view names {named} as fragment {p}'s owner and "
            f"{predecessor.hex()[:8] if predecessor else 'no one'} as its predecessor; "
            f"a handoff from {sender.hex()[:8]} is not taken",
        )
    held_epoch = held.epoch if held is not None else -1
    if not is_owner and epoch > held_epoch + 1:
        return Admission(
            False,
            "epoch-jump",
            f"refused: fragment {p} is at epoch {held_epoch} here; only its owner may hand it "
            f"over at epoch {epoch} (its predecessor at most {held_epoch + 1})",
        )
    if epoch > MAX_EPOCH:
        return Admission(
            False,
            "epoch-cap",
            f"refused: fragment {p} handed at epoch {epoch}, past the {MAX_EPOCH} any peer takes",
        )
    jump = version_jump_reason(
        version,
        held=received,
        held_at=received_at,
        now=now,
        created=created,
        max_rounds_per_s=max_rounds_per_s,
    )
    if jump is not None:
        return Admission(False, "version-jump", f"refused: fragment {p}: {jump}")
    if not is_owner and version > known_version + PREDECESSOR_LEAD:
        return Admission(
            False,
            "ahead-of-known",
            f"refused: fragment {p} version {version} is not known here (newest {known_version}); "
            f"a predecessor hands over at most {PREDECESSOR_LEAD} versions beyond it, only the "
            f"owner more",
        )
    if view.merged and not is_owner:
        return Admission(
            False,
            "owner-merged",
            f"refused: this peer owns fragment {p} and has merged; only an owner in its view "
            f"may hand it a state",
        )
    cap = max(version - 1, 0)  # work merged into version v was measured against v - 1 or older
    return Admission(
        True,
        "",
        f"fragment {p}: handoff from {'owner' if is_owner else 'predecessor'} "
        f"{sender.hex()[:8]} admitted",
        final=final and is_owner,
        merged_bases=tuple(min(b, cap) for b in merged_bases),
    )
