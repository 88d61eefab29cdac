"""The synchronous data-parallel baseline that Decoupled DiLoCo is measured against.

N learners, each with batch B from its own data shard, doing S steps of synchronous data
parallelism with an fp32 all-reduce (mean) of gradients, are mathematically one model trained
with the concatenated batch of N·B sequences for S steps: the mean of the learners' mean losses
is the mean loss of the concatenated batch, so its gradient is the all-reduced gradient. This
module trains exactly that, in one process, with the same inner optimizer, learning-rate
schedule, data shards and held-out windows as the DiLoCo islands (``node/run/train.py``), so the two
are compared at equal tokens.

    python -m node.workload.baseline --peers 3 --steps 300 --json

The inner optimizer and learning-rate schedule are ``node.diloco.inner``'s, shared with the
islands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from node.config import SHARDINGS
from node.diloco.inner import lr_at, make_inner_optimizer
from node.workload.corpus import BatchSampler, CorpusShard, evaluate, load_corpus, split_corpus
from node.workload.model import GPT, PRESETS, GPTConfig

if TYPE_CHECKING:
    from node.config import RunConfig

__all__ = [
    "TrainConfig",
    "sampler_seed",
    "train_config_for",
    "train_data_parallel",
    "main",
]


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    model: str = _f("small", f"model preset: {', '.join(PRESETS)}")
    batch_size: int = _f(16, "sequences per step per learner")
    steps: int = _f(300, "optimizer steps")
    lr: float = _f(3e-3, "peak AdamW learning rate")
    schedule: str = _f("cosine", "after warmup: cosine (decay to lr*min_lr_ratio) or constant")
    min_lr_ratio: float = _f(0.1, "final learning rate of the cosine, as a fraction of lr")
    warmup_steps: int = _f(50, "linear learning-rate warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices and embeddings only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the gradient's global norm to this (0 disables)")
    seed: int = _f(0, "seed for model init and data order")
    sharding: str = _f(
        "contiguous", "how the train split is dealt to learners: contiguous or striped"
    )
    eval_every: int = _f(50, "steps between held-out evaluations")
    eval_batches: int = _f(8, "held-out batches (of batch_size windows) per evaluation")
    device: str = _f("cpu", "torch device: cpu or cuda")

    def __post_init__(self) -> None:
        problems = []
        if self.model not in PRESETS:
            problems.append(f"model must be one of {sorted(PRESETS)}, got {self.model!r}")
        if self.sharding not in SHARDINGS:
            problems.append(
                f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}"
            )
        if self.schedule not in ("cosine", "constant"):
            problems.append(f"schedule must be cosine or constant, got {self.schedule!r}")
        for name in ("batch_size", "steps", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.lr <= 0:
            problems.append("warmup_steps and grad_clip must be >= 0 and lr > 0")
        if problems:
            raise ValueError("; ".join(problems))


def train_config_for(run: RunConfig) -> TrainConfig:
    """The inner-training part of a swarm's ``RunConfig`` (same fields, same values)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{n: getattr(run, n) for n in names if hasattr(run, n)})


def sampler_seed(seed: int, learner: int) -> int:
    """Seed of learner ``learner``'s BatchSampler; islands and the baseline use the same one."""
    return seed * 1000 + learner


# -----------------------------------------------------------------------------
# the baseline


def train_data_parallel(
    cfg: TrainConfig,
    n_learners: int,
    train: torch.Tensor,
    heldout: torch.Tensor,
    *,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Synchronous data parallelism of ``n_learners`` learners, as one model with batch N·B.

    Learner m draws its B sequences from shard m of ``train`` with the same sampler seed as
    island m. Returns eval_loss_start / eval_loss_end (nats/byte), eval_curve
    [(step, tokens, loss)], tokens_trained, wall_s and a few more numbers (JSON-ready).
    Raises ValueError if ``n_learners`` < 1 or the data is too small for the model's windows.
    """
    if n_learners < 1:
        raise ValueError(f"n_learners must be >= 1, got {n_learners}")
    # --- model, optimizer, data ---------------------------------------------------------------
    gcfg = GPTConfig.preset(cfg.model)
    T = gcfg.block_size
    device = torch.device(cfg.device)
    model = GPT(gcfg, seed=cfg.seed).to(device)
    optimizer = make_inner_optimizer(model, cfg)
    samplers = [
        BatchSampler(
            train,
            CorpusShard(m, n_learners, cfg.sharding),
            batch_size=cfg.batch_size,
            block_size=T,
            seed=sampler_seed(cfg.seed, m),
        )
        for m in range(n_learners)
    ]
    tokens_per_step = n_learners * cfg.batch_size * T

    def eval_loss() -> float:
        return evaluate(
            model, heldout, batch_size=cfg.batch_size, block_size=T, n_batches=cfg.eval_batches
        )

    eval_start = eval_loss()
    curve: list[tuple[int, int, float]] = [(0, 0, eval_start)]
    if log:
        log(
            f"baseline: {n_learners} learners x batch {cfg.batch_size} x {T} bytes, "
            f"{model.num_params() / 1e6:.3f}M params, eval loss {eval_start:.4f}"
        )

    # --- the training loop --------------------------------------------------------------------
    model.train()
    t0 = time.perf_counter()
    eval_s = 0.0
    train_loss = float("nan")
    for step in range(cfg.steps):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # one synchronous all-reduce step == one step on the concatenated batch
        batches = [s.next() for s in samplers]  # N x ((B, T), (B, T)) int64
        x = torch.cat([b[0] for b in batches]).to(device)  # (N*B, T) int64
        y = torch.cat([b[1] for b in batches]).to(device)  # (N*B, T) int64
        _, loss = model(x, y)  # scalar: mean over N*B*T bytes = mean of the learners' losses
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # --- evaluation and logging ---------------------------------------------------------
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            train_loss = loss.item()
            te = time.perf_counter()
            curve.append((step + 1, (step + 1) * tokens_per_step, eval_loss()))
            eval_s += time.perf_counter() - te
            if log:
                log(
                    f"step {step + 1}/{cfg.steps}  lr {lr:.2e}  train {train_loss:.4f}  "
                    f"eval {curve[-1][2]:.4f}  {time.perf_counter() - t0:.1f}s"
                )
    wall_s = time.perf_counter() - t0

    return {
        "n_learners": n_learners,
        "model": cfg.model,
        "n_params": model.num_params(),
        "config": dataclasses.asdict(cfg),
        "eval_loss_start": eval_start,
        "eval_loss_end": curve[-1][2],
        "train_loss_end": train_loss,
        "eval_curve": curve,
        "tokens_per_step": tokens_per_step,
        "tokens_trained": cfg.steps * tokens_per_step,
        "wall_s": wall_s,
        "train_steps_per_s": cfg.steps / max(1e-9, wall_s - eval_s),
    }


# -----------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m node.workload.baseline",
        description="Synchronous data-parallel baseline: N learners x batch B as one model.",
    )
    p.add_argument("--peers", type=int, default=3, help="number of learners N (default: 3)")
    p.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="text file or folder (default: the Python standard library's .py files)",
    )
    p.add_argument(
        "--max-bytes", type=int, default=None, help="read at most this many corpus bytes"
    )
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (default 0: torch's choice)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout, last")
    kinds = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(TrainConfig):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kinds[str(f.type)],
            default=f.default,
            help=f"{f.metadata['help']} (default: {f.default})",
        )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, train the baseline, print progress (stderr with --json) and the result."""
    args = _parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    data = load_corpus(args.corpus, max_bytes=args.max_bytes)
    train, heldout = split_corpus(data)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else print
    result = train_data_parallel(cfg, args.peers, train, heldout, log=log)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"eval loss {result['eval_loss_start']:.4f} -> {result['eval_loss_end']:.4f} "
            f"after {result['tokens_trained']} tokens in {result['wall_s']:.1f}s"
        )
    return result


if __name__ == "__main__":
    main()
