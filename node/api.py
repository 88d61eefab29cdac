"""The training API a user sees: any ``nn.Module``, any inner optimizer, a few changed lines.

::

    with SwarmIsland(model, optimizer, tokens_per_step=batch * seq,
                     swarm=Swarm(manifest=manifest, key=key, cert=cert),
                     network=Network(initial_peers=["http://host:7000"])) as island:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            island.tokens(x.numel())     # before the step: counted into what this step ships
            optimizer.step()             # the hook adopts arrived fragments and ships due ones
            optimizer.zero_grad()

Entering joins the swarm (or founds it when there are no initial peers): the node starts on its
own thread, finds members through the DHT, downloads every global fragment at its latest version
and loads it into ``model``. Leaving stops learning, waits until no member of the swarm is
learning any more, loads every fragment's final version (the same on every peer) into ``model``,
keeps serving a few seconds so that the others can fetch the fragments this peer owns, then
stops the node. ``Timing(finish_timeout_s=0)`` leaves at once instead, keeping the local weights.
Peers of one swarm must build the same architecture with the same initial weights (same seed):
version 0 of every fragment is that initial state, and the swarm's manifest hash includes the
fragment plan, so a peer with a different architecture is refused.

A multi-process island (``torchrun --nproc_per_node N``, DDP inside): build ``SwarmIsland`` on
every rank after ``torch.distributed.init_process_group``, and call ``tokens`` on every rank.
Rank 0 joins the swarm and speaks for the island; the others adopt every fragment rank 0 adopts,
at the same step (``node.diloco.ranks``); tokens count all ranks. Leaving the ``with`` block
waits for every rank, so that all of them can ``destroy_process_group`` together; then end each
rank with ``exit_without_teardown(0)`` (the group's C++ objects, still held by DDP or FSDP, must
not be freed in the interpreter's teardown: gloo can abort there, docs/islands.md).

An island that shards: apply FSDP2's ``fully_shard`` to the model on every rank before building
``SwarmIsland`` (and the optimizer over the sharded parameters); the island sees the ``DTensor``
shards and gathers one fragment at a time to rank 0 when it ships or adopts it, writing adoptions
back into every rank's shard at the same step (``node.diloco.sharding``, docs/islands.md).
``Swarm(validate=...)`` is refused there (rank 0 alone cannot run the sharded model's forward
pass).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import torch
from torch import nn

from node.config import RunConfig
from node.dht.membership import config_from_manifest, recipe_of
from node.dht.swarm import SwarmCredentials
from node.diloco.allocator import tune_allocator
from node.diloco.island import Island
from node.diloco.island_config import FLUSH_WAIT_S, flush_at_end, island_config
from node.diloco.ranks import IslandRanks, distributed_rank, exit_without_teardown, unwrap
from node.diloco.sharding import ShardedFragments, is_sharded
from node.diloco.validation import CallableEvaluator
from node.peer import NodeOptions, PeerNode
from protocol.diloco.fragments import FragmentPlan, plan_fragments
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer

__all__ = ["Network", "Swarm", "SwarmIsland", "Timing", "exit_without_teardown"]

log = logging.getLogger("atoll.api")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Swarm:
    """The swarm an island trains in: what all its peers agree on, and who this peer is there.

    ``manifest``, ``key``, ``cert``: the swarm's signed manifest, this peer's key and its
    certificate (``node.wire.identity`` loads them from files). The manifest's recipe then decides
    fragments, H, codecs and merge rules, and its ``model`` must name this model's fragment plan
    (``SwarmIsland.model_name``). Without a manifest, ``name`` names a development swarm in which
    any reachable member may own fragments. Without ``key``, a fresh key is made.
    ``config``: fragments, H, codec, outer step, grace window... (its model fields unused; with a
    manifest, only the island's own hold_versions, ship_before_adopt, final_flush).
    ``embeddings``: the embedding tables' parameter names, placed in fragments of their own (part
    of the plan: every peer passes the same).
    ``validate(model) -> loss``: the swarm's validation loss of ``model`` (on data every peer
    holds, e.g. a held-out set the manifest names by hash; it may draw its own batches). With it,
    each version this peer owns is checked before it is published: one that raises the loss
    beyond the noise of repeated calls is not, and the contributions that hurt alone are dropped
    (``node.diloco.validation``; four calls per version, more when it hurts). Without it,
    validated publication is off, and the node says so at start.

    Raises ``ValueError`` for no manifest and no name, both, or a certificate without a manifest.
    """

    manifest: SwarmManifest | None = None
    name: str = ""
    key: Signer | None = None
    cert: Certificate | None = None
    config: RunConfig | None = None
    embeddings: Sequence[str] = ()
    validate: Callable[[nn.Module], float] | None = None

    def __post_init__(self) -> None:
        if self.manifest is None and not self.name:
            raise ValueError(
                "name the swarm: Swarm(manifest=<its signed manifest>, key=..., cert=...) or, for "
                "a development swarm, Swarm(name=NAME)"
            )
        if self.manifest is not None and self.name:
            raise ValueError(
                f"the manifest names the swarm ({self.manifest.name!r}): leave name= out (it "
                "names a development swarm, one without a manifest)"
            )
        if self.cert is not None and self.manifest is None:
            raise ValueError(
                "a certificate is checked against the swarm's manifest: pass manifest= with "
                "cert=, or leave cert= out in a development swarm"
            )
        if isinstance(self.embeddings, str):
            raise ValueError(
                f"embeddings= takes parameter names, e.g. ({self.embeddings!r},), not one string"
            )
        object.__setattr__(self, "embeddings", tuple(self.embeddings))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Network:
    """Whom an island dials and where it listens.

    ``initial_peers``: addresses of any members or bootstrap nodes (``http://host:port``,
    ``https://...`` in a certified swarm); none: this island founds the swarm. ``host``, ``port``:
    where the node listens (port 0: any free port; ``127.0.0.1`` reaches only this machine, use
    ``0.0.0.0`` and ``public_address`` for others). ``public_address``: the URL others dial, with
    its scheme (default: the address bound). Raises ``ValueError`` for one address given as a
    string, or a port out of range."""

    initial_peers: Sequence[str] = ()
    host: str = "127.0.0.1"
    port: int = 0
    public_address: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.initial_peers, str):
            raise ValueError(
                f"initial_peers= takes a list of addresses, e.g. [{self.initial_peers!r}], "
                "not one string"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0 (any free port) to 65535, got {self.port}")
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """How long an island waits on the swarm. ``join_timeout_s``: how long entering may take;
    ``finish_timeout_s``: how long leaving may wait for the swarm's final versions (0: leave at
    once, keeping the local weights); ``linger_s``: after leaving, how long a peer that owns
    fragments keeps serving them to the others. Raises ``ValueError`` for a negative or
    non-finite one, or a join timeout of 0."""

    join_timeout_s: float = 120.0
    finish_timeout_s: float = 300.0
    linger_s: float = 5.0

    def __post_init__(self) -> None:
        waits = {
            "join_timeout_s": self.join_timeout_s,
            "finish_timeout_s": self.finish_timeout_s,
            "linger_s": self.linger_s,
        }
        bad = [f"{k}={v}" for k, v in waits.items() if not (math.isfinite(v) and v >= 0)]
        if bad or self.join_timeout_s == 0:
            raise ValueError(
                f"Timing needs finite seconds >= 0 (join_timeout_s > 0), got "
                f"{', '.join(bad) or 'join_timeout_s=0'}"
            )


class SwarmIsland:
    """An island of a swarm around a user's model and inner optimizer (a context manager)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        tokens_per_step: int,
        swarm: Swarm,
        network: Network = Network(),
        timing: Timing = Timing(),
    ) -> None:
        """``tokens_per_step``: the most tokens one inner step trains (the merge clamps to it).
        ``swarm``: which swarm, its settings and this peer's identity in it (``Swarm``);
        ``network``: whom it dials and where it listens (``Network``); ``timing``: how long it
        waits to join, to finish, and serves after (``Timing``).

        Also raises glibc's mmap and trim thresholds for this process, so the large tensors of
        each round reuse warm pages (``node.diloco.allocator``; ``ATOLL_MALLOC=default`` opts out).
        Raises ``ValueError`` for a manifest of another model, or ``swarm.validate`` on an island
        that shards (FSDP2).
        """
        tune_allocator()
        model = unwrap(model)  # DDP's "module." prefix must not change the fragment plan
        manifest = swarm.manifest
        base = swarm.config or RunConfig(fragments=2, inner_steps=20)
        recipe = manifest.recipe_dict if manifest is not None else {}
        fragments = int(recipe.get("fragments", base.fragments))  # the plan is the swarm's
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        self.plan: FragmentPlan = plan_fragments(shapes, fragments, embeddings=swarm.embeddings)
        # the architecture is part of the swarm's manifest: peers must agree on the plan
        self.model_name = f"custom-{self.plan.plan_hash().hex()[:16]}"
        self.cfg = _swarm_config(
            dataclasses.replace(
                base, swarm=swarm.name, model=self.model_name, max_tokens_per_step=tokens_per_step
            ),
            manifest,
        )
        signer = swarm.key or Signer.from_seed(os.urandom(32))
        credentials = (
            SwarmCredentials(manifest, signer, swarm.cert) if manifest is not None else None
        )
        self.rank, self.world = distributed_rank()
        self._model = model
        # an FSDP2 island: rank 0 gathers one fragment at a time (node.diloco.sharding)
        self.shards = ShardedFragments(model, self.plan, optimizer) if is_sharded(model) else None
        if self.shards is not None and swarm.validate is not None:
            raise ValueError(
                "Swarm(validate=...) needs the whole model on rank 0, and this island shards it "
                "(fully_shard): leave validate out, or validate on a one-process island"
            )
        self._island: Island | None = None
        self._node: PeerNode | None = None
        if (
            self.rank == 0
        ):  # rank 0 speaks for the island on the swarm (the only rank without torchrun)
            self._island = Island(
                model,
                optimizer,
                self.plan,
                self._submit,
                island_config(self.cfg, optimizer),
                shards=self.shards,
            )
            evaluator = (
                CallableEvaluator(model, self.plan, None, swarm.validate)
                if swarm.validate is not None
                else None
            )
            self._node = PeerNode(
                self.cfg,
                signer,
                model,
                self.plan,
                NodeOptions(
                    host=network.host,
                    port=network.port,
                    public_address=network.public_address,
                    evaluator=evaluator,
                ),
                credentials=credentials,
            )
        # the other ranks of a torchrun island follow rank 0's adoptions (node.diloco.ranks)
        if self.shards is not None:
            self.shards.settle()  # the other ranks served rank 0's island its version 0
        self.ranks = (
            IslandRanks(model, optimizer, self.plan, self._island, shards=self.shards)
            if self.world > 1
            else None
        )
        self.network, self.timing = network, timing
        self._thread: threading.Thread | None = None

    @staticmethod
    def found(
        model: nn.Module,
        founder: Signer,
        *,
        name: str,
        tokens_per_step: int,
        config: RunConfig | None = None,
        embeddings: Sequence[str] = (),
        admission: str = "open",
        authorities: Sequence[tuple[str, bytes]] = (),
    ) -> SwarmManifest:
        """A signed manifest for a new swarm around ``model``: the recipe from ``config`` (fragments,
        H, codecs, outer step, merge rules), this model's fragment plan, and ``authorities`` as
        ``(lab, public key)`` pairs. ``atoll swarm add-authority`` / ``revoke`` edit it later."""
        base = config or RunConfig(fragments=2, inner_steps=20)
        shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        plan = plan_fragments(shapes, base.fragments, embeddings=embeddings)
        cfg = dataclasses.replace(
            base, model=f"custom-{plan.plan_hash().hex()[:16]}", max_tokens_per_step=tokens_per_step
        )
        manifest = SwarmManifest(
            name=name,
            founder=founder.public_key,
            admission=admission,
            created=time.time(),
            recipe=recipe_of(cfg, schedule=False),
        )  # the learners' optimizers are their own
        for lab, public_key in authorities:
            manifest = manifest.with_authority(lab, public_key)
        return manifest.signed(founder)

    @property
    def island(self) -> Island:
        """The swarm-facing island (rank 0 of a multi-process island only)."""
        if self._island is None:
            raise RuntimeError(
                f"rank {self.rank} of a multi-process island has no swarm-facing island; rank 0 has"
            )
        return self._island

    @property
    def node(self) -> PeerNode:
        """This island's node (rank 0 of a multi-process island only)."""
        if self._node is None:
            raise RuntimeError(
                f"rank {self.rank} of a multi-process island runs no node; rank 0 does"
            )
        return self._node

    def _submit(self, out: object) -> None:
        if self._node is not None and self._node.net is not None:
            self._node.net.submit(out)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        """This island's address (give it to others as an initial peer)."""
        return self.node.url

    def tokens(self, n: int) -> None:
        """Count the tokens of the step about to be taken (call before ``optimizer.step()``; on
        every rank of a multi-process island, which then counts all ranks' tokens)."""
        if self.ranks is not None:
            self.ranks.tokens(n)
        else:
            self.island.tokens(n)

    @property
    def versions(self) -> list[int]:
        """The global version of every fragment this island holds."""
        return self.ranks.versions if self.ranks is not None else list(self.island.versions)

    def _sync_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.sync()

    def __enter__(self) -> SwarmIsland:
        if self._node is not None:
            node, island = self._node, self.island
            self._thread = threading.Thread(
                target=lambda: asyncio.run(node.serve(island, list(self.network.initial_peers))),
                name="atoll-node",
                daemon=True,
            )
            self._thread.start()
            if not node.joined.wait(self.timing.join_timeout_s) or node.failure is not None:
                self.close()
                raise ConnectionError(
                    f"could not join swarm {self.cfg.swarm!r} through "
                    f"{list(self.network.initial_peers) or 'no initial peers'}: {node.failure!r}"
                )
            island.adopt_pending()  # the synced global fragments
        self._sync_ranks()
        return self

    def wait_for_members(self, n: int, timeout_s: float = 120.0) -> None:
        """Block until ``n`` members (this one included) are visible and the owners have settled.

        A swarm's final model is the one its owners hold once no member is learning: a peer that
        trains to the end before the others join finishes on a model they then move past. Call
        this before training when a known number of peers start together. Raises ``TimeoutError``.
        """
        if self._node is not None:
            self._node.wait_for_members(n, timeout_s=timeout_s)
            self.island.adopt_pending()  # versions merged while we waited
        self._sync_ranks()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None and self.timing.finish_timeout_s > 0:
            self.finish()
        self.close()
        if exc_type is None and self.ranks is not None:
            self.ranks.wait_for_all()  # every rank leaves together (then destroy_process_group)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global model this island holds, as a name -> tensor dict (rank 0)."""
        return self.island.global_state()

    def finish(self) -> None:
        """Stop learning and adopt every fragment's final version (see the module docstring).

        Raises ``TimeoutError`` if the finals do not come within ``finish_timeout_s``."""
        if self._node is not None:
            node = self._node
            # the work since each fragment's last contribution, as atoll join sends it
            flush_at_end(
                self.island, self.cfg, timeout_s=min(FLUSH_WAIT_S, self.timing.finish_timeout_s)
            )
            node.call(node.stop_learning(), timeout=self.timing.finish_timeout_s)
            self.island.adopt_pending()
            final = node.call(node.fetch_final(), timeout=self.timing.finish_timeout_s)
            for p, (version, flat) in sorted(final.items()):
                self.island.adopt_final(p, version, flat)
        self._sync_ranks()  # every rank ends on the final model
        if self._node is not None and self._node.owners and self._thread is not None:
            self._thread.join(timeout=self.timing.linger_s)  # others may still fetch what we own

    def close(self) -> None:
        """Stop learning, stop the node, remove the optimizer hooks."""
        if self._node is not None:
            self._node.learning = False
            self._node.stop()
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self.ranks is not None:
            self.ranks.close()
        if self._island is not None:
            self._island.close()


def _swarm_config(cfg: RunConfig, manifest: SwarmManifest | None) -> RunConfig:
    """``cfg`` under the manifest's recipe; without a manifest, a development swarm named
    ``cfg.swarm`` (warned: any reachable member may own fragments). Raises ``ValueError`` for a
    recipe of another model."""
    if manifest is not None:
        swarm_cfg = config_from_manifest(manifest, cfg)
        if swarm_cfg.model != cfg.model:
            raise ValueError(
                f"the swarm's recipe is for model {swarm_cfg.model!r}; this model's fragment plan "
                f"is {cfg.model!r} (found the swarm with SwarmIsland.found(model, ...), "
                "whose manifest names it: the command line's swarm init knows only the GPT presets)"
            )
        return swarm_cfg
    log.warning(
        "swarm %r has no signed manifest: any reachable member may own fragments (a development "
        "swarm; pass Swarm(manifest=..., key=..., cert=...) for a swarm others can join)",
        cfg.swarm,
    )
    return cfg
