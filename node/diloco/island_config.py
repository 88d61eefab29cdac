"""The island's settings from a run's config: one builder for ``atoll join`` and ``SwarmIsland``.

Both entry points build their ``Island`` from a ``RunConfig`` (the CLI's flags or a swarm's
manifest); building it in one place keeps their islands alike, e.g. in synchronous modes both
wait for each merged version, and both send the end-of-run flush when ``cfg.flushes`` says so.
"""

from __future__ import annotations

import torch

from node.config import RunConfig
from node.diloco.inner import interval_by_lr
from node.diloco.island import Island, IslandConfig

__all__ = ["FLUSH_WAIT_S", "SHIP_WINDOW", "flush_at_end", "island_config"]

# the end-of-run flush waits this long for the versions of fragments in flight before it ships
FLUSH_WAIT_S = 30.0
# contributions open at once when several fragments ship together (node.diloco.ship_window): one
# uploading while the next compresses. Both entry points send through ``ContributionSender``,
# which reports each contribution's handoff
SHIP_WINDOW = 2


def island_config(cfg: RunConfig, optimizer: torch.optim.Optimizer) -> IslandConfig:
    """The ``IslandConfig`` that ``cfg`` asks for; H follows ``optimizer``'s learning rate under
    ``cfg.sync_growth``. Synchronous modes (``sync``, ``ddp``) wait for each merged version."""
    return IslandConfig(
        inner_steps=cfg.inner_steps,
        interval=interval_by_lr(optimizer, cfg.inner_steps, cfg.sync_growth),
        adopt_alpha=cfg.adopt_alpha,
        wait_for_merge=cfg.mode != "decoupled",
        hold_until_shipped=bool(cfg.hold_versions),
        ship_before_adopt=cfg.ship_before_adopt,
        rebase=bool(cfg.adopt_rebase),
        ship_window=SHIP_WINDOW,
    )


def flush_at_end(island: Island, cfg: RunConfig, timeout_s: float = FLUSH_WAIT_S) -> int:
    """After the last inner step: send the work no contribution holds yet, if ``cfg.flushes``
    and the island is in the swarm (``Island.flush``); returns how many fragments shipped."""
    if not (cfg.flushes and island.enabled):
        return 0
    return island.flush(timeout_s=timeout_s)
