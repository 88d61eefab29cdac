"""Islands that shard: rank 0 speaks for an FSDP island, one fragment gathered at a time.

An island of N ranks can shard its model with PyTorch's FSDP2 (``fully_shard``): every rank
holds 1/N of each parameter (a ``DTensor`` sharded on dim 0), of its gradient and of its AdamW
moments, instead of a whole replica as under DDP. The swarm still sees one peer per island.

Which rank talks to the swarm? Rank 0, as for a DDP island (``node.diloco.ranks``); its
``Island`` reads a fragment's parameters only to ship a pseudo-gradient and writes them only to
adopt a version, and ``ShardedFragments.full`` gathers exactly that fragment for exactly that
while: each of the fragment's parameters is gathered to rank 0 (``dist.gather`` of the padded
dim-0 shards), the island computes on the full tensors, and an adoption is scattered back
(``dist.scatter``) into every rank's shard before the fragment's full tensors are freed. So no
rank ever holds more than one fragment's full parameters beside its shards. We chose this over
"each rank ships its own shards" because the swarm's unit is a signed fragment from one peer:
per-rank shards would need N signed sub-contributions per fragment, owners that reassemble them
and a fragment plan that depends on N, while rank 0 gathering keeps the wire, the owners and the
plan exactly as for a one-process island. The cost is rank 0's ``Island`` bookkeeping: its
global copy of every fragment (fp32, CPU) and, while one is in flight, that fragment's snapshot,
as on any island; the inner optimizer state and gradients stay sharded.

The gathers are collectives, but only rank 0's island knows when it needs one. So the other
ranks serve rank 0's requests: at each point where rank 0's island may touch parameters (its
step hook, joining, flushing, adopting the finals) the other ranks wait in ``settle``, which
takes commands broadcast by rank 0 (gather fragment p; gather and write back fragment p) until
rank 0 calls ``settle`` itself, which says "done". An adoption therefore lands in every rank's
shard within the same step, as the DDP island's broadcast does.

Works with FSDP2's default layout: a 1-D device mesh over the island's process group, every
parameter ``Shard(0)`` (``torch.chunk`` along dim 0, the last ranks' shards shorter or empty).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from protocol.diloco.fragments import FragmentPlan

__all__ = [
    "ShardedFragments",
    "full_parameters",
    "held_bytes",
    "is_sharded",
    "reshard",
    "shard_model",
]

_DONE, _READ, _WRITE, _DROP = 0, 1, 2, 3  # rank 0's commands to the other ranks


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 ``DTensor`` shards (``fully_shard`` applied)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard_model(model: nn.Module, units: Iterable[nn.Module]) -> nn.Module:
    """FSDP2 over the island's default process group, as the PyTorch docs apply it: ``fully_shard``
    on each of ``units`` (e.g. the transformer blocks: each is gathered for its own forward and
    backward, then freed) and then on ``model`` itself (what is left: embeddings, head, final
    norm). Every parameter becomes a ``DTensor`` sharded on dim 0; names and global shapes stay,
    so the fragment plan is the one a one-process island makes. Returns ``model`` (sharded in
    place). Raises ``RuntimeError`` without an initialised process group."""
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sharding a model needs torch.distributed initialised (torchrun)")
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    return model


def reshard(model: nn.Module) -> None:
    """Back to the sharded parameters after a forward without backward (an evaluation). FSDP2
    keeps the root module's parameters unsharded after its forward, for the backward it expects:
    ``named_parameters`` then yields whole tensors, and an adoption written into the shards would
    not reach the next forward, which reuses them. Local, no collective; nothing when sharded."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` of each parameter in name order, one at a time: on a sharded
    model a collective (every rank must iterate it to the end), each ``DTensor`` all-gathered and
    let go before the next, so no rank holds more than one whole parameter beside its shards."""
    for name, p in sorted(model.named_parameters()):
        full_tensor = getattr(p, "full_tensor", None)
        yield name, (full_tensor() if callable(full_tensor) else p).detach()


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of parameters and optimizer state this rank holds: local shards for ``DTensor``s
    (what sharding saves), whole tensors otherwise."""
    total = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += _local(v).numel() * v.element_size()
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ShardedFragments:
    """Gathers one fragment of an FSDP2-sharded model to rank 0 and writes it back (collectives)."""

    def __init__(
        self,
        model: nn.Module,
        plan: FragmentPlan,
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """``optimizer``: the inner optimizer over the shards (a resync drops its non-finite
        state on every rank). Raises ``ValueError`` for a parameter that is not a dim-0 shard over ``group`` (apply
        ``fully_shard`` to the model, and to nothing with another mesh), ``RuntimeError`` without
        torch.distributed."""
        from torch.distributed.tensor import DTensor, Shard

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("a sharded island needs torch.distributed initialised (torchrun)")
        self.group, self.optimizer = group, optimizer
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        named = dict(model.named_parameters())
        self.params: list[list[nn.Parameter]] = [
            [named[n] for n in f.names] for f in plan.fragments
        ]
        for name, p in named.items():
            if not (
                isinstance(p, DTensor)
                and p.device_mesh.ndim == 1
                and p.device_mesh.size() == self.world
                and p.placements == (Shard(0),)
            ):
                raise ValueError(
                    f"parameter {name!r} is not an FSDP2 dim-0 shard over the island's {self.world} "
                    "ranks: apply fully_shard(model) (default mesh) before building the island"
                )
        self._model = model
        self._cmd = torch.zeros(2, dtype=torch.int64)
        self.gathers = self.writes = 0  # fragments gathered, and written back, so far
        self._open = 0  # fragments gathered right now (rank 0)
        self.most_open = 0  # the most fragments rank 0 ever held gathered at once

    # --- rank 0 --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def full(self, p: int, params: list[nn.Parameter], *, write: bool) -> Iterator[None]:
        """Rank 0: for the ``with`` block, ``params`` (the island's list of fragment ``p``'s
        parameters) holds their full tensors; with ``write`` they are then scattered back into
        every rank's shard. The other ranks take part from ``settle``."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank}: only rank 0 gathers fragments")
        reshard(self._model)
        self._send(_WRITE if write else _READ, p)
        shards = list(params)
        fulls = [self._gather(s) for s in shards]
        params[:] = fulls  # type: ignore[assignment]  # plain tensors, for the island's arithmetic
        self._open += 1
        self.most_open = max(self.most_open, self._open)
        try:
            yield
        finally:
            params[:] = shards
            self._open -= 1
        if write:
            for shard, full in zip(shards, fulls, strict=True):
                self._scatter(shard, full)
            self.writes += 1
        self.gathers += 1

    def drop_nonfinite_state(self, p: int) -> None:
        """Rank 0 (a resync): every rank forgets the inner-optimizer state of each of fragment
        ``p``'s parameters whose shard of it holds a NaN or Inf (``Adoption.drop_nonfinite_state``
        for shards: each rank checks its own, with no collective that rank 0 would wait on)."""
        self._send(_DROP, p)
        self._drop_local(p)

    def _drop_local(self, p: int) -> None:
        for param in self.params[p]:
            state = self.optimizer.state.get(param)
            if state and not all(
                bool(torch.isfinite(_local(v)).all())
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ):
                del self.optimizer.state[param]

    def settle(self) -> None:
        """A collective: rank 0 says it is done gathering; every other rank serves rank 0's
        gathers and write-backs until then."""
        if self.rank == 0:
            self._send(_DONE, 0)
            return
        reshard(self._model)
        while True:
            dist.broadcast(self._cmd, src=0, group=self.group)
            op, p = (int(v) for v in self._cmd.tolist())
            if op == _DONE:
                return
            if op == _DROP:
                self._drop_local(p)
                continue
            for shard in self.params[p]:
                self._gather(shard)
            if op == _WRITE:
                for shard in self.params[p]:
                    self._scatter(shard, None)
                self.writes += 1
            self.gathers += 1

    def _send(self, op: int, p: int) -> None:
        self._cmd[0], self._cmd[1] = op, p
        dist.broadcast(self._cmd, src=0, group=self.group)

    # --- one parameter -------------------------------------------------------------------------
    def _rows(self, param: torch.Tensor) -> int:
        """Rows of each rank's padded shard: ``torch.chunk``'s chunk size along dim 0."""
        return math.ceil(param.shape[0] / self.world)

    @torch.no_grad()
    def _gather(self, param: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of ``param`` to rank 0: its full tensor there, an empty one elsewhere."""
        local = _local(param)
        rows, rest = self._rows(param), tuple(param.shape[1:])
        padded = local.new_zeros((rows, *rest))
        padded[: local.shape[0]].copy_(local)
        if self.rank != 0:
            dist.gather(padded, None, dst=0, group=self.group)
            return padded.new_empty(0)
        out = local.new_empty((rows * self.world, *rest))
        dist.gather(padded, list(out.chunk(self.world)), dst=0, group=self.group)
        return out[: param.shape[0]]

    @torch.no_grad()
    def _scatter(self, param: torch.Tensor, full: torch.Tensor | None) -> None:
        """Rank 0's ``full`` tensor into every rank's shard of ``param``."""
        local = _local(param)
        rows, rest = self._rows(param), tuple(param.shape[1:])
        mine = local.new_empty((rows, *rest))
        chunks = None
        if full is not None:
            padded = local.new_zeros((rows * self.world, *rest))
            padded[: full.shape[0]].copy_(full)
            chunks = list(padded.chunk(self.world))
        dist.scatter(mine, chunks, src=0, group=self.group)
        local.copy_(mine[: local.shape[0]])
