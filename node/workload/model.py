"""A byte-level GPT (vocabulary 256), written the way nanoGPT writes it.

Every island trains one of these. Bytes in, next-byte logits out; no tokenizer, so any text file
is a corpus and the loss is directly comparable across runs in nats per byte (ln 256 ≈ 5.545 at
initialisation).

Design choices that matter to the rest of Atoll:

* **Untied weights.** The token embedding ``wte`` and the output head ``lm_head`` are separate
  tensors (nanoGPT ties them). DiLoCo places embeddings in fragments of their own and merges them
  with a plain weighted mean instead of radial-directional averaging; a tied matrix would be both
  an embedding and a projection at once. The price is ``vocab_size * n_embd`` extra parameters
  (16k for the small preset, 32k for base).
* **Deterministic init.** All weights come from one ``torch.Generator`` seeded by ``seed``, so
  every peer that builds ``GPT(config, seed=s)`` holds bit-identical weights before training.
* **Presets** (``GPTConfig.preset``). Speed: one training step (forward, backward, clip, AdamW)
  at batch 16, one CPU thread, on the 2-core development VM (shared, so +-15 %):

  ======  ======  =====  ====  =====  =======  ===========  ==========================================
  name    layers  heads  embd  block  params   steps/s      use
  ======  ======  =====  ====  =====  =======  ===========  ==========================================
  tiny    2       2      48    64     84k      ~47          ``atoll local`` default (9,000 steps: where
                                                            small's 3,000 end, in two thirds the time)
  small   3       4      64    128    191k     ~12-15       ``atoll local``'s until 2026-12-05; the
                                                            biggest at ~15 steps/s on one thread
  base    4       4      128   128    875k     ~4           size of docs/algorithm.md's reference run
  medium  6       8      256   256    4.9M     ~0.4         GPU machines
  gpt2-   12      12     768   1024   124.4M   --           GPT-2 small's shape, vocabulary 50,257, tied
  124m                                                      head; on CPU with ``--compute standin=S``
  gpt2-   24      16     1024  1024   354.8M   --           GPT-2 medium's shape, as gpt2-124m
  350m
  ======  ======  =====  ====  =====  =======  ===========  ==========================================

  GPT-2's presets tie the head to ``wte`` as GPT-2 does (the counts are GPT-2's own); the tied
  matrix is an embedding to the fragment plan, so it is merged with the plain weighted mean.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.nn import functional as F

from node.workload.presets import PRESETS, GPTConfig

__all__ = ["GPTConfig", "GPT", "PRESETS", "embedding_parameter_names"]


# -----------------------------------------------------------------------------
# building blocks


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, time, channels (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


# -----------------------------------------------------------------------------
# the model


class GPT(nn.Module):
    """Byte-level GPT. ``GPT(config, seed=s)`` is bit-identical for equal ``(config, s)``."""

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        device = (
            torch.get_default_device()
        )  # a model built under ``torch.device("meta")`` stays there
        # built on the meta device, then given memory once: torch's default init would draw every
        # weight a second time (~5 s of CPU at 124M parameters), and ``reset_parameters`` draws all
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
            self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
            self.drop = nn.Dropout(config.dropout)
            self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            # untied, but for the GPT-2 presets: their head is wte's weight (``forward``)
            self.lm_head = (
                None
                if config.tie_embeddings
                else nn.Linear(config.n_embd, config.vocab_size, bias=False)
            )
        self.to_empty(device=device)
        self.reset_parameters(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """GPT-2 init drawn from ``generator``: N(0, 0.02), residual projections scaled by
        1/sqrt(2 * n_layer), zero biases, unit LayerNorm gains. Walks modules in
        ``named_modules`` order, so the result depends only on the config and the generator."""
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():  # fixed order: the draws are reproducible
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()  # gain 1, bias 0
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, nn.Linear):
                std = std_proj if name.endswith("c_proj") else 0.02
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Number of parameters; with ``non_embedding`` the token and position embeddings are
        left out (the output head is counted when it is untied)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``, ``targets``: int64 (B, T) with T <= block_size.

        Returns ``(logits, loss)``: logits float (B, T, vocab); loss is the mean cross-entropy
        in nats per byte over all B*T positions, or None without targets. Raises ValueError if
        T exceeds the block size.
        """
        if idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence length {idx.size(1)} exceeds block_size {self.config.block_size}"
            )
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        tok_emb = self.wte(idx)  # (B, T, C)
        pos_emb = self.wpe(pos)  # (T, C)
        x = self.drop(tok_emb + pos_emb)  # (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight  # (vocab, C)
        logits = F.linear(x, head)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))  # scalar
        return logits, loss


def embedding_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the token and position embeddings.

    DiLoCo puts these in fragments of their own and merges them with a plain weighted mean.
    Works on any module: every ``nn.Embedding`` weight counts.
    """
    return {
        f"{mod_name}.weight" if mod_name else "weight"
        for mod_name, mod in model.named_modules()
        if isinstance(mod, nn.Embedding)
    }
