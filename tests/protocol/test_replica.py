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
