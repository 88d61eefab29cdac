"""Owner checkpoints: a fragment's whole owner state survives a restart bit for bit, writes are
throttled to the newest state, and a damaged or foreign file is refused, never half-loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from node.config import RunConfig
from node.diloco.replica import Handed
from node.peer import NodeOptions, PeerNode
from node.state.owner_checkpoint import OwnerCheckpoints
from tests.node.fakes import signer, tiny_model, tiny_plan

SWARM = "test-swarm"


def _state(version: int, n: int = 10, *, momentum: bool = True) -> Handed:
    g = torch.Generator().manual_seed(version)
    return Handed(
        1,
        3,
        version,
        bytes([version % 256]) * 32,
        torch.randn(n, generator=g),
        torch.randn(n, generator=g) if momentum else None,
        b"",
        {b"\xa1" * 32: version - 1},
    )


def test_a_state_comes_back_bit_for_bit(tmp_path: Path) -> None:
    store = OwnerCheckpoints(tmp_path, SWARM, [5, 10])
    saved = _state(7)
    store.save(saved)
    got = OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1]
    assert (got.fragment, got.epoch, got.version, got.digest, got.merged) == (
        saved.fragment,
        saved.epoch,
        saved.version,
        saved.digest,
        saved.merged,
    )
    assert torch.equal(got.theta, saved.theta) and got.momentum is not None
    assert saved.momentum is not None and torch.equal(got.momentum, saved.momentum)
    store.save(_state(8, momentum=False))  # before the first merge with momentum: none
    assert OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1].momentum is None


def test_damaged_and_foreign_checkpoints_are_refused_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = OwnerCheckpoints(tmp_path, SWARM, [5, 10])
    path = store.save(_state(7))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 9])  # truncated by a crash of the disk, not of the writer
    assert store.load() == {}
    assert "refused" in caplog.text
    store.save(_state(7))
    assert OwnerCheckpoints(tmp_path, "another-swarm", [5, 10]).load() == {}  # foreign
    assert OwnerCheckpoints(tmp_path, SWARM, [5, 11]).load() == {}  # another plan
    assert OwnerCheckpoints(tmp_path, SWARM, [5]).load() == {}  # a fragment the plan lacks


async def test_writes_are_throttled_and_the_newest_state_wins(tmp_path: Path) -> None:
    store = OwnerCheckpoints(tmp_path, SWARM, [5, 10], min_gap_s=0.3)
    store.offer(_state(1))
    for _ in range(100):  # written at once
        await asyncio.sleep(0.01)
        if store.written == 1:
            break
    assert OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1].version == 1
    for v in range(2, 6):  # inside the gap: folded into one write when it ends
        store.offer(_state(v))
        await asyncio.sleep(0.01)
    assert store.written == 1
    await asyncio.sleep(0.6)
    assert store.written == 2
    assert OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1].version == 5


def test_a_peer_starts_with_its_owner_checkpoints_as_handed_states(tmp_path: Path) -> None:
    model = tiny_model()
    plan = tiny_plan(model)
    cfg = RunConfig(max_tokens_per_step=64)
    numels = [sum(model.get_parameter(n).numel() for n in f.names) for f in plan.fragments]
    theta = torch.randn(numels[0])
    OwnerCheckpoints(tmp_path, cfg.swarm, numels).save(
        Handed(0, 2, 40, b"\x01" * 32, theta, None, b"", {})
    )
    node = PeerNode(cfg, signer(1), model, plan, NodeOptions(owner_checkpoint_dir=tmp_path))
    held = node.replicas.states[0]
    assert held.version == 40 and held.epoch == 2 and torch.equal(held.theta, theta)
    assert node.replicas.held[0].version == 40  # and a handoff older than it is refused


def _crafted(path: Path, meta_json: str, n: int = 10) -> None:
    """An owner checkpoint whose meta record is ``meta_json`` as given, with a valid digest."""
    from tests.node.state.test_checkpoint import craft

    craft(path, {"theta": torch.zeros(n)}, meta_json)


_OWNER = '"kind": "atoll-owner", "swarm": "test-swarm", "fragment": 1, '
_DIGEST = '"digest": "' + "ab" * 32 + '"'


@pytest.mark.parametrize(
    "meta_json",
    [
        "[" * 100_000 + "]" * 100_000,  # RecursionError in the parser
        "{"
        + _OWNER
        + '"epoch": 1e400, "version": 3, '
        + _DIGEST
        + ', "merged": []}',  # inf: OverflowError
        "{"
        + _OWNER
        + '"epoch": 1, "version": '
        + "9" * 30
        + ", "
        + _DIGEST
        + ', "merged": []}',  # past 2^63
        "{" + _OWNER + '"epoch": 1, "version": 3, ' + _DIGEST + ', "merged": [[1, 2, 3]]}',
        "{" + _OWNER + '"epoch": 1, "version": 3, ' + _DIGEST + ', "merged": {"a": 1}}',
        "{" + _OWNER + '"epoch": true, "version": 3, ' + _DIGEST + ', "merged": []}',
        "{" + _OWNER + '"epoch": 1, "version": 3, "digest": ["ab"], "merged": []}',
        '["atoll-owner"]',
    ],
)
def test_crafted_owner_checkpoints_are_skipped_and_the_peer_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, meta_json: str
) -> None:
    """Every parse error of an owner checkpoint (a header nested past the parser's recursion, an
    epoch of 1e400, a version past 2^63, merged work of the wrong shape, a meta record that is
    not an object) is a refusal with the reason: the file is skipped and the peer starts."""
    model = tiny_model()
    plan = tiny_plan(model)
    numels = [sum(model.get_parameter(n).numel() for n in f.names) for f in plan.fragments]
    path = tmp_path / "owner-fragment1.safetensors"
    _crafted(path, meta_json.replace('"test-swarm"', '"atoll-local"'), numels[1])
    with caplog.at_level("WARNING", logger="node.state.owner_checkpoint"):
        assert OwnerCheckpoints(tmp_path, "atoll-local", numels).load() == {}
        node = PeerNode(
            RunConfig(max_tokens_per_step=64),
            signer(1),
            model,
            plan,
            NodeOptions(owner_checkpoint_dir=tmp_path),
        )
    assert 1 not in node.replicas.states
    assert f"owner checkpoint {path} refused" in caplog.text


def test_the_clip_reference_and_the_standing_come_back_and_bad_ones_are_refused_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An owner that resumes from its checkpoint keeps its clip reference and standing per key
    (issue 47: no owner starts without a reference); either field malformed is refused with the
    reason and the state is still taken. Older checkpoints, without them, load with none."""
    import dataclasses

    from node.state.checkpoint import save_checkpoint

    store = OwnerCheckpoints(tmp_path, SWARM, [5, 10])
    saved = dataclasses.replace(
        _state(7),
        norms=((b"\xc3" * 32, 0.5), (None, 0.25), (b"\xd4" * 32, 1.0)),  # None: anonymous
        standing=((b"\xa1" * 32, b"\xb2" * 32), (-2.5, 0.75)),
    )
    path = store.save(saved)
    got = OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1]
    assert got.norms == saved.norms and got.standing == saved.standing
    tensors = {"theta": saved.theta.float()}
    base = {
        "kind": "atoll-owner",
        "swarm": SWARM,
        "fragment": 1,
        "epoch": 3,
        "version": 7,
        "digest": saved.digest.hex(),
        "merged": [],
    }
    for bad in (
        {"norm_history": [1.0, -2.0]},
        {"norm_history": "x"},
        {"norm_history": [1.0] * 65},
        {"norm_history": [1.0, 2.0], "norm_senders": ["c3" * 32]},
        {"norm_history": [1.0], "norm_senders": ["c3" * 5]},
        {"standing": [["zz", 1.0]]},
        {"standing": [["a1" * 32]]},
        {"standing": [["a1" * 5, 1.0]]},
        {"standing": [["a1" * 32, 10**400]]},
        {"standing": {"a": 1}},
    ):
        caplog.clear()
        save_checkpoint(path, tensors, {**base, **bad})
        got = OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1]  # the state is taken
        assert got.version == 7 and got.norms == () and got.standing == ((), ())
        assert "refused" in caplog.text, bad
    save_checkpoint(path, tensors, {**base, "norm_history": [0.5, 1]})  # before norm_senders
    got = OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1]
    assert got.norms == ((None, 0.5), (None, 1.0))  # anonymous: each norm its own vote
    save_checkpoint(path, tensors, base)  # an older checkpoint
    got = OwnerCheckpoints(tmp_path, SWARM, [5, 10]).load()[1]
    assert got.norms == () and got.standing == ((), ())
