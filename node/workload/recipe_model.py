"""A recipe's model (``protocol.wire.recipe``), built from its artifacts and nothing else.

``type = "gpt"``: the built-in GPT preset, its context the recipe's ``seq_len`` and its
vocabulary the tokenizer's. ``type = "hf"``: a ``transformers`` causal LM built from the
config JSON with ``AutoConfig.for_model`` and ``AutoModelForCausalLM.from_config`` (never
``from_pretrained``, never remote code: the config was checked by
``protocol.wire.recipe.check_hf_config``), initialised from the run's seed so every peer builds
the same version 0, or loaded from the recipe's safetensors weights. ``CausalLM`` gives either
the training loop's interface: ``model(x, y) -> (logits, loss)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from node.workload.model import GPT
from node.workload.presets import GPTConfig
from protocol.wire.recipe import Recipe, check_hf_config

__all__ = ["CausalLM", "RecipeModelError", "build_recipe_model", "hf_config"]


class RecipeModelError(ValueError):
    """A recipe whose model cannot be built (one line: what, and what to do)."""


class CausalLM(nn.Module):
    """A transformers causal LM as the loop calls a model: ``(logits [B, T, V], loss | None)``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.lm(input_ids=idx, use_cache=False).logits  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def hf_config(raw: bytes) -> Any:
    """The ``transformers`` config of a recipe's config JSON. Raises ``RecipeModelError`` for a
    model type this transformers does not know, and ``DecodeError`` (``check_hf_config``) for
    a config that is not JSON or would load code."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = check_hf_config(raw)
    kind = data.pop("model_type")
    if kind not in CONFIG_MAPPING:
        raise RecipeModelError(
            f"recipe: unknown model type {kind!r} in the model config (this transformers knows "
            f"{len(CONFIG_MAPPING)} types, e.g. gpt2, llama, qwen2)"
        )
    data.pop("transformers_version", None)
    return AutoConfig.for_model(kind, **data)


def build_recipe_model(
    recipe: Recipe, files: dict[str, Path], *, vocab_size: int, seed: int
) -> nn.Module:
    """The recipe's model on the CPU, the same on every peer (seeded init, or the weights).
    ``files``: artifact hash -> its verified file. Raises ``RecipeModelError`` with one line."""
    if recipe.model_type == "gpt":
        try:
            gcfg = GPTConfig.preset(recipe.preset, block_size=recipe.seq_len, vocab_size=vocab_size)
        except ValueError as exc:
            raise RecipeModelError(f"recipe: model.preset: {exc}") from None
        return GPT(gcfg, seed=seed)
    from transformers import AutoModelForCausalLM

    config = hf_config(files[recipe.config].read_bytes())
    if getattr(config, "vocab_size", vocab_size) < vocab_size:
        raise RecipeModelError(
            f"recipe: the model's vocab_size {config.vocab_size} is smaller than the tokenizer's "
            f"{vocab_size}"
        )
    positions = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", 0
    )
    if positions and positions < recipe.seq_len:
        raise RecipeModelError(
            f"recipe: seq_len {recipe.seq_len} is longer than the model's {positions} positions"
        )
    torch.manual_seed(seed)  # version 0: the same seeded init on every peer
    lm = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if recipe.weights:
        _load_weights(lm, files[recipe.weights])
    return CausalLM(lm)


def _load_weights(lm: nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    from protocol.wire.recipe import check_safetensors_header

    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += f.read(min(n, 64 << 20))
    check_safetensors_header(head, path.stat().st_size)
    state = load_file(str(path))
    missing, unexpected = lm.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not _tied(lm, m)]:
        raise RecipeModelError(
            f"recipe: the weights do not fit the model config (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )


def _tied(lm: nn.Module, name: str) -> bool:
    """Whether a parameter missing from the weights is tied to one they hold (GPT-2's head)."""
    tied = getattr(lm, "_tied_weights_keys", None) or {}
    return name in (tied if isinstance(tied, (list, dict, set, tuple)) else ())


def tokenizer_vocab(path: Path) -> int:
    """The vocabulary size of a ``tokenizers`` JSON; ``RecipeModelError`` if it does not load."""
    from tokenizers import Tokenizer

    try:
        json.loads(path.read_bytes())
        return int(Tokenizer.from_file(str(path)).get_vocab_size())
    except Exception as exc:  # tokenizers raises its own Exception type for bad JSON
        raise RecipeModelError(
            f"recipe: the tokenizer is not a tokenizers JSON ({' '.join(str(exc).split())[:120]})"
        ) from None
