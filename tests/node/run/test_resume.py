"""An island's checkpoint: after a restart it trains on from the same step, weights, optimizer
moments, global versions and data order as if it had never stopped."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from node.diloco.inner import make_inner_optimizer
from node.diloco.island import Island, IslandConfig
from node.run.resume import IslandCheckpoints
from node.run.train import inner_step
from node.state.checkpoint import CheckpointError
from node.workload.baseline import TrainConfig
from node.workload.corpus import BatchSampler, CorpusShard
from node.workload.model import GPT, GPTConfig, embedding_parameter_names
from protocol.diloco.fragments import plan_fragments
from protocol.diloco.versions import version_jump_reason

TRAIN = torch.randint(
    0, 256, (20_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
)


def _island(tcfg: TrainConfig):  # type: ignore[no-untyped-def]
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    opt = make_inner_optimizer(model, tcfg)
    plan = plan_fragments(
        [(n, tuple(p.shape)) for n, p in model.named_parameters()],
        2,
        embeddings=embedding_parameter_names(model),
    )
    island = Island(model, opt, plan, lambda _out: None, IslandConfig(inner_steps=4))
    sampler = BatchSampler(
        TRAIN, CorpusShard(0, 1), batch_size=4, block_size=model.config.block_size, seed=7
    )
    return model, opt, island, sampler


def _steps(model, opt, island, sampler, tcfg, start: int, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    return [
        inner_step(model, opt, tcfg, s, *sampler.next()).item() for s in range(start, start + n)
    ]


def test_a_restarted_island_continues_exactly_where_it_stopped(tmp_path: Path) -> None:
    tcfg = TrainConfig(steps=20, lr=3e-3, warmup_steps=2)
    model, opt, island, sampler = _island(tcfg)
    _steps(model, opt, island, sampler, tcfg, 0, 6)
    island.deliver(1, 3, island.global_flat[1] + 0.5)  # a global version adopted at the next step
    _steps(model, opt, island, sampler, tcfg, 6, 2)
    ckpt = IslandCheckpoints(tmp_path, model, opt, island, sampler.generator)
    t0 = time.time()
    assert ckpt.save()
    ckpt.wait()
    expected = _steps(
        model, opt, island, sampler, tcfg, 8, 4
    )  # what an uninterrupted island does next

    model2, opt2, island2, sampler2 = _island(tcfg)  # a fresh process after kill -9
    meta = IslandCheckpoints(tmp_path, model2, opt2, island2, sampler2.generator).restore()
    assert meta is not None and meta["step"] == 8 and island2.versions == [0, 3]
    # the version fence of the restarted peer counts the swarm's merges from when it held version
    # 3, not from the restart: 10 s on, 500 versions more are possible (the restart's own time
    # refused them, and a restarted peer could never take the swarm's versions again)
    saved_at = float(meta["saved_at"])
    assert t0 <= saved_at <= time.time()
    assert version_jump_reason(503, held=3, held_at=saved_at, now=saved_at + 10) is None
    assert version_jump_reason(503, held=3, held_at=saved_at + 10, now=saved_at + 10) is not None
    assert island2.stats.step == 8
    resumed = _steps(model2, opt2, island2, sampler2, tcfg, 8, 4)
    assert resumed == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n


def test_no_checkpoint_means_a_fresh_start_and_a_foreign_one_is_refused(tmp_path: Path) -> None:
    tcfg = TrainConfig(steps=20)
    model, opt, island, sampler = _island(tcfg)
    assert (
        IslandCheckpoints(tmp_path / "empty", model, opt, island, sampler.generator).restore()
        is None
    )
    other = GPT(GPTConfig.preset("tiny"), seed=0)
    other.lm_head = torch.nn.Linear(other.config.n_embd, 7, bias=False)  # another model
    opt_o = torch.optim.AdamW(other.parameters())
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in other.named_parameters()], 2)
    foreign = IslandCheckpoints(
        tmp_path / "f",
        other,
        opt_o,
        Island(other, opt_o, plan, lambda _o: None, IslandConfig()),
        sampler.generator,
    )
    foreign.save()
    foreign.wait()
    with pytest.raises(CheckpointError, match="does not fit this model|fragments"):
        IslandCheckpoints(tmp_path / "f", model, opt, island, sampler.generator).restore()


@pytest.mark.parametrize(
    "field, value",
    [
        ("versions", ["x", 1]),
        ("step", 1e400),
        ("c_steps", [1]),
        ("next_due", None),
        ("tokens_trained", 2**70),
    ],
)
def test_a_checkpoint_whose_meta_record_is_malformed_is_skipped_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: object
) -> None:
    """A file with a valid digest but a crafted meta record (a version that is a string, a step
    of 1e400, a list of the wrong length) raised KeyError/TypeError/OverflowError out of
    ``restore`` and the peer failed to start; now it is skipped with the reason and the older
    checkpoint is used (none: a fresh start)."""
    import json

    from node.state.checkpoint_load import load_checkpoint
    from tests.node.state.test_checkpoint import craft

    tcfg = TrainConfig(steps=20)
    model, opt, island, sampler = _island(tcfg)
    ckpt = IslandCheckpoints(tmp_path, model, opt, island, sampler.generator)
    assert ckpt.save()
    ckpt.wait()
    tensors, meta = load_checkpoint(ckpt.store.path(0))
    craft(
        ckpt.store.path(1),
        tensors,
        json.dumps({**meta, "step": 1, field: value}).replace("Infinity", "1e400"),
    )
    model2, opt2, island2, sampler2 = _island(tcfg)
    with caplog.at_level("WARNING", logger="node.state.checkpoint"):
        restored = IslandCheckpoints(tmp_path, model2, opt2, island2, sampler2.generator).restore()
    assert restored is not None and restored["step"] == 0  # the older, well-formed one
    assert "skipping checkpoint step 1" in caplog.text and field in caplog.text
