"""What an owner learns of its senders, and hands on to its successors.

``Reputation`` keeps, for one owner: each sender key's standing (``protocol.diloco.standing``:
refused while low), the penalties counted per sender in ``OwnerCounts`` (the report's names:
``merged``, ``clipped``, ``hurt``, ``refused_<why>`` ...), and where the merger's clip
reference came from. The reference and the standing outlive the owner: they go with each
replica state and handoff (``carried``) and a successor starts from them when plausible.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch

from node.diloco.owner_state import OwnerCounts
from node.diloco.replica import Carried
from protocol.diloco.merge import Decision, FragmentMerger
from protocol.diloco.norms import norm64
from protocol.diloco.reference import HandedNorm, starting_history
from protocol.diloco.standing import Event, Standing

__all__ = ["Reputation"]

log = logging.getLogger("node.diloco.owner")

BOUND_FLAGS = ("weight_capped", "steps_bounded", "tokens_bounded")  # counted per merged entry


class Reputation:
    """One owner's record of its senders: standing, penalties, and the clip reference's source."""

    def __init__(self, fragment: int, merger: FragmentMerger, counts: OwnerCounts) -> None:
        self.fragment, self.merger, self.counts = fragment, merger, counts
        self.standing = Standing()  # per sender key: what its work came to here
        self.reference_note = ""  # where the clip reference came from (status)

    # --- the reference and the standing, carried to successors -----------------------------------
    def start_reference(
        self,
        handed: Sequence[HandedNorm | float],
        measured: Sequence[float],
        *,
        theta: torch.Tensor,
    ) -> str:
        """Start the merger's clip reference from a predecessor's (``handed``) when it is plausible
        against ``measured`` (estimates from published updates), else from ``measured``
        (``protocol.diloco.reference``); only before the first merge. Returns why."""
        if self.counts.merges_done:
            return "this owner has merged already: its own reference stands"
        # a norm longer than the fragment itself is no honest reference (``starting_reference``)
        ceiling = norm64(theta) if handed or measured else math.inf
        reference, why = starting_history(handed, measured, ceiling=ceiling)  # senders kept
        if reference:
            self.merger.seed_reference(reference)  # logged for replay when there is a log
        if handed or measured:
            log.info("fragment %d: clip reference: %s", self.fragment, why)
        self.reference_note = why
        return why

    def take_standing(
        self, standing: tuple[tuple[bytes, ...], tuple[float, ...]], *, version: int
    ) -> None:
        """Take a predecessor's standing per sender key (what this owner saw itself wins); one
        that does not fit ``StandingConfig`` is refused whole, with the reason logged and counted."""
        try:
            self.standing.restore(*standing, version=version)
        except ValueError as exc:
            self.counts.recent.append(f"handed standing refused: {exc}")
            log.warning("fragment %d: handed standing refused: %s", self.fragment, exc)

    def carried(self, version: int) -> Carried:
        """The reference and standing to hand to a replica or successor with ``version``."""
        return self.merger.reference(), self.standing.export(version=version)

    # --- what each sender's work came to ----------------------------------------------------------
    def refused(self, sender: bytes, *, version: int) -> str | None:
        """Why ``sender`` is refused for its low standing now (counted), or None."""
        low = self.standing.refused(sender, version=version)
        if low is not None:
            self.counts.penalties[sender]["refused_standing"] += 1
        return low

    def malformed(self, sender: bytes, *, version: int, counted: str | None = None) -> None:
        """``sender``'s contribution was malformed or far out of bounds: a mark on its standing
        (and the penalty ``refused_<counted>`` when given)."""
        if counted is not None:
            self.counts.penalties[sender][f"refused_{counted}"] += 1
        self.standing.record(sender, Event.REFUSED, version=version)

    def published(
        self,
        decision: Decision,
        helped: frozenset[bytes],
        *,
        version: int,
        dissent: frozenset[bytes] = frozenset(),
    ) -> None:
        """Count a published merge per sender: its bound bits in penalties, validation's credit,
        then in standing the norm clip worst, then a claim capped to what the owner can see
        (weighted by how far past the bound), else merged cleanly (a late one is not its fault);
        a sender in ``dissent`` (its work agreed with none of its round's:
        ``protocol.diloco.agreement``) earns no merge credit and a ``DISSENT`` instead."""
        for e in decision.entries:
            counts = self.counts.penalties[e.peer]
            counts["merged"] += 1
            for flag in BOUND_FLAGS:
                counts[flag] += int(getattr(e, flag))
            counts["clipped"] += int(e.clip < e.work_scale)  # the norm clip bit (clip * work_scale)
            counts["work_capped"] += int(e.work_scale < 1.0)  # covered more than max_work_steps
            counts["late"] += int(e.staleness > 0)  # its round had closed: carried to this one
        for peer in helped:  # first: the version's one credit is the larger one
            self.counts.penalties[peer]["helped"] += 1
            self.standing.record(peer, Event.HELPED, version=version)
        for peer in dissent:
            self.counts.penalties[peer]["dissent"] += 1
            self.standing.record(peer, Event.DISSENT, version=version)
        for e in decision.entries:
            severity = None
            if e.clip < e.work_scale:
                event = Event.CLIPPED
            elif e.steps_bounded or e.tokens_bounded:  # a claim past what the owner can see (a
                # weight cap is not: it bites whichever honest learner counted the most tokens)
                event, severity = Event.BOUNDED, e.overclaim
            elif e.peer in dissent:
                continue  # recorded above, once per version
            else:
                event = Event.MERGED
            self.standing.record(e.peer, event, version=version, severity=severity)

    def rejected(
        self,
        culprits: frozenset[bytes],
        helped: frozenset[bytes],
        *,
        whole: bool,
        version: int,
        severity: Mapping[bytes, float] | None = None,
    ) -> None:
        """Count a candidate validation rejected against the senders it names (a round dropped
        whole blames no one of them: no standing lost), and for those that helped. ``severity``:
        each culprit's harm in noise margins, which weights its ``HURT``."""
        for peer in culprits:
            self.counts.penalties[peer]["round_dropped" if whole else "hurt"] += 1
            if not whole:
                weight = (severity or {}).get(peer)  # None: not measured, the whole effect
                self.standing.record(peer, Event.HURT, version=version, severity=weight)
        for peer in helped:
            self.counts.penalties[peer]["helped"] += 1
            self.standing.record(peer, Event.HELPED, version=version)

    def dropped(self, culprits: frozenset[bytes]) -> None:
        """Their contributions were dropped from a merge that failed."""
        for peer in culprits:
            self.counts.penalties[peer]["dropped"] += 1

    def status(self, *, version: int, lowest: int = 5) -> dict[str, object]:
        """The standing per sender key in short: how many are refused now, the lowest scores."""
        return {
            "keys": len(self.standing),
            "refused": self.standing.below(version=version),
            "threshold": self.standing.config.threshold,
            "lowest": [
                {"peer": p.hex()[:16], "score": round(s, 3)}
                for p, s in self.standing.lowest(lowest, version=version)
            ],
            "reference": self.reference_note,
        }
