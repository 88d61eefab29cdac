"""An island trained alone: the reference that shows whether merging helps (``atoll local --alone``).

The same GPT (preset and seed init), inner optimizer, learning-rate schedule, data shard, sampler
seed and number of steps as island ``index`` of the swarm (``node/run/train.py``, whose
``island_sampler`` and ``inner_step`` it reuses), but no swarm: nothing is merged in. Evaluated on
the same held-out windows as the swarm's global model, so its final eval loss minus the global
model's is what merging gained.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from node.config import RunConfig
from node.diloco.inner import make_inner_optimizer
from node.run.train import inner_step, island_sampler
from node.workload.baseline import train_config_for
from node.workload.corpus import evaluate, load_corpus, split_corpus
from node.workload.model import GPT, GPTConfig

__all__ = ["train_island_alone"]


def train_island_alone(cfg: RunConfig, index: int = 0) -> dict[str, Any]:
    """Train island ``index`` alone for ``cfg.steps`` steps on its shard; return eval_loss_start,
    eval_loss_end (nats/byte, the swarm's held-out windows), steps, shard, tokens_trained, wall_s."""
    gcfg = GPTConfig.preset(cfg.model)
    device = torch.device(cfg.device)
    model = GPT(gcfg, seed=cfg.seed).to(device)  # the swarm's version 0
    train, heldout = split_corpus(
        load_corpus(Path(cfg.corpus) if cfg.corpus else None, max_bytes=cfg.corpus_max_bytes)
    )
    sampler = island_sampler(cfg, train, gcfg.block_size, index)
    tcfg = train_config_for(cfg)
    optimizer = make_inner_optimizer(model, tcfg)

    def eval_loss() -> float:
        return evaluate(
            model,
            heldout,
            batch_size=cfg.batch_size,
            block_size=gcfg.block_size,
            n_batches=cfg.eval_batches,
        )

    eval_start = eval_loss()
    t0 = time.perf_counter()
    model.train()
    for step in range(cfg.steps):
        x, y = (t.to(device, non_blocking=True) for t in sampler.next())  # [B, T] int64 each
        inner_step(model, optimizer, tcfg, step, x, y)
    return {
        "eval_loss_start": eval_start,
        "eval_loss_end": eval_loss(),
        "steps": cfg.steps,
        "shard": index,
        "tokens_trained": cfg.steps * sampler.tokens_per_batch,
        "wall_s": time.perf_counter() - t0,
    }
