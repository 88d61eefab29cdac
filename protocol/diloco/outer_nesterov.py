"""The outer optimizer: ``OuterConfig`` and Nesterov SGD on one fragment, as in DiLoCo.

``outer_step``: Nesterov SGD bit-identical to ``torch.optim.SGD(nesterov=True)`` fed the
pseudo-gradient as ``grad``: first step ``b = Delta``, later ``b = mu*b + Delta``;
``Theta -= lr * (Delta + mu*b)``. With ``momentum = 0`` it is plain SGD; ``lr = 1`` then sets
``Theta`` to the weighted average of the local parameters. ``protocol.diloco.outer`` re-exports
both and applies them in ``merge_update``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol.diloco.aggregates import AGGREGATES
from protocol.diloco.vectors import copy_vector, new_vector_like
from protocol.errors import LocalProtocolError

__all__ = ["OuterConfig", "outer_step", "outer_step_"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterConfig:
    """Outer SGD: ``lr`` eta, ``momentum`` mu, ``nesterov``. DiLoCo's defaults; short runs with
    few outer steps did best with ``lr=1.0, momentum=0.0`` (plain averaging)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    max_delta_ratio: float = 1.0  # the owner bounds an aggregate's norm to this times |Theta|
    rda_radius: str = "median"  # radial-directional averaging's step length: "median" or "mean"
    rda_max_gain: float = (
        0.0  # RDA's step at most this many times the normed mean's (0: unbounded; see max_gain)
    )
    aggregate: str = (
        "rda"  # non-embedding fragments: "rda", "normed" (``normed_mean``) or "mean" (weighted)
    )

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise LocalProtocolError(f"outer lr must be finite and > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise LocalProtocolError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.aggregate not in AGGREGATES:
            raise LocalProtocolError(
                f"aggregate must be one of {', '.join(AGGREGATES)}; got {self.aggregate!r}"
            )
        if self.rda_radius not in ("mean", "median"):
            raise LocalProtocolError(
                f"rda_radius must be 'mean' or 'median', got {self.rda_radius!r}"
            )
        if not (self.rda_max_gain == 0.0 or 1.0 <= self.rda_max_gain < math.inf):
            raise LocalProtocolError(
                f"rda_max_gain must be >= 1 and finite, or 0 (unbounded); got {self.rda_max_gain}"
            )
        if not self.max_delta_ratio > 0:
            raise LocalProtocolError(
                f"max_delta_ratio must be > 0 (inf: unbounded), got {self.max_delta_ratio}"
            )


def outer_step(
    param: torch.Tensor,
    delta: torch.Tensor,
    buffer: torch.Tensor | None,
    cfg: OuterConfig,
    *,
    consume_delta: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(new param, new momentum buffer) without touching the inputs; see ``outer_step_``.

    The buffer stays ``None`` when ``cfg.momentum == 0``. ``consume_delta``: ``delta`` is the
    caller's to spend (a merge's own aggregate): Nesterov's gradient is formed in its place
    instead of in a new vector (the same bits).
    """
    if buffer is None and cfg.momentum == 0 and param.shape == delta.shape:
        # the same kernel as outer_step_'s param.add_(grad, alpha=-lr), into a new tensor: one
        # pass over the fragment instead of a copy and then an in-place add; into ``delta``
        # itself when it is the caller's to spend (its pages are warm, a new vector's are not)
        with torch.no_grad():
            if (
                consume_delta
                and delta.dtype == param.dtype
                and delta.device == param.device
                and delta.is_contiguous()
            ):
                out = delta.detach()
            elif param.dtype == torch.float32:
                out = new_vector_like(param)
            else:
                out = torch.empty_like(param)
            return torch.add(param.detach(), delta.detach(), alpha=-cfg.lr, out=out), None
    new_param = copy_vector(param)
    new_buffer = None if buffer is None else copy_vector(buffer)
    return new_param, outer_step_(new_param, delta, new_buffer, cfg, consume_delta=consume_delta)


def outer_step_(
    param: torch.Tensor,
    delta: torch.Tensor,
    buffer: torch.Tensor | None,
    cfg: OuterConfig,
    *,
    consume_delta: bool = False,
) -> torch.Tensor | None:
    """In place: one SGD step on ``param`` (and ``buffer``) with ``delta`` as the gradient.

    Replicates ``torch.optim.SGD``'s single-tensor op order exactly. Returns the buffer to keep
    (a new one on the first momentum step, ``None`` without momentum). ``consume_delta``: as in
    ``outer_step``. Raises
    ``LocalProtocolError`` when shapes differ.
    """
    if param.shape != delta.shape or (buffer is not None and buffer.shape != param.shape):
        raise LocalProtocolError(
            f"outer step shapes differ: param {tuple(param.shape)}, delta "
            f"{tuple(delta.shape)}, buffer {None if buffer is None else tuple(buffer.shape)}"
        )
    grad = delta.detach()
    if cfg.momentum != 0:
        if buffer is None:
            buffer = copy_vector(grad)
        else:
            buffer.mul_(cfg.momentum).add_(grad, alpha=1)
        if cfg.nesterov:
            grad = (grad.add_ if consume_delta else grad.add)(buffer, alpha=cfg.momentum)
        else:
            grad = buffer
    with torch.no_grad():
        param.add_(grad, alpha=-cfg.lr)
    return buffer
