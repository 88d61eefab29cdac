"""The byte-level GPT's shape (``GPTConfig``), its named presets, and ``resolved``, a run's
config with what the preset and the mode imply, all without torch: the launchers check
``--model`` and write the swarm's recipe before (or without) importing it. The model itself, and
the presets' speeds, are ``node.workload.model``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from node.config import RunConfig

__all__ = ["GPTConfig", "PRESETS", "resolved"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    block_size: int = 128  # context length in bytes
    vocab_size: int = 256  # bytes
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, like GPT-2
    # the output head is the token embedding (GPT-2's, nanoGPT's); the byte presets untie them
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @staticmethod
    def preset(name: str, **overrides: object) -> GPTConfig:
        """The named preset (``PRESETS``' keys), with optional field overrides.

        Raises ValueError for an unknown name.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=48),
    "small": GPTConfig(block_size=128, n_layer=3, n_head=4, n_embd=64),
    "base": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=8, n_embd=256),
    # GPT-2 small's and medium's shapes with its vocabulary and tied head: 124,439,808 and
    # 354,823,168 parameters, GPT-2's own counts. The byte tokens use 256 of the 50,257 rows.
    "gpt2-124m": GPTConfig(
        block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, tie_embeddings=True
    ),
    "gpt2-350m": GPTConfig(
        block_size=1024, vocab_size=50257, n_layer=24, n_head=16, n_embd=1024, tie_embeddings=True
    ),
}


def resolved(cfg: RunConfig) -> RunConfig:
    """``cfg`` with what the GPT workload and the mode imply filled in: a token cap of 0 becomes
    B·T, the most tokens a learner trains per inner step; ``sync`` merges only once every learner
    contributed (quorum = peers, no grace window), ``ddp`` does so every inner step (H = 1, which
    does not grow). The swarm's manifest covers the result."""
    if cfg.mode in ("sync", "ddp"):
        cfg = replace(
            cfg,
            quorum=cfg.peers,
            grace_gamma=0.0,
            inner_steps=1 if cfg.mode == "ddp" else cfg.inner_steps,
            sync_growth="constant" if cfg.mode == "ddp" else cfg.sync_growth,
        )
    if cfg.max_tokens_per_step:
        return cfg
    block = GPTConfig.preset(cfg.model).block_size
    return replace(cfg, max_tokens_per_step=cfg.batch_size * block)
