"""A peer's main: build the island, train it, finalise, report (``python -m node peer``).

Reads like nanoGPT: one loop top to bottom. The asyncio node runs on a background thread
(``PeerNode.serve``); this thread only trains and talks to it through the island's hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.config import RunConfig
from node.dht.swarm import SwarmCredentials
from node.diloco.inner import interval_by_lr, joining_step, lr_at, make_inner_optimizer
from node.diloco.island import Island, IslandConfig
from node.diloco.ranks import IslandRanks, distributed_rank, leave_process_group
from node.diloco.validation import window_evaluator
from node.peer import PeerNode, emit
from node.run.allocator import heap_in_use
from node.run.attack import Attack
from node.run.attack_peer import PeerAttack, is_peer_attack
from node.run.memtrace import MemTrace
from node.run.report import WARMUP
from node.run.resume import IslandCheckpoints
from node.workload.baseline import TrainConfig, sampler_seed, train_config_for
from node.workload.corpus import BatchSampler, evaluate, load_corpus, split_corpus, validation_slice
from node.workload.model import GPT, GPTConfig, embedding_parameter_names
from node.workload.presets import resolved
from protocol.diloco.fragments import FragmentPlan, plan_fragments
from protocol.wire.signing import Signer

__all__ = [
    "data_seed_of",
    "global_param_hash",
    "inner_step",
    "island_sampler",
    "resolved",
    "run_peer",
]

log = logging.getLogger("atoll.train")

# the end-of-run flush waits this long for the versions of fragments in flight before it ships
FLUSH_WAIT_S = 30.0


def global_param_hash(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the global model's fp32 bytes, tensors in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


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
        batch_size=cfg.batch_size,
        block_size=block_size,
        seed=seed + RANK_SEED_STRIDE * rank,
        shard=shard,
        n_shards=n_shards,
        sharding=sharding,
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


def _follow_rank_zero(
    cfg: RunConfig,
    model: torch.nn.Module,
    stepper: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: FragmentPlan,
    sampler: BatchSampler,
    tcfg: TrainConfig,
    device: torch.device,
) -> dict[str, Any]:
    """A rank other than 0 of a multi-process island: the same steps as rank 0 (DDP averages
    the gradients), the fragments rank 0 adopts after each step (``IslandRanks``), no node."""
    ranks = IslandRanks(model, optimizer, plan, None)
    ranks.sync()  # the global fragments rank 0 synced when it joined
    start = ranks.start_step(0)  # where rank 0 starts on the schedule (a joiner: the swarm's step)
    model.train()
    steps = 0
    for step in range(start, cfg.steps):
        if not ranks.agree(True):
            break
        x, y = (t.to(device, non_blocking=True) for t in sampler.next())
        ranks.tokens(x.numel())
        inner_step(
            stepper, optimizer, tcfg, step, x, y, rewarm_from=start
        )  # the post-step hook syncs with rank 0
        steps += 1
    else:
        ranks.agree(True)  # rank 0's closing agree(False) after its last step
    ranks.sync()  # the final model
    ranks.close()
    leave_process_group()  # when rank 0 is done serving too
    param_hash = global_param_hash(dict(model.named_parameters()))
    log.info(
        "rank %d of %d: %d steps, final parameters %s",
        ranks.rank,
        ranks.world,
        steps,
        param_hash[:16],
    )
    return {
        "rank": ranks.rank,
        "steps": steps,
        "versions": ranks.versions,
        "param_hash": param_hash,
    }


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
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _eval_global(model: GPT, island: Island, heldout: torch.Tensor, cfg: RunConfig) -> float:
    scratch = GPT(model.config)
    scratch.load_state_dict(island.global_state(), strict=True)
    return evaluate(
        scratch,
        heldout,
        batch_size=cfg.batch_size,
        block_size=model.config.block_size,
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


def run_peer(cfg: RunConfig, opts: PeerOptions) -> dict[str, Any]:
    index = opts.index
    say = opts.events or emit
    memtrace = MemTrace()  # ATOLL_TRACEMALLOC: where the heap grew after warm-up, logged at the end
    torch.set_num_threads(cfg.threads)
    # --- model, data, optimizer -----------------------------------------------------------------
    cfg = resolved(cfg)
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
    model = GPT(gcfg, seed=cfg.seed).to(
        device
    )  # identical on every peer: version 0 of every fragment
    data = load_corpus(Path(cfg.corpus) if cfg.corpus else None, max_bytes=cfg.corpus_max_bytes)
    train, heldout = split_corpus(data)
    sampler = island_sampler(
        cfg, train, gcfg.block_size, index, rank=rank, own_seed=opts.own_data_seed
    )
    tcfg = train_config_for(cfg)
    optimizer = make_inner_optimizer(model, tcfg)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = plan_fragments(shapes, cfg.fragments, embeddings=embedding_parameter_names(model))
    stepper: torch.nn.Module = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        stepper = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if rank > 0:  # this rank trains and follows rank 0's adoptions; rank 0 speaks for the island
        return _follow_rank_zero(cfg, model, stepper, optimizer, plan, sampler, tcfg, device)
    signer = opts.signer or Signer.from_seed(os.urandom(32))
    # the global model at the start: version 0 of every fragment is this deterministic init
    eval_start = evaluate(
        model,
        heldout,
        batch_size=cfg.batch_size,
        block_size=gcfg.block_size,
        n_batches=cfg.eval_batches,
    )

    # --- the island, resumed from its checkpoint if it has one ---------------------------------
    holder: list[PeerNode] = []
    island = Island(
        model,
        optimizer,
        plan,
        submit=lambda out: holder[0].net.submit(out) if holder[0].net else None,
        cfg=IslandConfig(
            inner_steps=cfg.inner_steps,
            interval=interval_by_lr(optimizer, cfg.inner_steps, cfg.sync_growth),
            adopt_alpha=cfg.adopt_alpha,
            wait_for_merge=cfg.mode != "decoupled",
            hold_until_shipped=bool(cfg.hold_versions),
            ship_before_adopt=cfg.ship_before_adopt,
            rebase=bool(cfg.adopt_rebase),
        ),
    )
    ranks = IslandRanks(model, optimizer, plan, island) if world > 1 else None
    initial_global = [g.clone() for g in island.global_flat]  # version 0 of every fragment
    checkpoints = (
        IslandCheckpoints(opts.checkpoint_dir, model, optimizer, island, sampler.generator)
        if opts.checkpoint_dir
        else None
    )
    resumed = checkpoints.restore() if checkpoints is not None else None
    start_step = int(resumed["step"]) if resumed else 0
    if resumed:
        say("resumed", index=index, step=start_step, versions=list(island.versions))

    # --- validated publication: owners check candidates on the pinned held-out slice ------------
    validation, validation_hash = validation_slice(
        heldout
    )  # (m,) uint8; the same bytes on every peer
    evaluator = window_evaluator(
        model,
        plan,
        None,
        validation,
        block_size=gcfg.block_size,
        windows=cfg.validate_windows,
        pinned=opts.credentials.manifest.validation_sha256 if opts.credentials else "",
    )  # None: the other fragments as the island trains them; a slice not the pinned one raises

    # --- the node, on its own thread: join the swarm, sync the global fragments ---------------
    node = PeerNode(
        cfg,
        signer,
        model,
        plan,
        host=opts.host,
        port=opts.port,
        public_address=opts.public_address,
        credentials=opts.credentials,
        tamper=(
            Attack.parse(opts.attack, seed=cfg.seed)  # the run's seed: attackers collude
            if opts.attack and not is_peer_attack(opts.attack)
            else None
        ),
        initial_global=initial_global if resumed else None,
        versions_known_at=float(resumed["saved_at"]) if resumed and "saved_at" in resumed else None,
        event_log_dir=opts.event_log_dir,
        owner_checkpoint_dir=opts.checkpoint_dir / "owner" if opts.checkpoint_dir else None,
        evaluator=evaluator,
    )
    holder.append(node)
    node.announce_versions = (
        opts.initial_peers_from_stdin
    )  # under a launcher: it checks every version's content
    initial = list(opts.initial_peers)
    if opts.initial_peers_from_stdin:
        initial += list(_read_stdin_line().get("initial_peers", []))
    crashed: list[BaseException] = []  # why the node's thread ended early (the main thread says it)

    def serve() -> None:
        try:
            asyncio.run(node.serve(island, initial))
        except BaseException as exc:
            crashed.append(exc)
            log.log(
                logging.ERROR if node.joined.is_set() and node.failure is None else logging.DEBUG,
                "the node stopped: %r",
                exc,
                exc_info=True,
            )

    thread = threading.Thread(target=serve, name="atoll-node", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not node.ready.wait(0.1):
        if crashed or time.monotonic() > deadline:
            raise RuntimeError(
                f"the node could not start listening: {crashed[0] if crashed else 'not within 60 s'}"
            )
    say("listening", index=index, url=node.url, peer_id=signer.peer_id.hex())
    if not node.joined.wait(120) or node.failure is not None:
        raise RuntimeError(f"could not join the swarm: {str(node.failure) or repr(node.failure)}")
    node.wait_for_members(opts.wait_members)
    if opts.initial_peers_from_stdin:
        say("ready", index=index)
        if not _read_stdin_line().get("start"):
            raise RuntimeError("the launcher stopped the swarm before it started")
    island.adopt_pending()  # the synced global fragments
    rewarm_from = 0
    if opts.schedule == "swarm" and not resumed:
        claims = node.learner_steps()
        start_step = rewarm_from = joining_step(claims, cfg.steps)
        if start_step:
            say("schedule", index=index, step=start_step, steps=cfg.steps, learners=len(claims))
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
    if ranks is not None:
        ranks.sync()
        start_step = ranks.start_step(start_step)  # the followers' steps and lr are rank 0's
    say("joined", index=index, versions=list(island.versions), synced=sorted(node.synced))
    # a peer-level attack (node.run.attack_peer: forged handoffs, a claimed address) runs on the node's loop
    peer_attack = (
        PeerAttack(opts.attack.strip(), node, say)
        if opts.attack and is_peer_attack(opts.attack)
        else None
    )
    if peer_attack is not None:
        peer_attack.start()
    t0 = opts.t0 or time.time()
    # the trace's baseline is taken where the report's warm-up ends
    warm_at = t0 + WARMUP * (opts.until - t0) if opts.until else None

    curve_local: list[tuple[float, int, float]] = []
    # every ~5 s: (seconds, step, resident bytes, C heap in use or -1, Python's allocated blocks)
    rss_curve: list[tuple[float, int, int, int, int]] = []
    curve_global: list[tuple[float, int, float]] = [(time.time() - t0, 0, eval_start)]
    # --- the training loop ----------------------------------------------------------------------
    model.train()
    last_progress, loss_ema = 0.0, float("nan")
    for step in range(start_step, cfg.steps):
        go_on = not (opts.until and time.time() >= opts.until)
        if ranks is not None:
            go_on = ranks.agree(go_on)  # every rank stops at the same step
        if not go_on:
            break
        t_step = time.perf_counter()
        if cfg.overlap_block:
            island.enabled = (step // cfg.overlap_block) % 2 == 1
        x, y = (t.to(device, non_blocking=True) for t in sampler.next())  # [B, T] int64 each
        if ranks is not None:
            ranks.tokens(x.numel())  # every rank's tokens count
        else:
            island.tokens(x.numel())  # counted into the contributions this step may ship
        loss = inner_step(
            stepper, optimizer, tcfg, step, x, y, rewarm_from=rewarm_from
        )  # the hook: adopt, ship
        loss_ema = loss.item() if step == start_step else 0.95 * loss_ema + 0.05 * loss.item()
        if opts.slow_factor > 1.0:  # an emulated slower machine
            time.sleep((opts.slow_factor - 1.0) * (time.perf_counter() - t_step))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            curve_local.append(
                (
                    time.time() - t0,
                    step + 1,
                    evaluate(
                        model,
                        heldout,
                        batch_size=cfg.batch_size,
                        block_size=gcfg.block_size,
                        n_batches=cfg.eval_batches,
                    ),
                )
            )
            if index == 0:
                curve_global.append(
                    (time.time() - t0, step + 1, _eval_global(model, island, heldout, cfg))
                )
        if checkpoints is not None and (step + 1) % cfg.inner_steps == 0:
            checkpoints.save()
        if time.monotonic() - last_progress > 1.0:
            if not rss_curve or time.time() - t0 - rss_curve[-1][0] >= RSS_EVERY_S:
                heap = heap_in_use()
                if (
                    time.time() >= warm_at
                    if warm_at is not None
                    else step + 1 >= WARMUP * cfg.steps
                ):
                    memtrace.mark_warm()
                rss_curve.append(
                    (
                        time.time() - t0,
                        step + 1,
                        resident_bytes(),
                        -1 if heap is None else heap,
                        sys.getallocatedblocks(),
                    )
                )
            last_progress = time.monotonic()
            node.step = step + 1
            node.board.record(step + 1, loss_ema)  # the status page's loss curve
            say(
                "progress",
                index=index,
                step=step + 1,
                loss=loss_ema,
                versions=list(island.versions),
                bytes_sent=node.transport.bytes_sent,
                bytes_received=node.transport.bytes_received,
                peers=len(node.membership.members) if node.membership else 0,
            )

    # --- finalise: all peers end on the owners' final versions ---------------------------------
    if ranks is not None and not ranks.told_to_stop:
        ranks.agree(False)  # the other ranks leave their loop at this same point
    if cfg.flushes and island.enabled:
        flushed = island.flush(timeout_s=FLUSH_WAIT_S)
        log.info("final flush: sent the unshipped work of %d fragment(s)", flushed)
    node.call(node.stop_learning(), timeout=120)
    memtrace.report()
    if opts.final_sync:
        island.adopt_pending()
        final = node.call(node.fetch_final(), timeout=600)
        for p, (version, flat) in final.items():
            island.adopt_final(p, version, flat)
    else:
        island.adopt_pending()
    if ranks is not None:
        ranks.sync()  # every rank ends on the final model
        ranks.close()
        log.info(
            "rank 0 of %d: %d steps, final parameters %s",
            world,
            island.stats.step,
            global_param_hash(dict(model.named_parameters()))[:16],
        )
    eval_end = _eval_global(model, island, heldout, cfg)
    curve_global.append((time.time() - t0, island.stats.step, eval_end))
    if checkpoints is not None:
        checkpoints.save()  # the final state: a restart resumes here instead of training again
        checkpoints.wait()
    net = node.net
    assert net is not None
    result = {
        "index": index,
        "peer_id": signer.peer_id.hex(),
        "steps": island.stats.step,
        "n_params": sum(p.numel() for p in model.parameters()),
        "global_versions": list(island.versions),
        "final_param_hash": global_param_hash(island.global_state()),
        "eval_loss_start": eval_start,
        "eval_loss_end": eval_end,
        "eval_curve_local": curve_local,
        "eval_curve_global": curve_global if index == 0 else [],
        "tokens_trained": island.stats.tokens_trained,
        "bytes_sent": node.transport.bytes_sent,
        "bytes_by_route": dict(node.transport.bytes_by_route),
        "stalled_steps": island.stats.stalled_steps,
        "median_step_s": _median(island.stats.step_times),
        "median_step_s_detached": _median(island.stats.step_times_detached),
        "median_compute_s": _median(island.stats.compute_times),  # without waits for merges (sync)
        "contributions_sent": net.stats.contributions_sent,
        "contributions_accepted": net.stats.contributions_accepted,
        "contributions_refused": net.stats.contributions_refused,
        "remote_errors": node.rpc.error_count,
        "merges": {p: o.merges[-3:] for p, o in node.owners.items()},
        "penalties": node.penalties(),  # as an owner: per sender, what the merge's bounds did
        "standing": node.standings(),  # as an owner: per sender, its standing score (issue 47)
        "rss_curve": rss_curve,
        "spread": node.spread.as_dict(),  # versions uploaded as owner / holder, pointers, fallbacks
        "versions_in": {
            "received": net.stats.versions_received,
            "as_updates": net.stats.updates_applied,
            "update_mismatches": net.stats.update_mismatches,
            "local": net.stats.versions_local,
            "from_replica": net.stats.versions_replica,
            "finals_held": net.stats.finals_held,
        },
        "replica_bytes": node.replica_bytes,
        "attack": opts.attack,
        "peer_attack": peer_attack.stop()
        if peer_attack is not None
        else None,  # what it did, how answered
        "handoff_refusals": dict(
            node.replicas.refusals
        ),  # handoffs this peer refused, by reason (issue 48)
        # validated publication: the pinned slice, and what checking candidates cost this peer's owners
        "validation": {
            "data_sha256": validation_hash,
            "on": evaluator is not None,
            "checks": sum(c.checks for c in node.all_owners()),
            "rejected": sum(c.rejected for c in node.all_owners()),
            "seconds": round(sum(c.check_seconds for c in node.all_owners()), 3),
        },
    }
    say("done", index=index, result=result)
    if opts.wait_for_stop:
        while "stop" not in _read_stdin_line():
            pass
    elif opts.serve_after_s:
        # keep serving the fragments we own (others still train) until told to stop
        with contextlib.suppress(KeyboardInterrupt):
            thread.join(timeout=opts.serve_after_s)
    node.stop()
    thread.join(timeout=10)
    if world > 1:
        leave_process_group()  # the other ranks wait here for rank 0's end
    return result


RSS_EVERY_S = 5.0


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc``; elsewhere the peak, from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
