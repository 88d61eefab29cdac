"""Throughput of a recipe's data path (node.workload.token_data), against plain baselines.

On ``--mbytes`` MB of the standard library's text and a byte-level BPE tokenizer trained here
(``--vocab``), in one run:

``tokenise``  RecipeData.prepare() with a cold cache: cut ``--shards`` byte shards, tokenise them
              in 1 MiB blocks and write the verified token files (MB of text per second);
              baseline ``encode``: the same tokenizer's ``encode_batch`` of each training file's
              text whole, held in memory, nothing written.
``reuse``     a second RecipeData over the same cache: every token file's digest checked
              (MB of text per second; no tokenising).
``sample``    TrainStream.next() (B, T) int64 batches from the dealt memory-mapped shards
              (tokens per second); baseline ``gather``: torch.take of random windows from one
              in-memory int64 tensor of the same tokens (corpus.BatchSampler's way).

Ratios are ``ours / baseline``. Run from the repository root::

    python -m bench.token_data --json
    python -m bench.token_data --json --mbytes 2 --vocab 1024

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from node.workload.corpus import stdlib_corpus_files
from node.workload.token_data import DataSpec, RecipeData, RecipeFiles
from node.workload.tokenizer_train import TrainConfig, train_tokenizer


@dataclass(frozen=True)
class Config:
    """What to measure (mirrored by the command line)."""

    mbytes: float = 8.0  # training text, MB (1e6 B)
    vocab: int = 8192
    shards: int = 64
    batch_size: int = 16
    seq_len: int = 1024
    batches: int = 200  # timed batches per sampler, best of 3 runs
    threads: int = 1  # torch.set_num_threads (the box is shared: one thread is steadier)
    json: bool = False


def _text(cfg: Config, root: Path) -> tuple[list[Path], Path]:
    """Training files of about ``cfg.mbytes`` MB (four, so shards span files) and a validation
    file, under ``root``."""
    want = int(cfg.mbytes * 1e6)
    data = bytearray()
    files = stdlib_corpus_files()
    for f in files[1:]:
        data += f.read_bytes() + b"\n"
        if len(data) >= want:
            break
    parts = [bytes(data[i * len(data) // 4 : (i + 1) * len(data) // 4]) for i in range(4)]
    paths = [root / f"train{i}.txt" for i in range(4)]
    for p, part in zip(paths, parts, strict=True):
        p.write_bytes(part)
    valid = root / "valid.txt"
    valid.write_bytes(files[0].read_bytes() * 4)
    return paths, valid


def _store(root: Path, paths: list[Path]) -> dict[str, Path]:
    return {hashlib.sha256(p.read_bytes()).hexdigest(): p for p in paths}


def _best_of_3(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def run(cfg: Config) -> dict[str, object]:
    torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train, valid = _text(cfg, root)
        text_bytes = sum(p.stat().st_size for p in train)
        tok_file = root / "tok.json"
        t = time.perf_counter()
        tok_file.write_text(train_tokenizer(TrainConfig(files=tuple(train), vocab=cfg.vocab)))
        train_s = time.perf_counter() - t
        print(f"tokenizer: {cfg.vocab} tokens trained in {train_s:.1f} s", file=sys.stderr)
        store = _store(root, [*train, valid])
        by_path = {p: h for h, p in store.items()}
        spec = DataSpec(
            files=tuple(by_path[p] for p in train), validation=(by_path[valid],), shards=cfg.shards
        )

        def make(me: bytes) -> RecipeData:
            return RecipeData(
                spec,
                RecipeFiles(tok_file, store.__getitem__, root / "cache"),
                seq_len=cfg.seq_len,
                batch_size=cfg.batch_size,
                me=me,
                seed=0,
            )

        # -- tokenise: cold cache, against encode_batch of each file whole
        tok = Tokenizer.from_file(str(tok_file))
        t = time.perf_counter()
        for p in train:
            tok.encode_batch([p.read_text(errors="replace")], add_special_tokens=False)
        encode_s = time.perf_counter() - t
        t = time.perf_counter()
        data = make(b"me")
        n_tokens = data.prepare()
        tokenise_s = time.perf_counter() - t
        print(
            f"tokenise: {text_bytes / 1e6 / tokenise_s:.2f} MB/s, encode "
            f"{text_bytes / 1e6 / encode_s:.2f} MB/s",
            file=sys.stderr,
        )

        # -- reuse: digests checked, nothing tokenised
        t = time.perf_counter()
        again = make(b"me")
        again.prepare()
        reuse_s = time.perf_counter() - t

        # -- sample: dealt memmapped shards against torch.take from one tensor
        stream = again.train_stream(lambda: [b"me"])
        stream.next()
        sample_s = _best_of_3(lambda: [stream.next() for _ in range(cfg.batches)])
        tokens = torch.from_numpy(
            np.concatenate([np.asarray(again.shard_tokens(s)) for s in range(cfg.shards)])
        ).long()  # (n,) int64, in memory
        g = torch.Generator().manual_seed(0)
        offsets = torch.arange(cfg.seq_len + 1)  # (T+1,)

        def gather() -> None:
            for _ in range(cfg.batches):
                starts = torch.randint(
                    0, tokens.numel() - cfg.seq_len, (cfg.batch_size,), generator=g
                )
                window = torch.take(tokens, starts[:, None] + offsets[None, :])  # (B, T+1) int64
                _x, _y = window[:, :-1].contiguous(), window[:, 1:].contiguous()

        gather_s = _best_of_3(gather)

    per_batch = cfg.batch_size * cfg.seq_len * cfg.batches
    result = {
        "bench": "token_data",
        "config": asdict(cfg),
        "machine": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "text_mb": round(text_bytes / 1e6, 3),
        "tokens": n_tokens,
        "bytes_per_token": round(text_bytes / n_tokens, 3),
        "tokenise_mb_s": round(text_bytes / 1e6 / tokenise_s, 3),
        "encode_mb_s": round(text_bytes / 1e6 / encode_s, 3),
        "tokenise_vs_encode": round(encode_s / tokenise_s, 3),
        "reuse_mb_s": round(text_bytes / 1e6 / reuse_s, 3),
        "reuse_vs_tokenise": round(tokenise_s / reuse_s, 3),
        "sample_tokens_s": round(per_batch / sample_s),
        "gather_tokens_s": round(per_batch / gather_s),
        "sample_vs_gather": round(gather_s / sample_s, 3),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(Config()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(value), default=value)
    cfg = Config(**vars(parser.parse_args(argv)))
    result = run(cfg)
    for key, value in result.items():
        if key not in ("config", "bench"):
            print(f"{key}: {value}", file=sys.stderr)
    if cfg.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
