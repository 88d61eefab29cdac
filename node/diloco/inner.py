"""The inner optimizer and its learning-rate schedule, shared by every island and the baseline.

Learning rate (``lr_at``): linear warmup over ``warmup_steps`` to ``lr``, then either a cosine
decay to ``lr * min_lr_ratio`` at ``steps`` (``schedule="cosine"``, the default, as in nanoGPT and
the DiLoCo papers' inner optimizer) or held at ``lr`` (``schedule="constant"``).

A peer that joins a running swarm (``atoll join``) starts on that schedule where the swarm's
learners are (``joining_step``: the median of the steps they claim), not at its warmup, and warms
its fresh AdamW up again from there (``lr_at(..., rewarm_from=)``): the swarm's model is late in its
decay, and a peak-lr island's work would be far off the others'.

Inner optimizer (``make_inner_optimizer``): AdamW; weight decay on every tensor with two or more
dimensions (matrices and embeddings), none on biases and LayerNorm gains, as in nanoGPT.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from protocol.diloco.interval import interval

__all__ = ["InnerSchedule", "interval_by_lr", "joining_step", "lr_at", "make_inner_optimizer"]


class InnerSchedule(Protocol):
    """The fields of a training config the inner optimizer reads (``TrainConfig`` has them)."""

    @property
    def lr(self) -> float: ...
    @property
    def schedule(self) -> str: ...
    @property
    def min_lr_ratio(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...


def lr_at(step: int, cfg: InnerSchedule, *, rewarm_from: int = 0) -> float:
    """Learning rate for 0-based ``step``: linear warmup, then cosine to lr*min_lr_ratio at
    ``cfg.steps`` (held there afterwards) or constant. ``rewarm_from``: the step an island
    joined the schedule at with a fresh optimizer: its first ``warmup_steps`` from there ramp
    linearly up to the schedule's rate (0: it started at the start)."""
    rate = _scheduled(step, cfg)
    since = step - rewarm_from
    if rewarm_from > 0 and 0 <= since < cfg.warmup_steps:
        return rate * (since + 1) / cfg.warmup_steps
    return rate


def joining_step(claims: Iterable[int], total: int) -> int:
    """Where on a ``total``-step schedule an island joining a running swarm starts: the median of
    the steps the swarm's learners claim (the lower one of an even count), within [0, ``total``];
    0 with no claims. A step is each member's own say: a minority claiming steps far too high or
    too low moves the median at most to the edge of what the others claim."""
    bounded = sorted(min(max(int(c), 0), total) for c in claims)
    return bounded[(len(bounded) - 1) // 2] if bounded else 0


def _scheduled(step: int, cfg: InnerSchedule) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def make_inner_optimizer(model: nn.Module, cfg: InnerSchedule) -> torch.optim.AdamW:
    """AdamW at ``lr_at(0, cfg)``; decay on tensors with dim >= 2 only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2))


def interval_by_lr(
    optimizer: torch.optim.Optimizer, base: int, growth: str
) -> Callable[[int], int] | None:
    """H at each inner step under ``growth`` (``protocol.diloco.interval``), from the optimizer's
    own learning rate as a fraction of the highest it has had: 1 through warmup, then the decay
    of whatever schedule the caller runs. None for ``constant`` (the island keeps ``base``).

    Raises ``LocalProtocolError`` for a growth that ``protocol.diloco.interval`` does not know."""
    if growth == "constant":
        return None
    interval(base, 1.0, growth)  # an unknown growth fails here, not at the first sync
    peak = 0.0

    def h(_step: int) -> int:
        nonlocal peak
        lr = float(optimizer.param_groups[0]["lr"])
        peak = max(peak, lr)
        return interval(
            base, lr / peak if peak > 0 and math.isfinite(lr) and lr > 0 else 1.0, growth
        )

    return h
