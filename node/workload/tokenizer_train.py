"""Train a byte-level BPE tokenizer (``tokenizers``) on local text files, for a recipe.

    python -m node.workload.tokenizer_train --files 'data/*.txt' --vocab 8192 --out tok.json
    python -m node.workload.tokenizer_train --stdlib --max-bytes 8000000 --vocab 4096 --out tok.json

Byte-level (GPT-2's pre-tokenizer and decoder), so every byte string encodes and decodes back
exactly, with ``<|endoftext|>`` as its one special token (``token_data`` puts it after each
document). The files are read in sorted order, in blocks of at most 1 MiB cut at line ends; the
result is the same JSON, byte for byte, for the same files, vocabulary and ``--max-bytes`` (a
test trains twice in two processes and compares). The output is written atomically and its
SHA-256 printed: the hash a recipe names it by.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from node.state.atomic import write_atomic

__all__ = ["TrainConfig", "main", "text_blocks", "train_tokenizer"]

CHUNK_BYTES = 1 << 20
MIN_VOCAB = 257  # the 256 byte tokens and <|endoftext|>
MAX_VOCAB = 1 << 20
MAX_FILES = 1 << 20
DEFAULT_MAX_BYTES = 1 << 30
EOT = "<|endoftext|>"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """What to train: ``files`` (read in this order), ``vocab`` tokens in all, and at most
    ``max_bytes`` of text read (the rest ignored)."""

    files: tuple[Path, ...]
    vocab: int
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if not MIN_VOCAB <= self.vocab <= MAX_VOCAB:
            raise ValueError(f"--vocab must be {MIN_VOCAB} to {MAX_VOCAB}, got {self.vocab}")
        if not self.files:
            raise ValueError("no training files: --files matched nothing")
        if len(self.files) > MAX_FILES:
            raise ValueError(f"{len(self.files)} files, more than {MAX_FILES}: join some")
        if self.max_bytes < 1:
            raise ValueError(f"--max-bytes must be positive, got {self.max_bytes}")


def text_blocks(files: Sequence[Path], max_bytes: int) -> Iterator[str]:
    """The files' text in blocks of at most 1 MiB, each cut after its last line end when it
    holds one, at most ``max_bytes`` read in all. A block holding a NUL byte marks its file as
    binary: that block and the rest of the file are skipped."""
    left = max_bytes
    for path in files:
        if left <= 0:
            return
        carry = b""
        with path.open("rb") as f:
            while fresh := f.read(min(CHUNK_BYTES - len(carry), left)):
                left -= len(fresh)
                if b"\0" in fresh:
                    carry = b""
                    break
                block = carry + fresh
                cut = (block.rfind(b"\n") + 1 or len(block)) if left > 0 else len(block)
                carry = block[cut:]
                yield block[:cut].decode("utf-8", errors="replace")
        if carry:
            yield carry.decode("utf-8", errors="replace")


def train_tokenizer(config: TrainConfig) -> str:
    """The trained tokenizer as its JSON text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text_blocks(config.files, config.max_bytes), trainer)
    return str(tok.to_str())


def _files(patterns: Sequence[str], stdlib: bool) -> tuple[Path, ...]:
    found: set[Path] = set()
    if stdlib:
        from node.workload.corpus_files import stdlib_corpus_files

        found.update(stdlib_corpus_files())
    for pattern in patterns:
        found.update(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    return tuple(sorted(found, key=str))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m node.workload.tokenizer_train", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--files", nargs="*", default=[], help="glob patterns ('**' recurses)")
    parser.add_argument("--stdlib", action="store_true", help="add the standard library's .py")
    parser.add_argument("--vocab", type=int, required=True, help="tokens in all, 257 or more")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="text cap")
    parser.add_argument("--out", type=Path, required=True, help="the tokenizer JSON to write")
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(
            files=_files(args.files, args.stdlib), vocab=args.vocab, max_bytes=args.max_bytes
        )
    except ValueError as e:
        print(f"tokenizer_train: {e}", file=sys.stderr)
        return 2
    data = train_tokenizer(config).encode()
    write_atomic(args.out, data)
    digest = hashlib.sha256(data).hexdigest()
    print(
        f"wrote {args.out}: {config.vocab} tokens from {len(config.files)} files, sha256 {digest}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
