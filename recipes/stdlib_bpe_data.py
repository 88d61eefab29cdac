"""The data of the GPT-2-config example recipe: the Python standard library's text, split into a
training file and a validation file, and a byte-level BPE tokenizer trained on the training file.

    python recipes/stdlib_bpe_data.py --out recipes/stdlib-bpe --vocab 8192 --max-bytes 16000000

writes ``train.txt``, ``valid.txt`` and ``tokenizer.json`` under ``--out`` and prints, last, one
JSON line with each file's path and SHA-256 (the hashes a recipe names them by). The split is by
file: every 20th standard-library file (in sorted order) goes to validation, so no validation
line is trained on. The same Python version gives the same three files, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from node.state.artifacts import sha256_file
from node.workload.corpus_files import stdlib_corpus_files  # without torch, which this needs not
from node.workload.tokenizer_train import TrainConfig, train_tokenizer

VALID_EVERY = 20


def _join(files: Iterable[Path], out: Path, max_bytes: int) -> None:
    """Concatenate text ``files`` into ``out`` (a newline after each), at most ``max_bytes``;
    files holding a NUL byte are skipped."""
    left = max_bytes
    with out.open("wb") as w:
        for f in files:
            data = f.read_bytes()[: left - 1]
            if not data or b"\0" in data:
                continue
            w.write(data + b"\n")
            left -= len(data) + 1
            if left <= 1:
                break


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the three files")
    parser.add_argument("--vocab", type=int, default=8192, help="tokenizer vocabulary")
    parser.add_argument("--max-bytes", type=int, default=16_000_000, help="training text cap")
    args = parser.parse_args(argv)
    if args.max_bytes < 10_000:
        print("--max-bytes must be at least 10000", file=sys.stderr)
        return 2
    files = stdlib_corpus_files()
    args.out.mkdir(parents=True, exist_ok=True)
    train, valid = args.out / "train.txt", args.out / "valid.txt"
    _join([f for i, f in enumerate(files) if i % VALID_EVERY], train, args.max_bytes)
    _join(files[::VALID_EVERY], valid, max(args.max_bytes // VALID_EVERY, 10_000))
    try:
        config = TrainConfig(files=(train,), vocab=args.vocab)
    except ValueError as e:
        print(f"stdlib_bpe_data: {e}", file=sys.stderr)
        return 2
    tok = args.out / "tokenizer.json"
    tok.write_text(train_tokenizer(config))
    made = {p.stem: {"path": str(p), "sha256": sha256_file(p)} for p in (train, valid, tok)}
    print(json.dumps(made, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
