"""The byte-level GPT: shapes, initial loss, determinism, embeddings, presets, learning."""

from __future__ import annotations

import math

import pytest
import torch

from node.workload.model import GPT, PRESETS, GPTConfig, embedding_parameter_names


def tiny() -> GPT:
    return GPT(GPTConfig.preset("tiny"), seed=0)


def test_forward_shapes_and_initial_loss_is_uniform_over_bytes() -> None:
    model = tiny()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert loss is not None and loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.1
    _, no_loss = model(idx)
    assert no_loss is None


def test_sequence_longer_than_block_size_is_refused() -> None:
    model = tiny()
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_init_is_deterministic_per_seed_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    a, b, c = tiny(), tiny(), GPT(GPTConfig.preset("tiny"), seed=1)
    assert torch.equal(torch.rand(3), torch.manual_seed(123) and torch.rand(3))
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name


def test_embedding_names_are_the_untied_token_and_position_tables() -> None:
    model = tiny()
    names = embedding_parameter_names(model)
    assert names == {"wte.weight", "wpe.weight"}
    params = dict(model.named_parameters())
    assert names <= set(params)
    assert params["lm_head.weight"].data_ptr() != params["wte.weight"].data_ptr()


def test_presets_sizes_and_overrides() -> None:
    with torch.device("meta"):  # counted without allocating the 124M and 350M presets (7 s)
        sizes = {name: GPT(cfg).num_params() for name, cfg in PRESETS.items() if name != "medium"}
    assert 50_000 <= sizes["tiny"] <= 100_000
    assert sizes["tiny"] < sizes["small"] < sizes["base"]
    assert 800_000 <= sizes["base"] <= 1_000_000
    model = tiny()
    emb = model.wte.weight.numel() + model.wpe.weight.numel()
    assert model.num_params(non_embedding=True) == model.num_params() - emb
    assert GPTConfig.preset("small", block_size=32).block_size == 32
    with pytest.raises(ValueError, match="unknown model preset"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)


def test_a_few_steps_on_a_tiny_corpus_lower_the_loss() -> None:
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 4))  # (180,)
    x, y = text[:64].view(2, 32), text[1:65].view(2, 32)  # (2, 32) int64 each
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.5
