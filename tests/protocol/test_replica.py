"""The replica's handoff rule: no version number ever gets two contents, whoever hands it over."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from protocol.diloco.replica import Held, judge

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


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.sampled_from([D1, D2])), max_size=40))
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
    assert not judge(held, epoch=1, version=59, digest=b"b" * 32, fragment=3, successor=True).accepted
    assert not judge(Held(2, 61, b"a" * 32), epoch=1, version=61, digest=b"b" * 32, fragment=3,
                     successor=True).accepted  # a second content for a version is never taken
