"""A recipe's data: the [data] table, byte shards that tokenise losslessly, the on-disk token
cache (atomic, verified, rebuilt when damaged), dealing over learners and the validation set."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from node.workload import token_data
from node.workload.corpus import stdlib_corpus_files
from node.workload.token_data import (
    DataError,
    DataSpec,
    RecipeData,
    RecipeFiles,
    _line_pieces,
    read_token_file,
    write_token_file,
)
from node.workload.tokenizer_train import TrainConfig, train_tokenizer
from protocol.diloco.shard_deal import deal, deal_all

H = "ab" * 32  # a well-formed sha256 hex


# -----------------------------------------------------------------------------
# fixtures: a small BPE tokenizer and an artifact store of stdlib text


@pytest.fixture(scope="module")
def texts() -> list[bytes]:
    return [f.read_bytes() for f in stdlib_corpus_files()[:40]]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tok.json"
    files = tuple(stdlib_corpus_files()[:30])
    path.write_text(train_tokenizer(TrainConfig(files=files, vocab=320, max_bytes=200_000)))
    return path


class Store:
    """Artifacts by sha256 hex in one folder, as the artifact store keeps them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put(self, data: bytes) -> str:
        h = hashlib.sha256(data).hexdigest()
        (self.root / h).write_bytes(data)
        return h

    def path(self, h: str) -> Path:
        return self.root / h


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


@pytest.fixture
def make_data(store: Store, tokenizer_file: Path, tmp_path: Path) -> Callable[..., RecipeData]:
    def make(spec: DataSpec, **kw: object) -> RecipeData:
        # tokenizer_file, artifact_path and cache_dir go to RecipeFiles, the rest to RecipeData
        where = {k: kw.pop(k) for k in ("tokenizer_file", "artifact_path", "cache_dir") if k in kw}
        files = replace(RecipeFiles(tokenizer_file, store.path, tmp_path / "cache"), **where)
        args: dict[str, object] = {
            "seq_len": 32,
            "batch_size": 4,
            "me": b"me",
            "seed": 0,
        }
        return RecipeData(spec, files, **(args | kw))  # type: ignore[arg-type]

    return make


@pytest.fixture
def text_spec(store: Store, texts: list[bytes]) -> DataSpec:
    train = [store.put(b"".join(texts[:15])), store.put(b"".join(texts[15:30]))]
    valid = [store.put(b"".join(texts[30:40]))]
    return DataSpec(files=tuple(train), validation=tuple(valid), shards=12)


def decode_without_eot(tokenizer_file: Path, ids: np.ndarray) -> str:
    tok = Tokenizer.from_file(str(tokenizer_file))
    eot = tok.token_to_id("<|endoftext|>")
    return str(tok.decode([int(i) for i in ids if i != eot]))


# -----------------------------------------------------------------------------
# the [data] table


def test_from_table_reads_a_full_table_and_to_table_reads_back() -> None:
    spec = DataSpec.from_table(
        {"source": "files", "files": [H], "format": "jsonl", "shards": 8, "validation": [H]}
    )
    assert spec.files == (H,) and spec.format == "jsonl" and spec.shards == 8
    assert spec.artifacts() == (H,)  # listed once
    assert DataSpec.from_table(spec.to_table()) == spec
    hf = DataSpec.from_table({"source": "hf", "hf_name": "user/corpus", "validation": [H]})
    assert hf.hf_split == "train" and hf.artifacts() == (H,)
    assert DataSpec.from_table(hf.to_table()) == hf
    pinned = DataSpec.from_table(hf.to_table() | {"hf_revision": "9e1f3a2", "hf_split": "val"})
    assert pinned.hf_revision == "9e1f3a2" and DataSpec.from_table(pinned.to_table()) == pinned


@pytest.mark.parametrize(
    "table, match",
    [
        ({"files": [H], "validation": [H], "shard": 3}, "data.shard is not a"),
        ({"files": [H], "validation": [H], "source": "s3"}, "data.source must be"),
        ({"files": ["abc"], "validation": [H]}, "data.files holds 'abc'"),
        ({"files": [H.upper()], "validation": [H]}, "not a sha256"),
        ({"files": [], "validation": [H]}, "data.files is empty"),
        ({"files": H, "validation": [H]}, "data.files must be a list"),
        ({"files": [H]}, "data.validation is empty"),
        ({"files": [H], "validation": [H], "shards": 0}, "data.shards must be 1"),
        ({"files": [H], "validation": [H], "shards": "8"}, "data.shards must be an integer"),
        ({"files": [H], "validation": [H], "shards": True}, "data.shards must be an integer"),
        ({"files": [H], "validation": [H], "format": "csv"}, "data.format must be"),
        ({"files": [H], "validation": [H], "hf_name": "a/b"}, "data.hf_name and hf_revision"),
        ({"files": [H], "validation": [H], "hf_revision": "main"}, "data.hf_name and hf_revision"),
        (
            {"source": "hf", "hf_name": "a/b", "hf_revision": "x y", "validation": [H]},
            "hf_revision",
        ),
        ({"source": "hf", "validation": [H]}, "data.hf_name must be"),
        ({"source": "hf", "hf_name": "../x", "validation": [H]}, "data.hf_name must be"),
        ({"source": "hf", "hf_name": "a/b", "files": [H], "validation": [H]}, "data.files is for"),
        ({"source": "hf", "hf_name": "a/b", "hf_split": "a b", "validation": [H]}, "hf_split"),
        ({"files": [H], "validation": [H], "text_field": 3}, "data.text_field must be a string"),
    ],
)
def test_from_table_refuses_with_one_line_naming_the_key(
    table: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match) as e:
        DataSpec.from_table(table)
    assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# token files


def test_token_file_round_trip_uint16_and_uint32(tmp_path: Path) -> None:
    for dtype, top in ((np.dtype(np.uint16), 65535), (np.dtype(np.uint32), 2**32 - 1)):
        chunks = [np.arange(10, dtype=np.int64), np.array([top, 0], dtype=np.int64)]
        path = tmp_path / f"{dtype}.tok"
        assert write_token_file(path, chunks, dtype=dtype) == 12
        got = read_token_file(path, dtype=dtype)
        assert got.dtype.itemsize == dtype.itemsize
        assert got.tolist() == [*range(10), top, 0]
        assert path.stat().st_size == 64 + 12 * dtype.itemsize


def test_a_crash_while_writing_leaves_no_file(tmp_path: Path) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield np.arange(100, dtype=np.int64)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_token_file(tmp_path / "a.tok", chunks(), dtype=np.dtype(np.uint16))
    assert list(tmp_path.iterdir()) == []


def test_a_token_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OverflowError):
        write_token_file(tmp_path / "a.tok", [np.array([70000])], dtype=np.dtype(np.uint16))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[:-1], "holds"),
        (lambda b: b[:-2] + bytes([b[-2] ^ 1]) + b[-1:], "digest"),
        (lambda b: b"NOTATOK!" + b[8:], "not a version-1"),
        (lambda b: b[:10], "shorter than its header"),
    ],
)
def test_a_damaged_token_file_is_detected(
    tmp_path: Path, damage: Callable[[bytes], bytes], match: str
) -> None:
    path = tmp_path / "a.tok"
    write_token_file(path, [np.arange(50)], dtype=np.dtype(np.uint16))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=match):
        read_token_file(path, dtype=np.dtype(np.uint16))


# -----------------------------------------------------------------------------
# shards, the cache and the validation set


def test_the_shards_hold_the_training_text_exactly_once(
    make_data: Callable[..., RecipeData],
    text_spec: DataSpec,
    texts: list[bytes],
    tokenizer_file: Path,
) -> None:
    data = make_data(text_spec)
    assert data.vocab_size == 320 and data.prepare() > 0
    decoded = [decode_without_eot(tokenizer_file, data.shard_tokens(s)) for s in range(12)]
    assert all(decoded)  # no empty shard on this much text
    assert "".join(decoded).encode() == b"".join(texts[:30])
    # each shard but the first starts at a line start
    joined = b"".join(texts[:30])
    for cut in data._bytes.cuts[1:-1]:  # type: ignore[union-attr]
        assert joined[cut - 1 : cut] == b"\n"


def test_each_document_ends_with_end_of_text(
    make_data: Callable[..., RecipeData], text_spec: DataSpec, tokenizer_file: Path
) -> None:
    data = make_data(text_spec)
    eot = Tokenizer.from_file(str(tokenizer_file)).token_to_id("<|endoftext|>")
    counts = [int((data.shard_tokens(s) == eot).sum()) for s in range(12)]
    assert sum(counts) == 2  # two training files, two documents
    assert int(data.validation[-1]) == eot


def test_the_cache_is_reused_and_a_damaged_file_rebuilt(
    make_data: Callable[..., RecipeData], text_spec: DataSpec, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="node.workload.token_data")
    first = make_data(text_spec)
    tokens = first.shard_tokens(5).copy()
    assert sum("tokenised" in r.message for r in caplog.records) == 2  # validation, shard 5
    caplog.clear()
    again = make_data(text_spec)
    assert np.array_equal(again.shard_tokens(5), tokens)
    assert not any("tokenised" in r.message for r in caplog.records)

    path = again.shard_dir / "shard-00005.tok"
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    caplog.clear()
    rebuilt = make_data(text_spec)
    assert np.array_equal(rebuilt.shard_tokens(5), tokens)
    assert any("damaged" in r.message for r in caplog.records)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_another_shard_count_or_tokenizer_is_another_cache(
    make_data: Callable[..., RecipeData], text_spec: DataSpec, tmp_path: Path, texts: list[bytes]
) -> None:
    a = make_data(text_spec)
    b = make_data(DataSpec.from_table(text_spec.to_table() | {"shards": 6}))
    other_tok = tmp_path / "other.json"
    files = tuple(stdlib_corpus_files()[40:50])
    other_tok.write_text(train_tokenizer(TrainConfig(files=files, vocab=300, max_bytes=100_000)))
    c = make_data(text_spec, tokenizer_file=other_tok)
    assert len({a.shard_dir, b.shard_dir, c.shard_dir}) == 3


def test_validation_windows_are_the_same_on_every_peer(
    make_data: Callable[..., RecipeData], text_spec: DataSpec, tmp_path: Path
) -> None:
    a = make_data(text_spec, me=b"alice", seed=1)
    b = make_data(text_spec, me=b"bob", seed=2, cache_dir=tmp_path / "other-cache")
    wa, wb = a.validation_windows(7), b.validation_windows(7)
    assert wa.shape == (7, 33) and wa.dtype == torch.int64
    assert torch.equal(wa, wb)
    assert int(wa.max()) < a.vocab_size
    assert torch.equal(wa[-1], torch.from_numpy(a.validation[-33:].astype(np.int64)))
    whole = torch.from_numpy(np.asarray(a.validation, dtype=np.int64))
    assert a.validation_sha256 == hashlib.sha256(whole.numpy().tobytes()).hexdigest()
    assert a.validation_sha256 == b.validation_sha256


# -----------------------------------------------------------------------------
# dealing and batches


def _windows_of(tokens: np.ndarray, width: int) -> set[bytes]:
    view = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.int64), width)
    return {row.tobytes() for row in view}


def test_batches_come_only_from_the_dealt_shards(
    make_data: Callable[..., RecipeData], text_spec: DataSpec
) -> None:
    learners = [b"alice", b"bob", b"carol"]
    data = make_data(text_spec, me=b"bob")
    stream = data.train_stream(lambda: learners)
    x, y = stream.next()
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert stream.dealt == deal(12, learners, b"bob") and stream.dealt
    assert stream.tokens_per_batch == 4 * 32
    mine = set().union(*(_windows_of(data.shard_tokens(s), 33) for s in stream.dealt))
    for _ in range(5):
        x, y = stream.next()
        for row in torch.cat([x, y[:, -1:]], dim=1):
            assert row.numpy().tobytes() in mine


def test_two_peers_are_dealt_disjoint_shards_that_cover_everything(
    make_data: Callable[..., RecipeData], text_spec: DataSpec
) -> None:
    learners = [b"alice", b"bob"]
    streams = [make_data(text_spec, me=me).train_stream(lambda: learners) for me in learners]
    for s in streams:
        s.next()
    a, b = (set(s.dealt) for s in streams)
    assert not a & b and a | b == set(range(12))


def test_the_shards_are_dealt_again_when_the_learners_change(
    make_data: Callable[..., RecipeData], text_spec: DataSpec, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="node.workload.token_data")
    learners = [b"me", b"alice"]
    stream = make_data(text_spec).train_stream(lambda: learners)
    stream.next()
    before = stream.dealt
    stream.next()  # same set: no new deal
    learners.extend([b"bob", b"carol"])
    stream.next()
    after = stream.dealt
    assert set(after) <= set(before) and after == deal_all(12, learners)[b"me"]
    lines = [r.message for r in caplog.records if r.message.startswith("shards dealt")]
    assert lines == [
        f"shards dealt: {list(before)} of 12 among 2 learners",
        f"shards dealt: {list(after)} of 12 among 4 learners",
    ]


def test_the_same_seed_draws_the_same_batches(
    make_data: Callable[..., RecipeData], text_spec: DataSpec
) -> None:
    def batches(me: bytes, seed: int) -> list[torch.Tensor]:
        stream = make_data(text_spec, me=me, seed=seed).train_stream(lambda: [b"x"])
        return [stream.next()[0] for _ in range(3)]

    assert all(map(torch.equal, batches(b"me", 3), batches(b"me", 3)))
    assert not all(map(torch.equal, batches(b"me", 3), batches(b"me", 4)))


def test_more_learners_than_shards_share_a_preferred_shard(
    make_data: Callable[..., RecipeData],
    store: Store,
    texts: list[bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="node.workload.token_data")
    spec = DataSpec(files=(store.put(texts[3]),), validation=(store.put(texts[4]),), shards=2)
    learners = [bytes([i]) * 4 for i in range(12)]
    me = next(m for m in learners if not deal_all(2, learners)[m])
    stream = make_data(spec, me=me).train_stream(lambda: learners)
    stream.next()
    assert stream.dealt == ()
    assert any("sharing shard" in r.message for r in caplog.records)


def test_jsonl_records_are_read_by_their_text_field(
    make_data: Callable[..., RecipeData], store: Store, tokenizer_file: Path, texts: list[bytes]
) -> None:
    docs = [t.decode() for t in texts[:12]]
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    train = store.put(("\n".join(lines[:10]) + "\n").encode())
    valid = store.put(("\n".join(lines[10:]) + "\n").encode())
    spec = DataSpec(format="jsonl", files=(train,), validation=(valid,), shards=4)
    data = make_data(spec)
    decoded = "".join(decode_without_eot(tokenizer_file, data.shard_tokens(s)) for s in range(4))
    assert decoded == "".join(docs[:10])
    assert decode_without_eot(tokenizer_file, data.validation) == "".join(docs[10:])


@pytest.mark.parametrize(
    "body, match",
    [
        (b'{"text": "ok"}\nnot json\n', "not a JSON line"),
        (b'{"text": "ok"}\n{"body": "x"}\n', 'no string field "text"'),
        (b'["text"]\n', 'no string field "text"'),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "not a JSON line"),
    ],
)
def test_a_bad_json_line_is_one_line_error(
    make_data: Callable[..., RecipeData], store: Store, body: bytes, match: str
) -> None:
    spec = DataSpec(
        format="jsonl", files=(store.put(b'{"text": "x"}\n'),), validation=(store.put(body),)
    )
    with pytest.raises(DataError, match=match) as e:
        make_data(spec)
    assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# mistakes before training


def test_a_missing_or_altered_artifact_is_refused(
    make_data: Callable[..., RecipeData], text_spec: DataSpec, store: Store
) -> None:
    path = store.path(text_spec.files[1])
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(DataError, match="does not hash to"):
        make_data(text_spec)
    path.unlink()
    with pytest.raises(DataError, match="fetch the recipe's artifacts"):
        make_data(text_spec)


def test_too_little_validation_text_is_refused(
    make_data: Callable[..., RecipeData], store: Store, texts: list[bytes]
) -> None:
    spec = DataSpec(files=(store.put(texts[0]),), validation=(store.put(b"tiny\n"),), shards=2)
    with pytest.raises(DataError, match="fewer than one window"):
        make_data(spec)


def test_a_bad_tokenizer_file_is_refused(
    make_data: Callable[..., RecipeData], text_spec: DataSpec, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="not a tokenizers JSON"):
        make_data(text_spec, tokenizer_file=bad)
    with pytest.raises(DataError, match="cannot be read"):
        make_data(text_spec, tokenizer_file=tmp_path / "absent.json")


def test_a_vocabulary_over_65535_is_stored_as_uint32(
    make_data: Callable[..., RecipeData], store: Store, tmp_path: Path
) -> None:
    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "big.json"
    tok.save(str(path))
    text = " ".join(words[65_000:69_000]).encode()
    spec = DataSpec(files=(store.put(text),), validation=(store.put(text),), shards=2)
    data = make_data(spec, tokenizer_file=path)
    assert data.vocab_size == 70_000 and data.validation.dtype.itemsize == 4
    assert int(data.validation.max()) == 68_999


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets installed")
def test_source_hf_without_datasets_says_what_to_install(
    make_data: Callable[..., RecipeData], store: Store, texts: list[bytes]
) -> None:
    spec = DataSpec(source="hf", hf_name="user/corpus", validation=(store.put(texts[0]),))
    with pytest.raises(DataError, match="pip install datasets") as e:
        make_data(spec)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text", ["", "no line end", "a\nb\n", ("x" * 50 + "\n") * 5000, "y" * 200_000 + "\nz"]
)
def test_line_pieces_cut_after_line_ends_and_lose_nothing(text: str) -> None:
    pieces = _line_pieces(text, size=1000)
    assert "".join(pieces) == text and pieces
    for piece in pieces[:-1]:
        assert piece.endswith("\n") and len(piece) > 1000


def test_a_stream_keeps_few_shards_open(
    make_data: Callable[..., RecipeData],
    text_spec: DataSpec,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(token_data, "MAX_OPEN_SHARDS", 2)
    data = make_data(text_spec, batch_size=16)
    stream = data.train_stream(lambda: [b"me"])  # alone: all 12 shards dealt
    mine = set().union(*(_windows_of(data.shard_tokens(s), 33) for s in range(12)))
    for _ in range(4):
        x, y = stream.next()
        assert len(stream._maps) <= 2
        for row in torch.cat([x, y[:, -1:]], dim=1):
            assert row.numpy().tobytes() in mine
    assert stream.dealt == tuple(range(12))


def test_too_many_shards_for_the_lines_are_logged_and_borrowed_around(
    make_data: Callable[..., RecipeData],
    store: Store,
    texts: list[bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="node.workload.token_data")
    one_line = store.put(b"x = 1 " * 2000 + b"\n")
    spec = DataSpec(files=(one_line,), validation=(store.put(texts[1]),), shards=8)
    data = make_data(spec)
    assert any("7 of 8 shards are empty" in r.message for r in caplog.records)
    assert [data.shard_size(s) for s in range(8)].count(0) == 7
    learners = [b"me", b"you"]
    stream = data.train_stream(lambda: learners)
    x, _ = stream.next()  # dealt empty shards or not, the stream finds the one with windows
    assert x.shape == (4, 32)


def test_a_learner_whose_shards_are_too_short_borrows_one(
    make_data: Callable[..., RecipeData],
    store: Store,
    texts: list[bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # two lines: the first (most bytes, few tokens: one long run of spaces) is shard 0 alone
    code = b" ".join(t.replace(b"\n", b" ") for t in texts[5:8])[:20_000]
    train = store.put(b" " * 30_000 + b"\n" + code + b"\n")
    spec = DataSpec(files=(train,), validation=(store.put(b"".join(texts[:12])),), shards=2)
    sizes = [make_data(spec).shard_size(s) for s in range(2)]
    assert sizes[0] + 2 < sizes[1]
    me, other = next(
        (bytes([i]), bytes([i + 100]))
        for i in range(100)
        if deal(2, [bytes([i]), bytes([i + 100])], bytes([i])) == (0,)
    )
    caplog.set_level(logging.INFO, logger="node.workload.token_data")
    data = make_data(spec, me=me, seq_len=sizes[0])  # shard 0 holds no window of seq_len + 1
    stream = data.train_stream(lambda: [me, other])
    x, _ = stream.next()
    assert stream.dealt == (0,) and x.shape == (4, sizes[0])
    assert any("no window" in r.message and "sharing shard 1" in r.message for r in caplog.records)


def test_lines_longer_than_a_block_are_cut_between_characters(
    make_data: Callable[..., RecipeData], store: Store, tokenizer_file: Path, texts: list[bytes]
) -> None:
    # one 2.2 MB line of 1- to 4-byte characters: the shard cut (no line end within 1 MiB of
    # the middle) and the 1 MiB blocks fall inside it, each moved to a character's start
    line = "aé€𝄞 " * 200_000
    spec = DataSpec(files=(store.put(line.encode()),), validation=(store.put(texts[2]),), shards=2)
    data = make_data(spec)
    decoded = [decode_without_eot(tokenizer_file, data.shard_tokens(s)) for s in range(2)]
    assert all(decoded) and "\ufffd" not in "".join(decoded)
    assert "".join(decoded) == line


@pytest.mark.timeout(300)  # two fresh interpreters import torch on a shared box
def test_two_processes_filling_one_cache_leave_it_whole(
    text_spec: DataSpec, store: Store, tokenizer_file: Path, tmp_path: Path
) -> None:
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from node.workload.token_data import DataSpec, RecipeData, RecipeFiles\n"
        f"spec = DataSpec.from_table({text_spec.to_table()!r})\n"
        f"files = RecipeFiles(Path({str(tokenizer_file)!r}), "
        f"lambda h: Path({str(store.root)!r}) / h, Path({str(tmp_path / 'shared')!r}))\n"
        "data = RecipeData(spec, files, seq_len=32, batch_size=4, "
        "me=sys.argv[1].encode(), seed=0)\n"
        "print(data.prepare())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, me], stdout=subprocess.PIPE, text=True, env=env
        )
        for me in ("a", "b")
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    shard_dir = next(d for d in (tmp_path / "shared").iterdir() if (d / "shard-00000.tok").exists())
    files = sorted(shard_dir.iterdir())
    assert [f.name for f in files] == [f"shard-{s:05d}.tok" for s in range(12)]  # no .tmp left
    total = sum(read_token_file(f, dtype=np.dtype(np.uint16)).size for f in files)
    assert str(total) == outs[0]
