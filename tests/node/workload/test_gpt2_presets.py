"""GPT-2's shapes as presets: their parameter counts are GPT-2's own (tied head)."""

from __future__ import annotations

import pytest
import torch

from node.peer.presence import state_cap
from node.wire.rpc import max_rpc_body
from node.workload.model import GPT, GPTConfig, embedding_parameter_names
from protocol.diloco.fragments import plan_fragments


@pytest.mark.parametrize(
    ("name", "count", "shape"),
    [("gpt2-124m", 124_439_808, (12, 12, 768)), ("gpt2-350m", 354_823_168, (24, 16, 1024))],
)
def test_gpt2_presets_have_gpt2s_shape_and_parameter_count(
    name: str, count: int, shape: tuple[int, int, int]
) -> None:
    cfg = GPTConfig.preset(name)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == shape
    assert (cfg.vocab_size, cfg.block_size, cfg.tie_embeddings) == (50257, 1024, True)
    with torch.device("meta"):  # shapes only: no 0.5-1.4 GB of memory, no init
        model = GPT(cfg)
    assert model.num_params() == count
    names = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" not in names  # the head is wte's weight
    plan = plan_fragments(
        [(n, tuple(p.shape)) for n, p in model.named_parameters()],
        4,
        embeddings=embedding_parameter_names(model),
    )
    assert sum(f.numel for f in plan.fragments) == count
    biggest = max(f.numel for f in plan.fragments)
    # what a join syncs and an RPC carries is sized from the model: the biggest fragment fits
    assert (
        4 * biggest < state_cap([[(f.numel,)] for f in plan.fragments]) < 12 * biggest + (8 << 20)
    )
    assert max_rpc_body(f.numel for f in plan.fragments) > 4 * biggest


def test_a_tied_head_reads_the_token_embedding() -> None:
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, tie_embeddings=True)
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    logits, _ = model(idx)
    with torch.no_grad():
        model.wte.weight[3].add_(1.0)
    logits2, _ = model(idx)
    assert not torch.equal(logits[..., 3], logits2[..., 3])  # the head moved with the embedding
    assert (
        model.num_params()
        == GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8)).num_params() - 256 * 8
    )
