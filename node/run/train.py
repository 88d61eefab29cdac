"""A peer's main (``python -m node peer``, ``atoll join``): ``run_peer`` in three phases.

build (``build_workload``, ``build_peer``): the model, data and optimizer, the island (resumed
from its checkpoint) and its node; run (``join_swarm``, ``TrainingLoop``): join, then one loop
top to bottom, as nanoGPT reads; finish (``finish_peer``, ``peer_result``): flush, the final
versions, a typed ``PeerResult``. The asyncio node runs on a background thread (``NodeThread``);
this thread only trains and talks to it through the island's hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from node.config import FSDP_CANNOT_VALIDATE, FSDP_NEEDS_RANKS, RunConfig
from node.dht.swarm import SwarmCredentials
from node.diloco.allocator import bound_for_model, heap_in_use
from node.diloco.inner import joining_step, lr_at, make_inner_optimizer
from node.diloco.island import Island, Outgoing
from node.diloco.island_config import flush_at_end, island_config
from node.diloco.ranks import IslandRanks, distributed_rank, leave_process_group, rank_memory
from node.diloco.sharding import (
    ShardedFragments,
    full_parameters,
    held_bytes,
    reshard,
    shard_model,
)
from node.diloco.validation import WindowEvaluator, window_evaluator
from node.peer import NodeOptions, PeerNode, emit
from node.run.attack import Attack
from node.run.attack_peer import PeerAttack, is_peer_attack
from node.run.memtrace import MemTrace
from node.run.recipes import LoadedRecipe
from node.run.report import WARMUP
from node.run.resume import IslandCheckpoints
from node.state.artifacts import ArtifactStore
from node.workload.baseline import TrainConfig, sampler_seed, train_config_for
from node.workload.corpus import (
    BatchSampler,
    CorpusShard,
    evaluate,
    load_corpus,
    split_corpus,
    validation_slice,
)
from node.workload.model import GPT, GPTConfig, embedding_parameter_names
from node.workload.presets import resolved
from node.workload.standin import StandinOptimizer
from node.workload.token_data import TrainStream
from protocol.diloco.fragments import FragmentPlan, plan_fragments
from protocol.wire.signing import Signer

__all__ = [
    "FollowerResult",
    "PeerOptions",
    "PeerResult",
    "data_seed_of",
    "global_param_hash",
    "inner_step",
    "island_sampler",
    "resolved",
    "run_peer",
]

log = logging.getLogger("atoll.train")


def global_param_hash(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the global model's fp32 bytes, tensors in name order."""
    return tensors_hash((name, state[name]) for name in sorted(state))


def tensors_hash(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over each ``(name, tensor)``'s name and fp32 bytes, in the order given."""
    h = hashlib.sha256()
    for name, tensor in named:
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_param_hash(model: torch.nn.Module) -> str:
    """``global_param_hash`` of ``model``'s parameters; on an FSDP island a collective that
    gathers one parameter at a time (``full_parameters``)."""
    return tensors_hash(full_parameters(model))


def island_sampler(
    cfg: RunConfig,
    train: torch.Tensor,
    block_size: int,
    index: int,
    *,
    rank: int = 0,
    own_seed: int | None = None,
) -> BatchSampler:
    """Island ``index``'s batches: its own shard of the train split, its own seed (and for the
    ranks of a multi-process island, each rank its own seed within the island's shard).

    ``own_seed`` (a joining peer's, ``data_seed_of`` its key): windows from the whole train split
    with that seed instead. A peer of a swarm whose size it does not know has no shard of its
    own, and joiners that drew the same index of ``--peers`` would train on the same batches."""
    seed, shard, n_shards, sharding = (
        (sampler_seed(cfg.seed, index), index, cfg.peers, cfg.sharding)
        if own_seed is None
        else (own_seed, 0, 1, "contiguous")
    )
    return BatchSampler(
        train,
        CorpusShard(shard, n_shards, sharding),
        batch_size=cfg.batch_size,
        block_size=block_size,
        seed=seed + RANK_SEED_STRIDE * rank,
    )


def data_seed_of(peer_id: bytes) -> int:
    """A joining peer's sampler seed, from its key: its own, and the same after a restart."""
    return int.from_bytes(hashlib.sha256(b"atoll data order " + peer_id).digest()[:6], "big")


RANK_SEED_STRIDE = 7919


def start_ranks(device: torch.device) -> tuple[int, int]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the island's process group (NCCL on GPUs,
    gloo on CPU) and return ``(rank, world size)``; ``(0, 1)`` otherwise."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return distributed_rank()


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tcfg: TrainConfig,
    step: int,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    rewarm_from: int = 0,
) -> torch.Tensor:
    """One inner step on batch x, y ([B, T] int64): set the lr (``lr_at``), forward, backward,
    clip, step (on an island the optimizer's hook then adopts and ships fragments); returns the
    loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, tcfg, rewarm_from=rewarm_from)
    # on a GPU the forward runs in bf16 autocast (weights, grads and AdamW stay fp32)
    with torch.autocast("cuda", dtype=torch.bfloat16) if x.is_cuda else contextlib.nullcontext():
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def standin_step(
    optimizer: StandinOptimizer, tcfg: TrainConfig, step: int, *, rewarm_from: int = 0
) -> None:
    """One stand-in inner step (``--compute standin``): the lr the schedule gives ``step`` (it
    scales the update), then the step (on an island the hook then adopts and ships)."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, tcfg, rewarm_from=rewarm_from)
    optimizer.next_step = step
    optimizer.step()


def _eval_global(
    model: torch.nn.Module, island: Island, heldout: torch.Tensor, cfg: RunConfig, block_size: int
) -> float:
    scratch = GPT(model.config) if isinstance(model, GPT) else copy.deepcopy(model)
    scratch.load_state_dict(island.global_state(), strict=isinstance(model, GPT))
    return evaluate(
        scratch,
        heldout,
        batch_size=cfg.batch_size,
        block_size=block_size,
        n_batches=cfg.eval_batches,
    )


def _read_stdin_line() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        return {"stop": True}
    return dict(json.loads(line))


@dataclass(frozen=True, slots=True)
class PeerOptions:
    """Where a peer listens and whom it joins through (not part of the swarm's config)."""

    index: int = 0
    initial_peers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    public_address: str | None = None
    t0: float = 0.0  # wall-clock origin of the eval curves (the launcher's start)
    wait_for_stop: bool = True  # after the result, serve until the launcher says stop
    initial_peers_from_stdin: bool = (
        False  # the launcher sends {"initial_peers": [...]} once known,
    )
    # then {"start": true} once every peer is ready, so that all islands start their steps together
    wait_members: int = 1  # start training once this many members are visible (a local swarm: all)
    final_sync: bool = True  # end on the owners' final versions (a local swarm, where all finish)
    serve_after_s: float = 0.0  # without a launcher: keep serving this long after training
    slow_factor: float = (
        1.0  # fault injection: stretch every inner step to this many times its length
    )
    attack: str = (
        ""  # measurement: send malicious contributions (node.run.attack), e.g. "scale=1000"
    )
    checkpoint_dir: Path | None = (
        None  # save the island every H steps here; resume from it at start
    )
    event_log_dir: Path | None = None  # owners log their mergers' events here (atoll replay)
    until: float = 0.0  # stop training at this unix time even if steps remain (0: run all steps)
    signer: Signer | None = None  # this peer's key (None: a fresh one)
    credentials: SwarmCredentials | None = None  # the swarm's manifest and our certificate
    events: Callable[..., None] | None = (
        None  # event(name, **fields); None: JSON lines on stdout (emit)
    )
    own_data_seed: int | None = (
        None  # a joiner's: batches from the whole corpus with this seed (island_sampler)
    )
    schedule: str = (
        "own"  # "swarm": start the lr schedule where the swarm's learners are (atoll join)
    )
    recipe: LoadedRecipe | None = None  # the swarm's recipe, its artifacts held (atoll join)
    artifacts: ArtifactStore | None = None  # served to members (the recipe's artifacts)
    # a multi-process island's ranks: "ddp" (each a replica) or "fsdp" (each a shard, FSDP2)
    shard: str = "ddp"
    may_own: bool = True  # False: a learner only, which reads a bounded view of the members


# --- build: the model, its data and its optimizer; the island and its node ---------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """One process's model, data and inner optimizer (the same on every rank of an island)."""

    gcfg: GPTConfig
    device: torch.device
    rank: int
    world: int
    model: torch.nn.Module  # identical on every peer at the start: version 0 of every fragment
    stepper: torch.nn.Module  # the model, or DDP around it on a multi-process island
    optimizer: torch.optim.Optimizer
    tcfg: TrainConfig
    plan: FragmentPlan
    sampler: BatchSampler | TrainStream | None  # None with stand-in compute: no corpus
    heldout: torch.Tensor | None  # (n,) uint8 (a recipe's: int64 tokens); None: stand-in compute
    learners: RecipeLearners | None = None  # a recipe's: whom its shards are dealt among
    # an FSDP island's (``--shard fsdp``): rank 0's island gathers one fragment at a time
    shards: ShardedFragments | None = None

    @property
    def standin(self) -> StandinOptimizer | None:
        """The stand-in compute in the optimizer's place (``--compute standin=...``), or None."""
        return self.optimizer if isinstance(self.optimizer, StandinOptimizer) else None

    def evaluate(self, model: torch.nn.Module, cfg: RunConfig) -> float | None:
        """``model``'s held-out loss on ``cfg.eval_batches`` batches (None: stand-in compute)."""
        if self.heldout is None:
            return None
        loss = evaluate(
            model,
            self.heldout,
            batch_size=cfg.batch_size,
            block_size=self.gcfg.block_size,
            n_batches=cfg.eval_batches,
        )
        if self.shards is not None:
            reshard(model)  # FSDP2 left the root's parameters whole, awaiting a backward
        return loss


def build_workload(cfg: RunConfig, opts: PeerOptions) -> Workload:
    """The GPT preset ``cfg.model``, the corpus split, this island's sampler and AdamW. Under
    ``torchrun`` it joins the island's process group first. Raises ``RuntimeError`` for a CUDA
    device torch does not see, or a checkpoint folder on a multi-process island. A recipe
    swarm's peer (``opts.recipe``) builds the recipe's model and data (``_recipe_workload``)."""
    if opts.recipe is not None and opts.recipe.recipe.data:
        return _recipe_workload(cfg, opts, opts.recipe)
    gcfg = GPTConfig.preset(cfg.model)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device here")
    rank, world = start_ranks(device)  # under torchrun: a multi-process island (DDP inside)
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and opts.checkpoint_dir is not None:
        raise RuntimeError(
            "--checkpoint-dir is not supported for islands of several processes yet "
            "(every rank's optimizer state would have to be saved); leave it out with --nproc"
        )
    model = GPT(gcfg, seed=cfg.seed).to(device)
    # large models and FSDP ranks: freed tensors go back (docs/scale.md, docs/islands.md)
    bound_for_model(4 * model.num_params(), sharded=opts.shard == "fsdp")
    tcfg = train_config_for(cfg)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if cfg.standin is not None:
        return _standin_workload(cfg, opts, gcfg, device, model, tcfg, world)
    data = load_corpus(Path(cfg.corpus) if cfg.corpus else None, max_bytes=cfg.corpus_max_bytes)
    train, heldout = split_corpus(data)
    sampler = island_sampler(
        cfg, train, gcfg.block_size, opts.index, rank=rank, own_seed=opts.own_data_seed
    )
    plan = plan_fragments(shapes, cfg.fragments, embeddings=embedding_parameter_names(model))
    if opts.shard == "fsdp":
        return _sharded_workload(cfg, model, plan, tcfg, sampler, heldout, device, (rank, world))
    return Workload(
        gcfg=gcfg,
        device=device,
        rank=rank,
        world=world,
        model=model,
        stepper=_data_parallel(model, device) if world > 1 else model,
        optimizer=make_inner_optimizer(model, tcfg),
        tcfg=tcfg,
        plan=plan,
        sampler=sampler,
        heldout=heldout,
    )


def _sharded_workload(
    cfg: RunConfig,
    model: GPT,
    plan: FragmentPlan,
    tcfg: TrainConfig,
    sampler: BatchSampler,
    heldout: torch.Tensor,
    device: torch.device,
    ranks: tuple[int, int],
) -> Workload:
    """An FSDP island's rank (``--shard fsdp``): ``fully_shard`` on each transformer block and
    on the GPT (every rank built it whole from the same seed; each keeps its 1/N), AdamW over the
    shards, and the ``ShardedFragments`` rank 0's island gathers through. Raises ``RuntimeError``
    on a one-process island or with validated publication (rank 0 alone cannot run the forward)."""
    rank, world = ranks
    if world < 2:
        raise RuntimeError(FSDP_NEEDS_RANKS)
    if cfg.validate_windows > 0:
        raise RuntimeError(FSDP_CANNOT_VALIDATE)
    shard_model(model, model.h)
    optimizer = make_inner_optimizer(model, tcfg)
    return Workload(
        gcfg=model.config,
        device=device,
        rank=rank,
        world=world,
        model=model,
        stepper=model,  # FSDP reduce-scatters the gradients itself: no DDP around it
        optimizer=optimizer,
        tcfg=tcfg,
        plan=plan,
        sampler=sampler,
        heldout=heldout,
        shards=ShardedFragments(model, plan, optimizer),
    )


class RecipeLearners:
    """The learners a recipe's shards are dealt among (``TrainStream``): this peer and the
    members whose records say they learn, read from the node once it serves."""

    def __init__(self, me: bytes) -> None:
        self.me = me
        self.node: PeerNode | None = None

    def __call__(self) -> list[bytes]:
        membership = self.node.membership if self.node is not None else None
        members = list(membership.members.values()) if membership is not None else []
        return sorted({self.me, *(m.peer_id for m in members if m.record.learning)})


def _recipe_workload(cfg: RunConfig, opts: PeerOptions, loaded: LoadedRecipe) -> Workload:
    """The recipe's model (``node.workload.recipe_model``) on its data: the shards dealt to this
    peer (``RecipeData.train_stream``) and the recipe's validation set for every loss measured.
    One process per island, real compute. Raises ``RuntimeError`` otherwise."""
    import numpy as np

    from node.workload.recipe_model import build_recipe_model
    from node.workload.token_data import RecipeData, RecipeFiles

    if cfg.standin is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("a recipe swarm runs one process per island with real compute")
    recipe, device = loaded.recipe, torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device here")
    if opts.signer is None:
        raise RuntimeError("a recipe swarm's peer needs its key (shards are dealt by peer id)")
    me = opts.signer.peer_id
    try:  # a dataset that cannot be read, a model that cannot be built: one line, no traceback
        data = RecipeData(
            _data_spec(recipe),
            RecipeFiles(loaded.files[recipe.tokenizer], loaded.store.path, loaded.cache_dir),
            seq_len=recipe.seq_len,
            batch_size=recipe.batch_size,
            me=me,
            seed=recipe.seed,
        )
        model = build_recipe_model(recipe, loaded.files, vocab_size=data.vocab_size, seed=cfg.seed)
    except ValueError as exc:  # DataError, RecipeModelError
        raise RuntimeError(f"the recipe cannot be trained: {exc}") from None
    learners = RecipeLearners(me)
    model = model.to(device)
    # TrainConfig's model names a preset for the data-parallel baseline only: not used here
    tcfg = train_config_for(dataclasses.replace(cfg, model="tiny"))
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return Workload(
        gcfg=GPTConfig(block_size=recipe.seq_len, vocab_size=data.vocab_size),  # shape only
        device=device,
        rank=0,
        world=1,
        model=model,
        stepper=model,
        optimizer=make_inner_optimizer(model, tcfg),
        tcfg=tcfg,
        plan=plan_fragments(shapes, cfg.fragments, embeddings=embedding_parameter_names(model)),
        sampler=data.train_stream(learners),
        heldout=torch.from_numpy(np.asarray(data.validation, dtype=np.int64)),  # (n,) tokens
        learners=learners,
    )


def _data_spec(recipe: Any) -> Any:
    from node.workload.token_data import DataSpec

    return DataSpec.from_table(recipe.data_table)


def _standin_workload(
    cfg: RunConfig,
    opts: PeerOptions,
    gcfg: GPTConfig,
    device: torch.device,
    model: GPT,
    tcfg: TrainConfig,
    world: int,
) -> Workload:
    """Stand-in compute's workload: the model and a ``StandinOptimizer`` in AdamW's place; no
    corpus, no sampler, no held-out split, no optimizer state. Raises ``RuntimeError`` on a
    multi-process island (its ranks would each step the shared model)."""
    if world > 1:
        raise RuntimeError(
            "--compute standin runs one process per island: leave out --nproc (or use --compute real)"
        )
    spec = cfg.standin
    assert spec is not None
    peer_seed = (
        opts.own_data_seed if opts.own_data_seed is not None else sampler_seed(cfg.seed, opts.index)
    )
    optimizer = StandinOptimizer(
        model.parameters(), spec, lr=cfg.lr, run_seed=cfg.seed, peer_seed=peer_seed
    )
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return Workload(
        gcfg=gcfg,
        device=device,
        rank=0,
        world=1,
        model=model,
        stepper=model,
        optimizer=optimizer,
        tcfg=tcfg,
        plan=plan_fragments(shapes, cfg.fragments, embeddings=embedding_parameter_names(model)),
        sampler=None,
        heldout=None,
    )


def _data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


class NodeOutbox:
    """The island's ``submit``: hands each due fragment to the node's network side, which exists
    while the node serves. The island is built before the node (a resumed checkpoint tells the
    node which versions it holds), so the node is attached once built."""

    def __init__(self) -> None:
        self._node: PeerNode | None = None

    def attach(self, node: PeerNode) -> None:
        self._node = node

    def __call__(self, out: Outgoing) -> None:
        net = self._node.net if self._node is not None else None
        if net is not None:
            net.submit(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class IslandPeer:
    """Rank 0's swarm side, built but not started: the island (resumed from its checkpoint if it
    has one) and the node that speaks for it."""

    work: Workload
    signer: Signer
    island: Island
    ranks: IslandRanks | None  # the other ranks of a multi-process island
    checkpoints: IslandCheckpoints | None
    resumed_step: int | None  # the step a checkpoint resumed at (None: a fresh start)
    evaluator: WindowEvaluator | None  # validated publication (None: off)
    validation_hash: str  # SHA-256 of the pinned validation slice ("": none, stand-in compute)
    node: PeerNode
    eval_start: float | None  # the global model's held-out loss at the start (None: stand-in)


def build_peer(
    cfg: RunConfig, opts: PeerOptions, work: Workload, say: Callable[..., None]
) -> IslandPeer:
    """The island around ``work``'s model, resumed from ``opts.checkpoint_dir`` if it holds a
    checkpoint, its evaluator for validated publication, and its node (not serving yet)."""
    signer = opts.signer or Signer.from_seed(os.urandom(32))
    # the global model at the start: version 0 of every fragment is this deterministic init
    eval_start = work.evaluate(work.model, cfg)
    outbox = NodeOutbox()
    island = Island(
        work.model,
        work.optimizer,
        work.plan,
        submit=outbox,
        cfg=island_config(cfg, work.optimizer),
        shards=work.shards,  # an FSDP island: its version 0 gathered one fragment at a time
    )
    ranks = (
        IslandRanks(work.model, work.optimizer, work.plan, island, shards=work.shards)
        if work.world > 1
        else None
    )
    # stand-in compute has no data order to save: its steps are seeded by their index
    generator = work.sampler.generator if work.sampler is not None else torch.Generator()
    checkpoints = (
        IslandCheckpoints(opts.checkpoint_dir, work.model, work.optimizer, island, generator)
        if opts.checkpoint_dir
        else None
    )
    # version 0 of every fragment, kept only where a checkpoint may replace it (the node then
    # starts from the checkpoint's versions): a whole model's fp32 bytes otherwise spent for nothing
    initial_global = (
        [g.clone() for g in island.global_flat]
        if checkpoints is not None and checkpoints.store.steps()
        else []
    )
    resumed = checkpoints.restore() if checkpoints is not None else None
    if resumed:
        say("resumed", index=opts.index, step=int(resumed["step"]), versions=list(island.versions))
    evaluator, validation_hash = _validation(cfg, opts, work)
    node = _peer_node(cfg, opts, work, signer, evaluator, initial_global, resumed)
    outbox.attach(node)
    # under a launcher, which checks every version's content
    node.announce_versions = opts.initial_peers_from_stdin
    return IslandPeer(
        work=work,
        signer=signer,
        island=island,
        ranks=ranks,
        checkpoints=checkpoints,
        resumed_step=int(resumed["step"]) if resumed else None,
        evaluator=evaluator,
        validation_hash=validation_hash,
        node=node,
        eval_start=eval_start,
    )


def _validation(
    cfg: RunConfig, opts: PeerOptions, work: Workload
) -> tuple[WindowEvaluator | None, str]:
    """Validated publication's evaluator and the pinned slice's hash: owners check candidates on
    the pinned held-out slice. Off with stand-in compute, which measures no loss."""
    if work.heldout is None:
        if cfg.validate_windows:
            log.info("stand-in compute: validated publication is off (no loss is measured)")
        return None, ""
    validation, validation_hash = validation_slice(work.heldout)  # (m,) uint8, on every peer
    evaluator = window_evaluator(
        work.model,
        work.plan,
        None,  # the other fragments as the island trains them
        validation,
        block_size=work.gcfg.block_size,
        windows=cfg.validate_windows,
        pinned=opts.credentials.manifest.validation_sha256 if opts.credentials else "",
    )  # a held-out slice that is not the manifest's pinned one raises
    return evaluator, validation_hash


def _peer_node(
    cfg: RunConfig,
    opts: PeerOptions,
    work: Workload,
    signer: Signer,
    evaluator: WindowEvaluator | None,
    initial_global: list[torch.Tensor],
    resumed: dict[str, Any] | None,
) -> PeerNode:
    """The node that speaks for the island; a resumed one starts from the checkpoint's versions."""
    return PeerNode(
        cfg,
        signer,
        work.model,
        work.plan,
        NodeOptions(
            host=opts.host,
            port=opts.port,
            public_address=opts.public_address,
            tamper=(
                Attack.parse(opts.attack, seed=cfg.seed)  # the run's seed: attackers collude
                if opts.attack and not is_peer_attack(opts.attack)
                else None
            ),
            initial_global=initial_global if resumed else None,
            versions_known_at=float(resumed["saved_at"])
            if resumed and "saved_at" in resumed
            else None,
            event_log_dir=opts.event_log_dir,
            owner_checkpoint_dir=opts.checkpoint_dir / "owner" if opts.checkpoint_dir else None,
            evaluator=evaluator,
            artifacts=opts.artifacts,
            may_own=opts.may_own,
            whole_view=opts.recipe is not None,  # its shards are dealt among every learner seen
        ),
        credentials=opts.credentials,
    )


# --- run: join the swarm, train -----------------------------------------------------------------
class NodeThread:
    """The node's event loop (``PeerNode.serve``) on its own thread; ``crashed``: why it ended
    early (the main thread says it)."""

    def __init__(self, node: PeerNode, island: Island, initial_peers: list[str]) -> None:
        self.node = node
        self.crashed: BaseException | None = None
        self.thread = threading.Thread(
            target=self._serve, args=(island, initial_peers), name="atoll-node", daemon=True
        )

    def _serve(self, island: Island, initial_peers: list[str]) -> None:
        try:
            asyncio.run(self.node.serve(island, initial_peers))
        except BaseException as exc:
            self.crashed = exc
            log.log(
                logging.ERROR
                if self.node.joined.is_set() and self.node.failure is None
                else logging.DEBUG,
                "the node stopped: %r",
                exc,
                exc_info=True,
            )

    def start(self, timeout_s: float = 60.0) -> None:
        """Start serving; return once the node listens. Raises ``RuntimeError`` if it cannot."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.node.ready.wait(0.1):
            if self.crashed is not None or time.monotonic() > deadline:
                why = self.crashed if self.crashed is not None else f"not within {timeout_s:g} s"
                raise RuntimeError(f"the node could not start listening: {why}")


@dataclass(frozen=True, slots=True)
class Joined:
    """Where training starts once the island is in the swarm."""

    serving: NodeThread
    start_step: int
    rewarm_from: int  # the step the inner lr warms up again from (a joiner on the swarm's schedule)
    # the options it was started with, and the launcher's stop time if it sent one
    opts: PeerOptions


def join_swarm(
    cfg: RunConfig, opts: PeerOptions, peer: IslandPeer, say: Callable[..., None]
) -> Joined:
    """Start the node, join through the initial peers, wait for ``opts.wait_members`` (and a
    launcher's start), adopt the synced global fragments and pick the first step. Raises
    ``RuntimeError`` when the node cannot listen or join, or the launcher stopped the swarm."""
    node, island = peer.node, peer.island
    initial = list(opts.initial_peers)
    if opts.initial_peers_from_stdin:
        initial += list(_read_stdin_line().get("initial_peers", []))
    serving = NodeThread(node, island, initial)
    serving.start()
    say("listening", index=opts.index, url=node.url, peer_id=peer.signer.peer_id.hex())
    if not node.joined.wait(120) or node.failure is not None:
        raise RuntimeError(f"could not join the swarm: {str(node.failure) or repr(node.failure)}")
    node.wait_for_members(opts.wait_members)
    if opts.initial_peers_from_stdin:
        say("ready", index=opts.index)
        start = _read_stdin_line()
        if not start.get("start"):
            raise RuntimeError("the launcher stopped the swarm before it started")
        until = _launcher_until(start.get("until"))
        if until is not None:
            opts = replace(opts, until=until)
    island.adopt_pending()  # the synced global fragments
    start_step, rewarm_from = peer.resumed_step or 0, 0
    if opts.schedule == "swarm" and peer.resumed_step is None:
        start_step = rewarm_from = _swarm_step(cfg, opts, node, say)
    if peer.ranks is not None:
        peer.ranks.sync()
        start_step = peer.ranks.start_step(start_step)  # the followers' steps and lr are rank 0's
    say("joined", index=opts.index, versions=list(island.versions), synced=sorted(node.synced))
    return Joined(serving, start_step, rewarm_from, opts)


def _launcher_until(value: object) -> float | None:
    """The stop time in a launcher's start message (``atoll local --duration``), if any."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RuntimeError(f"the launcher's start message has a bad 'until': {value!r}")
    return float(value)


def _swarm_step(cfg: RunConfig, opts: PeerOptions, node: PeerNode, say: Callable[..., None]) -> int:
    """The step a joiner starts at on the swarm's schedule: the median of its learners' steps."""
    claims = node.learner_steps()
    start_step = joining_step(claims, cfg.steps)
    if start_step:
        say("schedule", index=opts.index, step=start_step, steps=cfg.steps, learners=len(claims))
        log.info(
            "joining the swarm's schedule at step %d of %d (the median of %d learners' steps): "
            "%d steps to train, the learning rate warmed up again over %d",
            start_step,
            cfg.steps,
            len(claims),
            cfg.steps - start_step,
            cfg.warmup_steps,
        )
    if start_step >= cfg.steps:
        log.warning(
            "the swarm's learners are at step %d, the end of this run's --steps %d: nothing to "
            "train on the swarm's schedule (pass a larger --steps, or --schedule own)",
            start_step,
            cfg.steps,
        )
    return start_step


@dataclass
class Curves:
    """What the report plots, against seconds since ``t0``: held-out losses and memory."""

    t0: float
    # (s, step, loss); empty with stand-in compute, which measures no loss
    local: list[tuple[float, int, float]] = field(default_factory=list)
    global_: list[tuple[float, int, float]] = field(default_factory=list)  # index 0 only
    # every ~5 s: (seconds, step, resident bytes, C heap in use or -1, Python's allocated blocks)
    rss: list[tuple[float, int, int, int, int]] = field(default_factory=list)

    def now(self) -> float:
        return time.time() - self.t0


class TrainingLoop:
    """Rank 0's inner steps (the island's hook adopts and ships), its evaluations, checkpoints
    and progress events, until ``cfg.steps`` or ``opts.until``."""

    def __init__(
        self,
        cfg: RunConfig,
        opts: PeerOptions,
        peer: IslandPeer,
        say: Callable[..., None],
        memtrace: MemTrace,
    ) -> None:
        self.cfg, self.opts, self.peer, self.say, self.memtrace = cfg, opts, peer, say, memtrace
        t0 = opts.t0 or time.time()
        # the trace's baseline is taken where the report's warm-up ends
        self.warm_at = t0 + WARMUP * (opts.until - t0) if opts.until else None
        self.curves = Curves(t0)
        if peer.eval_start is not None:
            self.curves.global_.append((self.curves.now(), 0, peer.eval_start))
        self.loss_ema = float("nan")

    def run(self, start_step: int, rewarm_from: int) -> None:
        cfg, peer = self.cfg, self.peer
        peer.work.model.train()
        last_progress = 0.0
        for step in range(start_step, cfg.steps):
            if not self._go_on():
                break
            t_step = time.perf_counter()
            loss = self._step(step, rewarm_from)
            if loss is not None:
                self.loss_ema = loss if step == start_step else 0.95 * self.loss_ema + 0.05 * loss
            if self.opts.slow_factor > 1.0:  # an emulated slower machine
                time.sleep((self.opts.slow_factor - 1.0) * (time.perf_counter() - t_step))
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                self._evaluate(step + 1)
            if peer.checkpoints is not None and (step + 1) % cfg.inner_steps == 0:
                peer.checkpoints.save()
            if time.monotonic() - last_progress > 1.0:
                self._sample_memory(step + 1)
                last_progress = time.monotonic()
                self._progress(step + 1)

    def _go_on(self) -> bool:
        go_on = not (self.opts.until and time.time() >= self.opts.until)
        if self.peer.ranks is not None:
            go_on = self.peer.ranks.agree(go_on)  # every rank stops at the same step
        return go_on

    def _step(self, step: int, rewarm_from: int) -> float | None:
        """One inner step on the next batch; the island's hook adopts and ships. Its loss
        (None: a stand-in step, which has none)."""
        cfg, work, island = self.cfg, self.peer.work, self.peer.island
        if cfg.overlap_block:
            island.enabled = (step // cfg.overlap_block) % 2 == 1
        if work.standin is not None:
            island.tokens(cfg.batch_size * work.gcfg.block_size)  # what a real step would train
            standin_step(work.standin, work.tcfg, step, rewarm_from=rewarm_from)
            return None
        assert work.sampler is not None  # real compute
        x, y = (t.to(work.device, non_blocking=True) for t in work.sampler.next())  # [B, T] int64
        if self.peer.ranks is not None:
            self.peer.ranks.tokens(x.numel())  # every rank's tokens count
        else:
            island.tokens(x.numel())  # counted into the contributions this step may ship
        loss = inner_step(
            work.stepper, work.optimizer, work.tcfg, step, x, y, rewarm_from=rewarm_from
        )
        return float(loss.item())

    def _evaluate(self, step: int) -> None:
        work = self.peer.work
        if work.heldout is None:
            return  # stand-in compute: no loss to measure
        local = work.evaluate(work.model, self.cfg)
        assert local is not None  # real compute
        self.curves.local.append((self.curves.now(), step, local))
        self.peer.node.board.record_validation(step, local)  # the status page's held-out curve
        # the global model whole in a scratch GPT: not on an FSDP island, whose ranks hold shards
        if self.opts.index == 0 and work.shards is None:
            at = self.curves.now()
            loss = _eval_global(
                work.model, self.peer.island, work.heldout, self.cfg, work.gcfg.block_size
            )
            self.curves.global_.append((at, step, loss))

    def _sample_memory(self, step: int) -> None:
        """Every ``RSS_EVERY_S``: resident bytes, the C heap, Python's blocks; marks the trace's
        baseline where the report's warm-up ends."""
        rss = self.curves.rss
        if rss and self.curves.now() - rss[-1][0] < RSS_EVERY_S:
            return
        heap = heap_in_use()
        warm = (
            time.time() >= self.warm_at
            if self.warm_at is not None
            else step >= WARMUP * self.cfg.steps
        )
        if warm:
            self.memtrace.mark_warm()
        rss.append(
            (
                self.curves.now(),
                step,
                resident_bytes(),
                -1 if heap is None else heap,
                sys.getallocatedblocks(),
            )
        )

    def _progress(self, step: int) -> None:
        node, island = self.peer.node, self.peer.island
        node.step = step
        node.board.record(step, self.loss_ema)  # the status page's loss curve
        self.say(
            "progress",
            index=self.opts.index,
            step=step,
            loss=None if self.peer.work.standin is not None else self.loss_ema,
            versions=list(island.versions),
            bytes_sent=node.transport.bytes_sent,
            bytes_received=node.transport.bytes_received,
            peers=len(node.membership.members) if node.membership else 0,
        )


# --- finish: every peer ends on the owners' final versions ---------------------------------------
def finish_peer(
    cfg: RunConfig,
    opts: PeerOptions,
    peer: IslandPeer,
    curves: Curves,
    memtrace: MemTrace,
) -> float | None:
    """Flush the unshipped work, stop learning, adopt the final versions (``opts.final_sync``)
    and save the last checkpoint. Returns the global model's held-out loss at the end (None:
    stand-in compute, which measures none)."""
    island, node, ranks = peer.island, peer.node, peer.ranks
    if ranks is not None and not ranks.told_to_stop:
        ranks.agree(False)  # the other ranks leave their loop at this same point
    if flushed := flush_at_end(island, cfg):
        log.info("final flush: sent the unshipped work of %d fragment(s)", flushed)
    node.call(node.stop_learning(), timeout=120)
    memtrace.report()
    island.adopt_pending()
    if opts.final_sync:
        final = node.call(node.fetch_final(), timeout=600)
        for p, (version, flat) in final.items():
            island.adopt_final(p, version, flat)
    if ranks is not None:
        ranks.sync()  # every rank ends on the final model
        ranks.close()
        log.info(
            "rank 0 of %d: %d steps, final parameters %s",
            peer.work.world,
            island.stats.step,
            model_param_hash(peer.work.model)[:16],  # FSDP: a collective, one parameter at a time
        )
    eval_end = None
    if peer.work.shards is not None:  # a collective: the island's model after the finals
        eval_end = peer.work.evaluate(peer.work.model, cfg)
    elif peer.work.heldout is not None:
        eval_end = _eval_global(
            peer.work.model, island, peer.work.heldout, cfg, peer.work.gcfg.block_size
        )
    if eval_end is not None:
        curves.global_.append((curves.now(), island.stats.step, eval_end))
    if peer.checkpoints is not None:
        peer.checkpoints.save()  # the final state: a restart resumes here instead of training again
        peer.checkpoints.wait()
    return eval_end


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerResult:
    """What one peer's run did: the "done" event's ``result`` (``as_dict``), read by the report."""

    index: int
    peer_id: str
    steps: int
    n_params: int
    global_versions: list[int]
    final_param_hash: str
    eval_loss_start: float | None  # None with stand-in compute: no loss is measured
    eval_loss_end: float | None
    eval_curve_local: list[tuple[float, int, float]]
    eval_curve_global: list[tuple[float, int, float]]  # peer 0's only
    tokens_trained: int
    bytes_sent: int
    bytes_by_route: dict[str, int]
    stalled_steps: int
    median_step_s: float
    median_step_s_detached: float
    median_compute_s: float  # without waits for merges (sync)
    contributions_sent: int
    contributions_accepted: int
    contributions_refused: int
    remote_errors: int
    merges: dict[int, list[Any]]
    penalties: dict[str, dict[str, int]]  # as an owner: per sender, what the merge's bounds did
    standing: dict[str, float]  # as an owner: per sender, its standing score (issue 47)
    rss_curve: list[tuple[float, int, int, int, int]]
    spread: dict[str, Any]  # versions uploaded as owner / holder, pointers, fallbacks
    versions_in: dict[str, int]
    replica_bytes: int
    attack: str
    peer_attack: dict[str, Any] | None  # what a peer-level attack did, how it was answered
    handoff_refusals: dict[str, int]  # handoffs this peer refused, by reason (issue 48)
    # as an owner: versions not published (lease lapsed, view named another owner), owners that
    # resumed from the version their replica took meanwhile, stores of our record cut short
    owner_fences: dict[str, int]
    # validated publication: the pinned slice, and what checking candidates cost this peer's owners
    validation: dict[str, Any]
    # "real", or the stand-in's spec and what its updates cost this peer's CPU (issue 50)
    compute: dict[str, Any]
    # as an owner: versions published and the seconds from each round's close to its publication
    owner_merge: dict[str, float]
    device_peak_mb: float = 0.0  # on CUDA: torch.cuda.max_memory_allocated (0 on the CPU)
    # the kernel's high-water mark of resident bytes, start and end of the run included, which
    # ``rss_curve`` samples only every RSS_EVERY_S while training (0 where getrusage has none)
    max_rss_bytes: int = 0
    # each rank of the island (one for a one-process island): "rank", "held_bytes" (parameters
    # and optimizer state it holds: a DDP rank a replica, an FSDP rank its shards) and
    # "max_rss_bytes"; and how the ranks hold the model ("none", "ddp", "fsdp")
    ranks: list[dict[str, int]] = field(default_factory=list)
    shard: str = "none"
    # an FSDP island's rank 0: the most fragments it ever held whole at once (1: one at a time)
    most_fragments_gathered: int = 0
    # requests and replies sent, by the routes of bytes_by_route
    messages_by_route: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The fields by name, in order (JSON-ready; the report reads these names)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def peer_result(
    opts: PeerOptions,
    peer: IslandPeer,
    curves: Curves,
    eval_end: float | None,
    peer_attack: dict[str, Any] | None,
    ranks: list[dict[str, int]] | None = None,
) -> PeerResult:
    node, island, stats = peer.node, peer.island, peer.island.stats
    net = node.net
    assert net is not None  # set while the node serves
    return PeerResult(
        index=opts.index,
        peer_id=peer.signer.peer_id.hex(),
        steps=stats.step,
        n_params=sum(p.numel() for p in peer.work.model.parameters()),
        global_versions=list(island.versions),
        final_param_hash=global_param_hash(island.global_state()),
        eval_loss_start=peer.eval_start,
        eval_loss_end=eval_end,
        eval_curve_local=curves.local,
        eval_curve_global=curves.global_ if opts.index == 0 else [],
        tokens_trained=stats.tokens_trained,
        bytes_sent=node.transport.bytes_sent,
        bytes_by_route=dict(node.transport.bytes_by_route),
        stalled_steps=stats.stalled_steps,
        median_step_s=_median(stats.step_times),
        median_step_s_detached=_median(stats.step_times_detached),
        median_compute_s=_median(stats.compute_times),
        contributions_sent=net.stats.contributions_sent,
        contributions_accepted=net.stats.contributions_accepted,
        contributions_refused=net.stats.contributions_refused,
        remote_errors=node.rpc.error_count,
        merges={p: o.merges[-3:] for p, o in node.owners.items()},
        penalties=node.penalties(),
        standing=node.standings(),
        rss_curve=curves.rss,
        max_rss_bytes=max_resident_bytes(),
        spread=node.spread.as_dict(),
        versions_in={
            "received": net.stats.versions_received,
            "as_updates": net.stats.updates_applied,
            "update_mismatches": net.stats.update_mismatches,
            "local": net.stats.versions_local,
            "from_replica": net.stats.versions_replica,
            "finals_held": net.stats.finals_held,
        },
        replica_bytes=node.replica_bytes,
        attack=opts.attack,
        peer_attack=peer_attack,
        handoff_refusals=dict(node.replicas.refusals),
        owner_fences={
            "lease_lapses": node.handoffs.lease_lapses,
            "claimant_fences": node.handoffs.claimant_fences,
            "stale_view_fences": node.handoffs.stale_view_fences,
            "view_reads": node.handoffs.view_reads,
            "resumed": node.handoffs.resumed,
            "record_stores_cut": node.presence.renewal.cut_short if node.presence.renewal else 0,
        },
        validation={
            "data_sha256": peer.validation_hash,
            "on": peer.evaluator is not None,
            "checks": sum(c.checks for c in node.all_owners()),
            "rejected": sum(c.rejected for c in node.all_owners()),
            "seconds": round(sum(c.check_seconds for c in node.all_owners()), 3),
        },
        compute=_compute_of(peer.work),
        owner_merge={
            "versions": sum(o.merges_done for o in node.all_owners()),
            "seconds": round(sum(o.merge_seconds for o in node.all_owners()), 4),
        },
        device_peak_mb=_device_peak_mb(peer.work.device),
        ranks=ranks or [],  # island_memory's: a collective, called by run_peer on every rank
        shard="none" if peer.work.world == 1 else opts.shard,
        most_fragments_gathered=peer.work.shards.most_open if peer.work.shards is not None else 0,
        messages_by_route=dict(node.transport.messages_by_route),
    )


def island_memory(work: Workload) -> list[dict[str, int]]:
    """Every rank's bytes held and peak resident bytes (``rank_memory``: a collective on a
    multi-process island, which each rank calls at the same point of its end)."""
    return rank_memory(held_bytes(work.model, work.optimizer), max_resident_bytes(), work.device)


def _device_peak_mb(device: torch.device) -> float:
    """The most memory torch's allocator held on ``device`` (CUDA), in MiB; 0 elsewhere."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**20


def _compute_of(work: Workload) -> dict[str, Any]:
    """The report's ``compute``: real, or the stand-in's step time, RMS and update cost."""
    standin = work.standin
    if standin is None:
        return {"kind": "real", "loss_measured": True}
    return {
        "kind": "standin",
        "loss_measured": False,
        "step_s": standin.spec.step_s,
        "step_rms": standin.spec.step_rms,
        "update_cpu_s_median": round(_median(standin.update_s), 4),
    }


def _leave(opts: PeerOptions, peer: IslandPeer, serving: NodeThread) -> None:
    """Serve on until the launcher says stop (or ``opts.serve_after_s``), then stop the node."""
    if opts.wait_for_stop:
        while "stop" not in _read_stdin_line():
            pass
    elif opts.serve_after_s:
        # keep serving the fragments we own (others still train) until told to stop
        with contextlib.suppress(KeyboardInterrupt):
            serving.thread.join(timeout=opts.serve_after_s)
    peer.node.stop()
    serving.thread.join(timeout=10)
    if peer.work.world > 1:
        leave_process_group()  # the other ranks wait here for rank 0's end


def run_peer(cfg: RunConfig, opts: PeerOptions) -> PeerResult | FollowerResult:
    """One peer's run in three phases: build (model, data, island, node), run (join the swarm,
    train), finish (flush, final versions, the result, said as the "done" event); then it
    serves until told to stop. A rank other than 0 of a multi-process island follows rank 0."""
    say = opts.events or emit
    memtrace = MemTrace()  # ATOLL_TRACEMALLOC: where the heap grew after warm-up, logged at the end
    torch.set_num_threads(cfg.threads)
    cfg = resolved(cfg)
    work = build_workload(cfg, opts)
    if (
        work.rank > 0
    ):  # this rank trains and follows rank 0's adoptions; rank 0 speaks for the island
        return follow_rank_zero(cfg, work)
    peer = build_peer(cfg, opts, work, say)
    if work.learners is not None:
        work.learners.node = peer.node  # shards are dealt among the members that learn

    joined = join_swarm(cfg, opts, peer, say)
    opts = joined.opts
    # a peer-level attack (node.run.attack_peer: forged handoffs, a claimed address) runs on the node's loop
    attack = (
        PeerAttack(opts.attack.strip(), peer.node, say)
        if opts.attack and is_peer_attack(opts.attack)
        else None
    )
    if attack is not None:
        attack.start()
    loop = TrainingLoop(cfg, opts, peer, say, memtrace)
    loop.run(joined.start_step, joined.rewarm_from)

    eval_end = finish_peer(cfg, opts, peer, loop.curves, memtrace)
    memory = island_memory(work)  # every rank's, at this same point of its end
    result = peer_result(
        opts, peer, loop.curves, eval_end, attack.stop() if attack is not None else None, memory
    )
    say("done", index=opts.index, result=result.as_dict())
    _leave(opts, peer, joined.serving)
    return result


# --- the other ranks of a multi-process island ---------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class FollowerResult:
    """What a rank other than 0 did: its steps, the versions it ended on, its parameters' hash."""

    rank: int
    steps: int
    versions: list[int]
    param_hash: str


def follow_rank_zero(cfg: RunConfig, work: Workload) -> FollowerResult:
    """A rank other than 0 of a multi-process island: the same steps as rank 0 (DDP averages
    the gradients; FSDP reduce-scatters them), the fragments rank 0 adopts after each step
    (``IslandRanks``), no node. On an FSDP island every forward is a collective, so this rank
    also runs rank 0's evaluations, on the same held-out batches at the same points."""
    model, optimizer, sharded = work.model, work.optimizer, work.shards is not None
    if sharded:
        work.evaluate(model, cfg)  # rank 0's loss at the start (build_peer)
    ranks = IslandRanks(model, optimizer, work.plan, None, shards=work.shards)
    ranks.sync()  # the global fragments rank 0 synced when it joined (FSDP: gathered, written)
    start = ranks.start_step(0)  # where rank 0 starts on the schedule (a joiner: the swarm's step)
    model.train()
    steps = 0
    for step in range(start, cfg.steps):
        if not ranks.agree(True):
            break
        assert work.sampler is not None  # stand-in compute runs one process per island
        x, y = (t.to(work.device, non_blocking=True) for t in work.sampler.next())
        ranks.tokens(x.numel())
        # the post-step hook syncs with rank 0
        inner_step(work.stepper, optimizer, work.tcfg, step, x, y, rewarm_from=start)
        steps += 1
        if sharded and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            work.evaluate(model, cfg)  # TrainingLoop._evaluate's, on rank 0
    else:
        ranks.agree(True)  # rank 0's closing agree(False) after its last step
    ranks.sync()  # the final model
    ranks.close()
    param_hash = model_param_hash(model)  # FSDP: with rank 0's (finish_peer), one at a time
    if sharded:
        work.evaluate(model, cfg)  # rank 0's loss at the end (finish_peer)
    island_memory(work)  # with rank 0's, for its report
    leave_process_group()  # when rank 0 is done serving too
    log.info(
        "rank %d of %d: %d steps, final parameters %s",
        ranks.rank,
        ranks.world,
        steps,
        param_hash[:16],
    )
    return FollowerResult(
        rank=ranks.rank, steps=steps, versions=ranks.versions, param_hash=param_hash
    )


RSS_EVERY_S = 5.0


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc``; elsewhere the peak, from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return max_resident_bytes()


def max_resident_bytes() -> int:
    """This process's peak resident bytes so far (``getrusage``; Linux counts KiB), 0 elsewhere."""
    try:
        import resource
    except ImportError:  # not on this platform
        return 0
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
