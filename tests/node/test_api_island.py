"""``SwarmIsland`` (node.api) and ``atoll join`` build their islands alike from a swarm's manifest.

Both build the island's settings with ``node.diloco.island_config``: a manifest in synchronous
mode makes both wait for each merged version, and both send the end-of-run flush.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from node.api import Network, Swarm, SwarmIsland, Timing
from node.cli import _parser
from node.config import RunConfig
from node.run.join import join_config
from node.workload.presets import resolved
from protocol.wire.certificates import Certificate
from protocol.wire.signing import Signer

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def _sync_manifest(founder: Signer, lab: Signer | None = None):  # type: ignore[no-untyped-def]
    recipe = RunConfig(mode="sync", fragments=2, inner_steps=3)
    authorities = [("lab", lab.public_key)] if lab is not None else []
    return SwarmIsland.found(
        _model(),
        founder,
        name="sync",
        tokens_per_step=TOKENS,
        config=recipe,
        authorities=authorities,
    )


def test_a_sync_manifest_gives_atoll_join_and_swarm_island_the_same_island_config() -> None:
    founder = Signer.from_seed(b"\x07" * 32)
    manifest = _sync_manifest(founder)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    own = ("--hold-versions", "1", "--ship-before-adopt", "2")  # a peer's own, not the swarm's
    args = _parser().parse_args(
        ["join", "--initial-peers", "http://127.0.0.1:1", "--key", "k", *own]
    )
    joined = resolved(join_config(manifest, args))  # as run_peer resolves it

    from node.diloco.island_config import island_config

    api = SwarmIsland(
        model,
        optimizer,
        tokens_per_step=TOKENS,
        swarm=Swarm(
            manifest=manifest, key=founder, config=RunConfig(hold_versions=1, ship_before_adopt=2)
        ),
    )
    try:
        assert api.island.cfg == island_config(joined, optimizer)
        assert api.island.cfg.wait_for_merge  # synchronous DiLoCo waits for each merge
        assert (api.island.cfg.hold_until_shipped, api.island.cfg.ship_before_adopt) == (True, 2)
    finally:
        api.close()


def test_a_swarm_island_in_sync_mode_sends_the_end_of_run_flush() -> None:
    """One founding island at H = 3 syncs its model once and trains one step more: that step is
    in no contribution until the end-of-run flush sends it, as ``atoll join``'s end of run does."""
    founder, lab = Signer.from_seed(b"\x08" * 32), Signer.from_seed(b"\x09" * 32)
    manifest = _sync_manifest(founder, lab)
    cert = Certificate.issue(  # an owner of a swarm with a manifest is certified
        lab,
        manifest=manifest,
        subject=founder.public_key,
        roles=("learner", "owner"),
        not_before=time.time() - 60,
        not_after=time.time() + 3600,
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    island = SwarmIsland(
        model,
        optimizer,
        tokens_per_step=TOKENS,
        swarm=Swarm(manifest=manifest, key=founder, cert=cert, config=RunConfig(peers=1)),
        timing=Timing(join_timeout_s=30, finish_timeout_s=30, linger_s=0),
    )
    assert island.cfg.flushes and island.island.cfg.wait_for_merge
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        x = torch.randn(8, 8, generator=gen)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        island.tokens(TOKENS)
        optimizer.step()
        optimizer.zero_grad()

    with island:
        while island.island.stats.sent < 2:  # the first sync of the whole model, merged
            step()
        step()  # one step more: in no contribution until the flush
        assert island.island.stats.sent == 2
    assert island.island.stats.flushed > 0
    assert min(island.versions) == 2  # the merges it waited for, then the flushed work's


def test_node_api_does_not_import_the_entry_points_of_node_run() -> None:
    tree = ast.parse((ROOT / "node" / "api.py").read_text())
    imported = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module is not None
    } | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in imported if m == "node.run" or m.startswith("node.run.")]


def test_a_development_island_takes_its_name_settings_and_address_from_its_groups() -> None:
    """``Swarm(name=...)`` names a development swarm; its config, embeddings and the network's
    address reach the island's config, plan and node (built, not entered: nothing listens)."""
    model = _model()
    island = SwarmIsland(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-2),
        swarm=Swarm(
            name="dev", config=RunConfig(fragments=2, inner_steps=7), embeddings=["0.weight"]
        ),
        tokens_per_step=TOKENS,
        network=Network(initial_peers=["http://127.0.0.1:1"], public_address="http://10.0.0.1:7"),
        timing=Timing(finish_timeout_s=0),
    )
    try:
        assert (island.cfg.swarm, island.cfg.inner_steps) == ("dev", 7)
        assert island.cfg.max_tokens_per_step == TOKENS
        assert [f.names for f in island.plan.fragments if f.is_embedding] == [("0.weight",)]
        assert island.node.public_address == "http://10.0.0.1:7"
        assert island.network.initial_peers == ("http://127.0.0.1:1",)
    finally:
        island.close()


def test_a_wrong_combination_of_arguments_says_what_to_pass_instead() -> None:
    founder, lab = Signer.from_seed(b"\x0a" * 32), Signer.from_seed(b"\x0b" * 32)
    manifest = _sync_manifest(founder, lab)
    cert = Certificate.issue(
        lab,
        manifest=manifest,
        subject=founder.public_key,
        roles=("learner",),
        not_before=time.time() - 60,
        not_after=time.time() + 3600,
    )
    with pytest.raises(ValueError, match=r"Swarm\(name=NAME\)"):
        Swarm()
    with pytest.raises(ValueError, match="leave name= out"):
        Swarm(manifest=manifest, name="dev")
    with pytest.raises(ValueError, match="pass manifest= with cert="):
        Swarm(name="dev", cert=cert)
    with pytest.raises(ValueError, match=r"\('wte.weight',\)"):
        Swarm(name="dev", embeddings="wte.weight")
    with pytest.raises(ValueError, match=r"\['http://h:7000'\], not one string"):
        Network(initial_peers="http://h:7000")
    with pytest.raises(ValueError, match="port must be 0"):
        Network(port=70000)
    for bad in ({"linger_s": -1.0}, {"finish_timeout_s": float("nan")}, {"join_timeout_s": 0.0}):
        with pytest.raises(ValueError, match="finite seconds >= 0"):
            Timing(**bad)
