"""Islands of several processes: rank 0 speaks for the island, every rank holds its fragments.

A lab's island is often a ``torchrun`` job: N processes train one replica with DDP (gradients
all-reduced every inner step, so every rank holds the same parameters). Only rank 0 joins the
swarm: its ``Island`` hook adopts arrived global fragments and ships due pseudo-gradients. The
other ranks must adopt the same fragments at the same step, or DDP's replicas drift apart.

``IslandRanks.sync`` is that step, a collective every rank calls at the same points (after each
inner step, from its own optimizer hook registered after the island's, and when the island
joins or finishes): rank 0 broadcasts the versions it holds and how often it replaced each
fragment (one small int64 tensor); a fragment replaced since the last sync is broadcast whole
from rank 0, tensor by tensor. Tokens count
the whole island: ``tokens`` sums every rank's count (one more small all-reduce) and rank 0
gives the island the sum.

Works with any process group: gloo on CPU, NCCL on GPUs (tensors are broadcast on the
parameters' own device).

An FSDP island (``shards``: its parameters are ``fully_shard`` shards, ``node.diloco.sharding``)
broadcasts no fragment: rank 0's island gathers a fragment and scatters an adoption back into
every rank's shard itself, while the other ranks serve those collectives from ``sync``'s first
call, ``ShardedFragments.settle``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from node.diloco.island import Island
from node.diloco.sharding import ShardedFragments
from protocol.diloco.fragments import FragmentPlan

__all__ = [
    "IslandRanks",
    "distributed_rank",
    "exit_without_teardown",
    "leave_process_group",
    "rank_memory",
    "unwrap",
]

log = logging.getLogger(__name__)


def distributed_rank() -> tuple[int, int]:
    """``(rank, world size)`` of this process's default process group, or ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class IslandRanks:
    """Keeps every rank of a multi-process island on the global fragments rank 0 adopts."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: FragmentPlan,
        island: Island | None,
        *,
        group: dist.ProcessGroup | None = None,
        shards: ShardedFragments | None = None,
    ) -> None:
        """``island``: the swarm-facing island on rank 0, None on the other ranks. ``shards``:
        the model is FSDP-sharded, and rank 0's island gathers through it."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a multi-process island needs torch.distributed initialised (torchrun sets it up)"
            )
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if (self.rank == 0) != (island is not None):
            raise ValueError(
                f"rank {self.rank}: the swarm-facing island belongs on rank 0 and only there"
            )
        self.island = island
        self.shards = shards
        by_name = dict(model.named_parameters())
        self.params: list[list[nn.Parameter]] = [
            [by_name[n] for n in f.names] for f in plan.fragments
        ]
        device = self.params[0][0].device if self.params and self.params[0] else torch.device("cpu")
        self._n = len(plan.fragments)
        # rank 0's versions, then its adoption counts (a final or a resync replaces a fragment at
        # the version held: the count, not the version, says the parameters were replaced)
        self._versions = torch.zeros(2 * self._n, dtype=torch.int64, device=device)
        self._seen = torch.full_like(self._versions, -1)
        self._tokens = torch.zeros(1, dtype=torch.int64, device=device)
        self.syncs = 0
        self.told_to_stop = False  # rank 0 has broadcast its decision to stop
        self.broadcasts = 0  # fragments broadcast from rank 0
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def agree(self, go_on: bool) -> bool:
        """Rank 0's decision whether to take another step, on every rank (a collective)."""
        flag = torch.tensor([int(go_on)], dtype=torch.int64, device=self._tokens.device)
        dist.broadcast(flag, src=0, group=self.group)
        go = bool(flag.item())
        self.told_to_stop = self.told_to_stop or not go
        return go

    def start_step(self, step: int) -> int:
        """Rank 0's first step on the schedule, on every rank (a collective, once, after the first
        ``sync``): every rank's learning rate follows the same steps."""
        start = torch.tensor([int(step)], dtype=torch.int64, device=self._tokens.device)
        dist.broadcast(start, src=0, group=self.group)
        return int(start.item())

    def _after_step(self, _opt: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        self.sync()

    def tokens(self, n: int) -> int:
        """Every rank's tokens of the step about to be taken, summed (a collective: all ranks
        call it before each ``optimizer.step()``); rank 0 counts the sum into its island."""
        self._tokens.fill_(int(n))
        dist.all_reduce(self._tokens, group=self.group)
        total = int(self._tokens.item())
        if self.island is not None:
            self.island.tokens(total)
        return total

    @torch.no_grad()
    def sync(self) -> list[int]:
        """Give every rank the fragments rank 0 holds (a collective); returns the fragments that
        were broadcast (a sharded island: that rank 0 replaced, already written into every shard)."""
        if self.shards is not None:
            self.shards.settle()  # rank 0's gathers and write-backs since the last sync
        if self.island is not None:
            self._versions.copy_(
                torch.tensor(self.island.versions + self.island.adoptions, dtype=torch.int64)
            )
        dist.broadcast(self._versions, src=0, group=self.group)
        differs = (self._versions != self._seen).view(2, self._n).any(dim=0)
        changed = [int(p) for p in torch.nonzero(differs).flatten().tolist()]
        for p in changed if self.shards is None else ():
            for param in self.params[p]:
                dist.broadcast(param.data, src=0, group=self.group)
        self._seen.copy_(self._versions)
        self.syncs += 1
        self.broadcasts += len(changed)
        return changed

    @property
    def versions(self) -> list[int]:
        """The versions this rank holds (as of its last ``sync``)."""
        return [int(v) for v in self._seen[: self._n].tolist()]

    def close(self) -> None:
        self._hook.remove()

    def wait_for_all(self) -> None:
        """Block until every rank gets here (a collective). Ranks must leave their process group
        together: a gloo rank that destroys the group and exits while another still holds it open
        can abort in gloo's teardown (``terminate called without an active exception``, about
        1 run in 10 under load), so call this last, then ``destroy_process_group``."""
        dist.barrier(group=self.group)


def rank_memory(
    held_bytes: int, max_rss_bytes: int, device: torch.device | None = None
) -> list[dict[str, int]]:
    """Every rank's bytes of parameters and optimizer state held and its peak resident bytes, in
    rank order: what sharding saves, per rank (a collective on a multi-process island: one small
    ``all_gather`` on ``device``, the parameters' (NCCL's are on the GPU); just this process's
    without one)."""
    _, world = distributed_rank()
    mine = torch.tensor([held_bytes, max_rss_bytes], dtype=torch.int64, device=device)
    every = [mine] if world == 1 else [torch.zeros_like(mine) for _ in range(world)]
    if world > 1:
        dist.all_gather(every, mine)
    return [
        {"rank": r, "held_bytes": int(t[0]), "max_rss_bytes": int(t[1])}
        for r, t in enumerate(every)
    ]


def leave_process_group() -> None:
    """End the default process group on every rank at once (a collective; see
    ``IslandRanks.wait_for_all``); nothing without one."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Flush stdout, stderr and the log handlers, then end the process with ``code`` at once
    (``atoll peer``, every rank of ``atoll join --nproc N``, any ``SwarmIsland`` script run
    under torchrun).

    Call it once the results are out and every file is written and closed (and, on a rank of a
    multi-process island, after every rank passed the final barrier and destroyed the process
    group). Two reasons not to go through the interpreter's teardown:

    - On a rank, DDP's reducer and FSDP's device mesh still hold the gloo group after
      ``destroy_process_group``, so its C++ objects (context, sockets, the tensors of its last
      work) would be freed during interpreter finalization, with the other rank possibly gone
      already, where gloo's teardown can abort the process (SIGABRT, "terminate called without
      an active exception"; PyTorch PR #179291 describes that finalization crash). torchrun then
      reports the island failed after its result was out, the more often the busier the machine
      (docs/islands.md).
    - Freeing every module torch brought in, and their exit hooks, takes 1-2 s of CPU per process
      on a small machine, paid by every peer of a local swarm while its launcher waits.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` (or FSDP-style ``.module``) wrapper: the
    fragment plan is made from parameter names, which must not depend on how many ranks an
    island has."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ in _WRAPPERS else model


_WRAPPERS: Sequence[str] = ("DistributedDataParallel", "DataParallel")
