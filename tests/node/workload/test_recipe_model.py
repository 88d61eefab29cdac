"""A recipe's model: the same version 0 on every peer, the loop's (logits, loss) interface, and
initial weights from safetensors only."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from node.workload.recipe_model import RecipeModelError, build_recipe_model
from protocol.wire.recipe import Recipe

CONFIG = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32}


def _hf(tmp_path: Path, **extra: object) -> tuple[Recipe, dict[str, Path]]:
    raw = json.dumps({**CONFIG, "vocab_size": 64, **extra}).encode()
    digest = hashlib.sha256(raw).hexdigest()
    (tmp_path / digest).write_bytes(raw)
    tok = hashlib.sha256(b"tok").hexdigest()
    recipe = Recipe(model_type="hf", config=digest, tokenizer=tok, seq_len=16, batch_size=2)
    return recipe, {digest: tmp_path / digest}


def test_every_peer_builds_the_same_version_0_and_the_loop_gets_logits_and_loss(
    tmp_path: Path,
) -> None:
    recipe, files = _hf(tmp_path)
    a = build_recipe_model(recipe, files, vocab_size=60, seed=3)
    b = build_recipe_model(recipe, files, vocab_size=60, seed=3)
    c = build_recipe_model(recipe, files, vocab_size=60, seed=4)
    same = [torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True)]
    assert all(same) and not torch.equal(next(a.parameters()), next(c.parameters()))
    x = torch.randint(0, 60, (2, 16))  # (B, T) int64
    logits, loss = a(x, x)
    assert logits.shape == (2, 16, 64) and loss is not None and loss.item() > 0
    assert a(x)[1] is None


def test_initial_weights_load_from_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    recipe, files = _hf(tmp_path)
    trained = build_recipe_model(recipe, files, vocab_size=60, seed=9)
    state = {k: v.contiguous() for k, v in trained.lm.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    weights = hashlib.sha256(path.read_bytes()).hexdigest()
    with_weights = dataclasses.replace(recipe, weights=weights)
    loaded = build_recipe_model(with_weights, {**files, weights: path}, vocab_size=60, seed=0)
    assert all(
        torch.equal(p, q) for p, q in zip(trained.parameters(), loaded.parameters(), strict=True)
    )


def test_a_model_too_small_for_the_tokenizer_or_the_window_is_refused(tmp_path: Path) -> None:
    recipe, files = _hf(tmp_path)
    with pytest.raises(RecipeModelError, match="vocab_size 64 is smaller than the tokenizer's 100"):
        build_recipe_model(recipe, files, vocab_size=100, seed=0)
    long = dataclasses.replace(recipe, seq_len=64)
    with pytest.raises(RecipeModelError, match="seq_len 64 is longer than the model's 32"):
        build_recipe_model(long, files, vocab_size=60, seed=0)


def test_the_built_in_gpt_takes_the_recipes_context_and_vocabulary() -> None:
    recipe = Recipe(model_type="gpt", preset="tiny", seq_len=32, batch_size=2)
    model = build_recipe_model(recipe, {}, vocab_size=300, seed=0)
    logits, _ = model(torch.randint(0, 300, (2, 32)), None)
    assert logits.shape == (2, 32, 300)
