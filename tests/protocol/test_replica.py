"""The replica's handoff rule: no version number ever gets two contents, whoever hands it over."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.diloco.replica import PREDECESSOR_LEAD, HandoffView, Held, admit, judge

D1, D2 = b"\x01" * 32, b"\x02" * 32


def test_forward_handoffs_are_taken_and_retries_are_idempotent() -> None:
    assert judge(None, epoch=0, version=1, digest=D1, fragment=0).accepted
    held = Held(0, 1, D1)
    assert judge(held, epoch=0, version=2, digest=D2, fragment=0).accepted
    assert judge(held, epoch=0, version=1, digest=D1, fragment=0).accepted  # the same handoff again


def test_a_replaced_owner_is_fenced() -> None:
    held = Held(epoch=3, version=7, digest=D1)  # a takeover started epoch 3
    j = judge(held, epoch=2, version=8, digest=D2, fragment=4)
    assert not j.accepted and j.reason.startswith("fenced:") and "epoch 3" in j.reason


def test_one_version_one_content() -> None:
    held = Held(epoch=1, version=5, digest=D1)
    j = judge(held, epoch=1, version=5, digest=D2, fragment=0)
    assert not j.accepted and "another content" in j.reason
    j = judge(held, epoch=2, version=5, digest=D2, fragment=0)  # not even from a higher epoch
    assert not j.accepted
    assert not judge(held, epoch=1, version=4, digest=D2, fragment=0).accepted


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.sampled_from([D1, D2])), max_size=40
    )
)
def test_no_version_is_taken_with_two_contents(handoffs: list[tuple[int, int, bytes]]) -> None:
    held: Held | None = None
    taken: dict[int, bytes] = {}
    for epoch, version, digest in handoffs:
        if judge(held, epoch=epoch, version=version, digest=digest, fragment=0).accepted:
            assert taken.setdefault(version, digest) == digest
            held = Held(epoch, version, digest)
            assert held.version >= max(taken)


def test_a_successor_takes_its_predecessors_final_state_whatever_its_epoch() -> None:
    """A new owner records its own epoch; its predecessor's final handoff comes from a lower one.
    As a successor it is taken (if it moves the version on); as a plain replica it is refused."""
    from protocol.diloco.replica import Held, judge

    held = Held(epoch=2, version=60, digest=b"a" * 32)
    assert not judge(held, epoch=1, version=61, digest=b"b" * 32, fragment=3).accepted
    assert judge(held, epoch=1, version=61, digest=b"b" * 32, fragment=3, successor=True).accepted
    assert not judge(
        held, epoch=1, version=59, digest=b"b" * 32, fragment=3, successor=True
    ).accepted
    assert not judge(
        Held(2, 61, b"a" * 32), epoch=1, version=61, digest=b"b" * 32, fragment=3, successor=True
    ).accepted  # a second content for a version is never taken


# --- admit: who may hand a fragment over (issue 48) ---------------------------------------------
ME, OWNER, PRED, ATTACKER = b"m" * 32, b"o" * 32, b"p" * 32, b"a" * 32


def _admit(
    sender: bytes, view: HandoffView, held: Held | None = Held(3, 10, D1), **kw: object
) -> object:
    args: dict[str, object] = dict(
        fragment=2,
        epoch=3,
        version=11,
        final=False,
        merged_bases=(),
        known_version=10,
        received=10,
        received_at=100.0,
        created=0.0,
        now=101.0,
    )
    args.update(kw)
    return admit(sender, view, held, **args)  # type: ignore[arg-type]


def test_a_handoff_from_neither_owner_nor_predecessor_is_refused() -> None:
    view = HandoffView(me=ME, owners=frozenset({OWNER}), predecessor=OWNER)
    a = _admit(ATTACKER, view)
    assert not a.accepted and a.kind == "not-entitled" and "not taken" in a.reason
    assert _admit(OWNER, view).accepted
    # this peer naming itself owner does not entitle anyone else
    assert not _admit(
        ATTACKER, HandoffView(me=ME, owners=frozenset({ME}), predecessor=None)
    ).accepted


def test_only_the_owner_raises_the_epoch_past_held_plus_one_or_hands_an_unknown_version() -> None:
    view = HandoffView(me=ME, owners=frozenset({ME}), predecessor=PRED)
    forged = _admit(PRED, view, epoch=2**62)
    assert not forged.accepted and forged.kind == "epoch-jump"
    assert _admit(PRED, view, epoch=4, version=10).accepted  # held + 1, a version known here
    # the version its successor has not seen yet, merged before it saw the successor: taken
    assert _admit(PRED, view, epoch=4, version=10 + PREDECESSOR_LEAD).accepted
    ahead = _admit(PRED, view, epoch=4, version=11 + PREDECESSOR_LEAD)
    assert not ahead.accepted and ahead.kind == "ahead-of-known"
    owner_view = HandoffView(me=ME, owners=frozenset({OWNER}), predecessor=OWNER)
    assert _admit(
        OWNER, owner_view, epoch=2**62, version=11
    ).accepted  # a takeover far above: the owner's


def test_handed_versions_obey_the_version_jump_fence() -> None:
    view = HandoffView(me=ME, owners=frozenset({OWNER}), predecessor=OWNER)
    a = _admit(OWNER, view, version=10 + 2 + 100)  # 1 s since version 10: at most 10 + 1 + 100
    assert not a.accepted and a.kind == "version-jump"
    assert _admit(OWNER, view, version=10 + 1 + 100).accepted


def test_final_only_from_the_owner_and_merged_bases_clamped_below_the_version() -> None:
    view = HandoffView(me=ME, owners=frozenset({OWNER}), predecessor=PRED)
    a = _admit(OWNER, view, final=True, merged_bases=(11, 3))
    assert a.accepted and a.final and a.merged_bases == (10, 3)
    view = HandoffView(me=ME, owners=frozenset({ME}), predecessor=PRED)
    b = _admit(PRED, view, version=10, epoch=4, final=True)
    assert b.accepted and not b.final


def test_an_owner_that_merged_takes_no_state_from_its_predecessor() -> None:
    view = HandoffView(me=ME, owners=frozenset({ME}), predecessor=PRED, merged=True)
    a = _admit(PRED, view, version=10, epoch=4)
    assert not a.accepted and a.kind == "owner-merged"


def test_a_new_owner_takes_its_catch_up_sources_handoffs_as_a_predecessors_until_it_merges() -> (
    None
):
    # B joined and ranks first; the member ranked first without B (PRED) never owned the
    # fragment: the one that did (SOURCE, alone when it started) hands its state as it retires
    SOURCE = b"s" * 32
    view = HandoffView(
        me=ME, owners=frozenset({ME}), predecessor=PRED, sources=frozenset({PRED, SOURCE})
    )
    assert _admit(SOURCE, view, epoch=4, version=10).accepted
    # with a predecessor's bounds: no epoch jump, no version past the lead, nothing final
    assert _admit(SOURCE, view, epoch=5, version=10).kind == "epoch-jump"
    assert _admit(SOURCE, view, epoch=4, version=11 + PREDECESSOR_LEAD).kind == "ahead-of-known"
    assert not _admit(SOURCE, view, epoch=4, version=10, final=True).final
    assert _admit(ATTACKER, view, epoch=4, version=10).kind == "not-entitled"
    merged = HandoffView(
        me=ME, owners=frozenset({ME}), predecessor=PRED, merged=True, sources=view.sources
    )
    assert _admit(SOURCE, merged, epoch=4, version=10).kind == "not-entitled"
    assert _admit(PRED, merged, epoch=4, version=10).kind == "owner-merged"
