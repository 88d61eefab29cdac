"""Which bytes an island trains on: a local swarm's peer takes its shard of ``--peers``; a joining
peer, whose swarm's size it does not know, takes windows from the whole corpus with a seed of its
own key, so that joiners never train on the same batches."""

from __future__ import annotations

import torch

from node.config import RunConfig
from node.run.train import data_seed_of, island_sampler
from node.workload.corpus import shard_spans
from tests.node.fakes import signer

TRAIN = torch.arange(300_000, dtype=torch.int64).remainder(251).to(torch.uint8)  # (n,) uint8
BLOCK = 32


def first_batches(sampler_args: dict[str, object], n: int = 3) -> list[torch.Tensor]:
    sampler = island_sampler(RunConfig(), TRAIN, BLOCK, **sampler_args)  # type: ignore[arg-type]
    return [sampler.next()[0] for _ in range(n)]


def test_a_local_peer_samples_its_shard_of_peers() -> None:
    cfg = RunConfig(peers=3)
    for index in range(3):
        sampler = island_sampler(cfg, TRAIN, BLOCK, index)
        assert sampler.spans == shard_spans(TRAIN.numel(), shard=index, n_shards=3)


def test_joiners_that_drew_the_same_index_train_on_different_batches_from_the_whole_corpus() -> (
    None
):
    a, b = signer(1).peer_id, signer(2).peer_id
    assert data_seed_of(a) != data_seed_of(b) and data_seed_of(a) == data_seed_of(a)
    # the index a joiner draws among --peers is the same for both: without their own seeds the
    # two streams would be one
    same = [first_batches({"index": 1}) for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(*same, strict=True))
    mine, theirs = (first_batches({"index": 1, "own_seed": data_seed_of(p)}) for p in (a, b))
    assert not any(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))
    again = first_batches(
        {"index": 2, "own_seed": data_seed_of(a)}
    )  # a restart: another index, same key
    assert all(torch.equal(x, y) for x, y in zip(mine, again, strict=True))
    sampler = island_sampler(RunConfig(peers=3), TRAIN, BLOCK, 1, own_seed=data_seed_of(a))
    assert sampler.spans == [(0, TRAIN.numel())]  # the whole train split, not a third of it


def test_the_ranks_of_a_joiners_island_draw_different_batches() -> None:
    seed = data_seed_of(signer(1).peer_id)
    rank0, rank1 = (first_batches({"index": 0, "own_seed": seed, "rank": r}) for r in (0, 1))
    assert not any(torch.equal(x, y) for x, y in zip(rank0, rank1, strict=True))
