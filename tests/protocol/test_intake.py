"""An owner's screening before its merger (``protocol.diloco.intake``): pure, with ``now`` passed."""

from __future__ import annotations

from protocol.diloco.intake import (
    FINAL_HOLD_S,
    LAST_SENDERS_KEPT,
    OUT_OF_BOUNDS,
    OWED_SERVES_PER_VERSION,
    RESYNCS_OWED_KEPT,
    FinalHold,
    LastMarks,
    ResyncLedger,
    already_merged,
    base_mismatch,
    out_of_bounds,
)

A, B = b"a" * 32, b"b" * 32


def test_a_norm_far_past_the_reference_is_refused_with_its_figures() -> None:
    assert out_of_bounds(OUT_OF_BOUNDS * 2.0, reference=2.0, theta_norm=1e9, fragment=3) is None
    why = out_of_bounds(OUT_OF_BOUNDS * 2.0 + 1, reference=2.0, theta_norm=0.0, fragment=3)
    assert why is not None and "median" in why and "fragment 3" in why
    # with no reference yet, |Theta| is the basis
    why = out_of_bounds(OUT_OF_BOUNDS * 5.0, reference=None, theta_norm=4.0, fragment=0)
    assert why is not None and "|Theta|" in why
    assert out_of_bounds(1e30, reference=None, theta_norm=0.0, fragment=0) is None  # no basis


def test_a_base_held_under_another_digest_or_unknown_is_a_resync() -> None:
    digests = {4: {b"x" * 32}, 5: {b"y" * 32, b"z" * 32}}

    def why(base: int, digest: bytes) -> str | None:  # an owner at version 5 keeping 4 versions
        return base_mismatch(base, digest, digests=digests, version=5, keep=4, fragment=1)

    assert why(5, b"z" * 32) is None
    wrong = why(5, b"x" * 32)
    assert wrong is not None and wrong.startswith("resync:") and "measured against" in wrong
    unknown = why(3, b"x" * 32)
    assert unknown is not None and "not known here (this owner starts at version 4)" in unknown
    assert why(2, b"x" * 32) is None  # older than any kept: the merger refuses it as stale


def test_work_from_a_merged_base_is_refused_once_merged() -> None:
    assert already_merged(3, None, version=5, fragment=0) is None
    assert already_merged(4, 3, version=5, fragment=0) is None
    why = already_merged(3, 3, version=5, fragment=0)
    assert why is not None and "merged already; take version 5 first" in why


def test_a_final_hold_refuses_work_until_it_lapses() -> None:
    hold, now = FinalHold(), 100.0
    assert hold.refusal(now, 0) is None and not hold.holds(7, now)
    assert hold.declare(7, now)  # newly held
    assert not hold.declare(7, now + 1.0)  # held already: not newly
    assert hold.holds(7, now + 1.0) and not hold.holds(8, now + 1.0)
    why = hold.refusal(now + 10.0, 2)
    assert why is not None and "version 7 was handed out as final 9.0 s ago" in why
    later = now + 1.0 + FINAL_HOLD_S
    assert hold.refusal(later, 2) is None and not hold.holds(7, later)
    assert hold.declare(7, later)  # a lapsed hold, declared again, is new


def test_resyncs_owed_are_capped_per_version_and_spent_by_asking() -> None:
    ledger = ResyncLedger()
    assert not ledger.spend(A) and not ledger.spend(None)
    for _ in range(OWED_SERVES_PER_VERSION):
        ledger.owe(A, 3)
        assert ledger.spend(A) and not ledger.spend(A)
    ledger.owe(A, 3)
    assert not ledger.spend(A)  # past the cap for version 3
    ledger.owe(A, 4)
    assert ledger.spend(A)  # a new version: owed again
    for i in range(RESYNCS_OWED_KEPT + 1):
        ledger.owe(i.to_bytes(32, "big"), 4)
    assert len(ledger.owed) == RESYNCS_OWED_KEPT and A not in ledger.owed  # the oldest went


def test_a_last_mark_is_honoured_once_per_sender() -> None:
    marks = LastMarks()
    assert not marks.honoured(A, False)
    assert marks.honoured(A, True)  # refused: not spent, a resend is honoured
    marks.taken(A)
    assert not marks.honoured(A, True) and marks.honoured(B, True)
    marks.spent.update(i.to_bytes(32, "big") for i in range(LAST_SENDERS_KEPT))
    assert not marks.honoured(B, True)  # past the cap, marks are ignored
