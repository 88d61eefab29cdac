"""protocol.diloco.updates: published states as compressed updates with error feedback."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.compression import compress
from protocol.diloco.updates import UPDATE_CODECS, apply_update, decode_flat, encode_update
from protocol.errors import DecodeError, LocalProtocolError
from protocol.wire.codec import decode, encode
from protocol.wire.messages import FragmentUpdate, ReplicaState

SHAPES = [(37, 11), (129,), (3, 5, 7)]
N = 37 * 11 + 129 + 105


def _sha(t: torch.Tensor) -> bytes:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).digest()


@pytest.mark.parametrize("codec", UPDATE_CODECS)
def test_every_peer_holds_the_owners_state_bit_for_bit(codec: str) -> None:
    """The owner's new published state and a learner's, applying the same bytes to the same
    base, are identical after many versions: their hashes agree."""
    g = torch.Generator().manual_seed(1)
    owner = torch.randn(N, generator=g)
    learner, residual = owner.clone(), None
    for _ in range(20):
        target = owner + 0.01 * torch.randn(N, generator=g)
        tensors, owner, residual = encode_update(target, owner, residual, SHAPES, codec)
        wire = decode(
            bytearray(
                encode(
                    FragmentUpdate(
                        swarm="s",
                        fragment=0,
                        version=2,
                        base_version=1,
                        base_digest=bytes(32),
                        state_digest=bytes(32),
                        tensors=tuple(tensors),
                    )
                ).tobytes()
            ),
            max_size=1 << 24,
        )
        assert isinstance(wire, FragmentUpdate)
        learner = apply_update(learner, wire.tensors, SHAPES)
        assert _sha(learner) == _sha(owner)


@pytest.mark.parametrize("codec", ["int8", "int4", "topk2"])
def test_error_feedback_keeps_the_published_state_near_the_owners_exact_one(codec: str) -> None:
    """What an update rounds away is sent later: the published state stays exactly one residual
    behind the sum of the outer steps (it does not drift as the versions add up), and without
    error feedback it drifts further."""
    g = torch.Generator().manual_seed(2)
    exact = torch.randn(N, generator=g)
    published, residual, no_feedback = exact.clone(), None, exact.clone()
    for _ in range(40):
        step = 0.02 * torch.randn(N, generator=g)
        exact = exact + step
        # the owner's outer step starts from the published state
        _, published, residual = encode_update(published + step, published, residual, SHAPES, codec)
        enc = [compress(s, codec)[0] for s in _split(step)]
        no_feedback = no_feedback + decode_flat(enc, SHAPES)
        assert residual is not None
        assert torch.allclose(exact - published, residual, atol=1e-4)  # what is still owed
    assert (exact - published).norm() <= (exact - no_feedback).norm() * 1.01


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for s in SHAPES:
        n = int(torch.Size(s).numel())
        out.append(flat[offset : offset + n].view(s))
        offset += n
    return out


@settings(max_examples=15, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**31 - 1),
    st.sampled_from(UPDATE_CODECS),
    st.floats(min_value=1e-6, max_value=1e3),
)
def test_applying_is_deterministic_and_matches_the_owner(
    seed: int, codec: str, scale: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N, generator=g) * scale
    target = base + torch.randn(N, generator=g) * scale * 0.1
    tensors, new, _ = encode_update(target, base, None, SHAPES, codec)
    assert torch.equal(apply_update(base.clone(), tensors, SHAPES), new)
    into = base.clone()
    assert torch.equal(
        apply_update(into, tensors, SHAPES, out=into), new
    )  # in place gives the same


def test_an_update_that_does_not_fit_is_refused() -> None:
    base = torch.zeros(N)
    tensors, _, _ = encode_update(torch.ones(N), base, None, SHAPES, "int8")
    with pytest.raises(DecodeError, match="shape"):
        apply_update(base, tensors, [(11, 37)] + SHAPES[1:])
    with pytest.raises(DecodeError, match="tensors"):
        apply_update(base, tensors[:2], SHAPES)
    with pytest.raises(ValueError, match="base"):
        apply_update(torch.zeros(N + 1), tensors, SHAPES)
    huge = torch.full((N,), 2e38)  # twice that overflows fp32
    big, _, _ = encode_update(huge, torch.zeros(N), None, SHAPES, "int8")
    with pytest.raises(DecodeError, match="overflows"):
        apply_update(huge.clone(), big, SHAPES)


def test_the_owner_refuses_to_publish_an_exact_or_unknown_codec_or_a_bad_target() -> None:
    base = torch.zeros(N)
    for codec in ("none", "zip"):
        with pytest.raises(LocalProtocolError, match="updates are published"):
            encode_update(torch.ones(N), base, None, SHAPES, codec)
    with pytest.raises(LocalProtocolError, match="NaN"):
        encode_update(torch.full((N,), float("nan")), base, None, SHAPES, "int8")
    with pytest.raises(LocalProtocolError, match="flat vector"):
        encode_update(torch.ones(N + 1), base, None, SHAPES, "int8")


def test_update_messages_are_checked_on_decode() -> None:
    tensors, _, _ = encode_update(torch.ones(N), torch.zeros(N), None, SHAPES, "int8")
    ok = dict(
        swarm="s",
        fragment=0,
        version=3,
        base_version=2,
        base_digest=bytes(32),
        state_digest=bytes(32),
        tensors=tuple(tensors),
    )
    FragmentUpdate(**ok)  # type: ignore[arg-type]
    for bad, match in (
        ({"base_version": 3}, "below version"),
        ({"base_digest": b"x"}, "base_digest"),
        ({"state_digest": b""}, "state_digest"),
        ({"tensors": ()}, "no tensors"),
    ):
        with pytest.raises(DecodeError, match=match):
            FragmentUpdate(**{**ok, **bad})  # type: ignore[arg-type]
    state = dict(
        swarm="s",
        fragment=0,
        epoch=0,
        version=3,
        digest=bytes(32),
        theta=tuple(tensors),
        momentum=(),
    )
    ReplicaState(**state, base_version=2, base_digest=bytes(32))  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="base_version"):
        ReplicaState(**state, base_version=3, base_digest=bytes(32))  # type: ignore[arg-type]
    # by reference: the version the replica holds, named by its own digest, and no tensors
    by_ref = {**state, "theta": (), "digest": b"\x07" * 32}
    ReplicaState(**by_ref, base_version=3, base_digest=b"\x07" * 32)  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="by reference"):
        ReplicaState(**by_ref, base_version=3, base_digest=bytes(32))  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="by reference"):
        ReplicaState(
            **{**by_ref, "momentum": tuple(tensors[:1])},
            base_version=3,  # type: ignore[arg-type]
            base_digest=b"\x07" * 32,
        )
    with pytest.raises(DecodeError, match="base_version"):
        ReplicaState(**by_ref, base_version=4, base_digest=b"\x07" * 32)  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="base_digest"):
        ReplicaState(**{**state, "theta": tuple(tensors[:1])}, base_digest=bytes(32))  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="momentum"):
        ReplicaState(
            **{**state, "momentum": tuple(tensors[:1])},
            base_version=2,  # type: ignore[arg-type]
            base_digest=bytes(32),
        )


@pytest.mark.parametrize("codec", UPDATE_CODECS)
def test_an_update_computed_in_its_targets_place_is_the_same_bits(codec: str) -> None:
    """``consume_target`` (a merge's result the owner needs no more) saves a fragment-sized
    vector and changes no bit of the update, the published state or the residual."""
    g = torch.Generator().manual_seed(2)
    published, residual = torch.randn(N, generator=g), 1e-3 * torch.randn(N, generator=g)
    for _ in range(5):
        target = published + 0.01 * torch.randn(N, generator=g)
        want = encode_update(target.clone(), published, residual, SHAPES, codec)
        got = encode_update(target, published, residual, SHAPES, codec, consume_target=True)
        assert got[1].data_ptr() == target.data_ptr()  # the published state is in its place
        assert [t.data for t in got[0]] == [t.data for t in want[0]]
        assert _sha(got[1]) == _sha(want[1]) and _sha(got[2]) == _sha(want[2])
        published, residual = got[1], got[2]
