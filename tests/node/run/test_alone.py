"""The island-alone reference of ``atoll local --alone``: peer 0's model, optimizer and shard, no swarm."""

from __future__ import annotations

from typing import Any

import pytest

import node.run.alone as alone
from node.config import RunConfig
from node.workload.corpus import BatchSampler, shard_spans


def test_island_alone_trains_on_its_own_shard_and_its_loss_falls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = RunConfig(
        model="tiny",
        peers=3,
        steps=30,
        warmup_steps=5,
        eval_batches=2,
        corpus_max_bytes=200_000,
        sharding="striped",
    )
    seen: list[tuple[list[tuple[int, int]], int]] = []
    real = alone.island_sampler

    def spy(*args: Any) -> BatchSampler:
        sampler = real(*args)
        seen.append((sampler.spans, args[1].numel()))
        return sampler

    monkeypatch.setattr(alone, "island_sampler", spy)
    result = alone.train_island_alone(cfg, index=0)
    ((spans, n),) = seen
    assert spans == shard_spans(n, shard=0, n_shards=cfg.peers, sharding="striped", block_size=64)
    assert len(spans) > 1  # the run's --sharding reached the island: shard 0's stripes, only they
    assert result["steps"] == 30 and result["shard"] == 0
    assert result["tokens_trained"] == 30 * cfg.batch_size * 64
    assert result["eval_loss_end"] < 0.8 * result["eval_loss_start"], result
