"""What the GPT workload and the mode fill into a swarm's config (node.workload.presets.resolved)."""

from __future__ import annotations

from node.config import RunConfig
from node.workload.presets import resolved


def test_ddp_syncs_every_step_and_its_h_does_not_grow() -> None:
    cfg = resolved(RunConfig(mode="ddp", peers=4, inner_steps=200, sync_growth="qsr"))
    assert (cfg.inner_steps, cfg.sync_growth, cfg.quorum, cfg.grace_gamma) == (
        1,
        "constant",
        4,
        0.0,
    )


def test_sync_keeps_h_and_its_growth_and_waits_for_every_learner() -> None:
    cfg = resolved(RunConfig(mode="sync", peers=3, inner_steps=200, sync_growth="qsr"))
    assert (cfg.inner_steps, cfg.sync_growth, cfg.quorum, cfg.grace_gamma) == (200, "qsr", 3, 0.0)
    assert cfg.max_tokens_per_step == cfg.batch_size * 64  # the tiny preset's context
