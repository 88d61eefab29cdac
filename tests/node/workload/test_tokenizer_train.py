"""The byte-level BPE trainer: the same JSON for the same files in two processes, lossless on any
text, bounded reads, and one-line mistakes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from node.workload.corpus import stdlib_corpus_files
from node.workload.tokenizer_train import CHUNK_BYTES, TrainConfig, text_blocks, train_tokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 300 KB of the standard library's .py text, copied into two folders."""
    root = tmp_path_factory.mktemp("corpus")
    total = 0
    for i, f in enumerate(stdlib_corpus_files()[:200]):
        data = f.read_bytes()
        (root / ("a" if i % 2 else "b")).mkdir(exist_ok=True)
        (root / ("a" if i % 2 else "b") / f"{i:03d}.py").write_bytes(data)
        total += len(data)
        if total > 300_000:
            break
    return root


def _train_in_a_process(
    corpus: Path, out: Path, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="random", **env_vars)
    cmd = [sys.executable, "-m", "node.workload.tokenizer_train", "--vocab", "400"]
    cmd += ["--files", f"{corpus}/**/*.py", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)


def test_two_processes_train_the_same_tokenizer(corpus: Path, tmp_path: Path) -> None:
    runs = [
        _train_in_a_process(corpus, tmp_path / "tok0.json"),
        # one thread, no parallel merge counting: the result does not depend on the cores
        _train_in_a_process(
            corpus, tmp_path / "tok1.json", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"
        ),
    ]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    a, b = ((tmp_path / f"tok{i}.json").read_bytes() for i in range(2))
    assert a == b
    assert hashlib.sha256(a).hexdigest() in runs[0].stdout
    files = tuple(sorted(corpus.glob("**/*.py"), key=str))
    assert train_tokenizer(TrainConfig(files=files, vocab=400)).encode() == a  # and in this one


def test_the_tokenizer_is_byte_level_and_lossless(corpus: Path) -> None:
    files = tuple(sorted(corpus.glob("**/*.py"), key=str))
    tok = Tokenizer.from_str(train_tokenizer(TrainConfig(files=files, vocab=300)))
    assert tok.get_vocab_size() == 300
    assert tok.token_to_id("<|endoftext|>") is not None
    for text in ["def f(x):\n    return x\n", "naïve 日本語 🙂\t\r\n", "\x00\x7f"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text


def test_more_text_makes_longer_merges(corpus: Path) -> None:
    files = tuple(sorted(corpus.glob("**/*.py"), key=str))
    small = Tokenizer.from_str(train_tokenizer(TrainConfig(files=files, vocab=300)))
    large = Tokenizer.from_str(train_tokenizer(TrainConfig(files=files, vocab=600)))
    sample = files[0].read_text()
    assert len(large.encode(sample).ids) < len(small.encode(sample).ids) < len(sample.encode())


def test_text_blocks_are_bounded_and_skip_binary(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes((b"x" * 1000 + b"\n") * 3000)  # 3 MB
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"abc\0def")
    blocks = list(text_blocks([binary, big], max_bytes=1 << 40))
    assert all(len(b) <= CHUNK_BYTES for b in blocks)
    assert "".join(blocks) == big.read_text()  # the binary file contributed nothing
    assert all(b.endswith("\n") for b in blocks)
    capped = "".join(text_blocks([big], max_bytes=5000))
    assert capped == big.read_text()[:5000]


def test_mistakes_are_one_line_and_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args, match in (
        (["--vocab", "100", "--files", str(tmp_path)], "--vocab must be 257"),
        (["--vocab", "400", "--files", str(tmp_path / "none*.txt")], "matched nothing"),
    ):
        cmd = [sys.executable, "-m", "node.workload.tokenizer_train", *args]
        run = subprocess.run(
            [*cmd, "--out", str(tmp_path / "t.json")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert run.returncode == 2 and match in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()


def test_the_example_recipe_data_script(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "recipes" / "stdlib_bpe_data.py"), "--out", str(tmp_path)]
    run = subprocess.run(
        [*cmd, "--vocab", "300", "--max-bytes", "200000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    made = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(made) == {"train", "valid", "tokenizer"}
    for item in made.values():
        assert hashlib.sha256(Path(item["path"]).read_bytes()).hexdigest() == item["sha256"]
    train, valid = (tmp_path / "train.txt").read_bytes(), (tmp_path / "valid.txt").read_bytes()
    assert 150_000 < len(train) <= 200_000 and 5_000 < len(valid) <= 10_000
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 300
