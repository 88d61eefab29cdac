"""Checkpoints: bit-exact round trips, refusal of every kind of damage, crash and kill -9 safety."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from node.state.checkpoint import (
    FORMAT_VERSION,
    Checkpointer,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bits (so NaN payloads and -0.0 count)."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert _bytes(got[name]) == _bytes(t), name


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f64": torch.randn(3, 5, dtype=torch.float64, generator=g),
        "f32": torch.tensor([0.0, -0.0, 1e-45, 3.4e38, -1.5]),  # signed zero and a subnormal
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(4, 3, generator=g).bfloat16(),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "i32": torch.arange(-5, 6, dtype=torch.int32),
        "i16": torch.tensor([[-7]], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous on the way in
        "grad": torch.randn(2, generator=g).requires_grad_(),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["f8"] = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    return out


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "state.safetensors"


# ----------------------------------------------------------------------------- round trips


def test_round_trip_is_bit_exact_for_every_dtype(ckpt: Path) -> None:
    tensors = mixed()
    meta = {"step": 12, "versions": {"frag-0": [3, "ab" * 32]}, "name": "île ✓", "lr": 0.1}
    save_checkpoint(ckpt, tensors, meta)
    got, got_meta = load_checkpoint(ckpt)
    assert_same(got, tensors)
    assert got_meta == meta
    got["f32"].add_(1)  # loaded tensors are the caller's to change; the file is not touched
    assert_same(load_checkpoint(ckpt)[0], tensors)


def test_any_safetensors_reader_sees_the_tensors_and_our_record(ckpt: Path) -> None:
    tensors = {k: v for k, v in mixed().items() if k != "f8"}
    save_checkpoint(ckpt, tensors, {"step": 1}, now=0.0)
    assert_same(load_file(ckpt), tensors)
    (n,) = struct.unpack("<Q", ckpt.read_bytes()[:8])
    assert n % 8 == 0
    record = json.loads(ckpt.read_bytes()[8 : 8 + n])["__metadata__"]
    assert record["atoll_format"] == str(FORMAT_VERSION)
    assert record["atoll_created"] == "1970-01-01T00:00:00+00:00"
    assert json.loads(record["atoll_meta"]) == {"step": 1}
    assert len(record["atoll_sha256"]) == 64


def test_no_tensors_at_all(ckpt: Path) -> None:
    save_checkpoint(ckpt, {}, {"fresh": True})
    assert load_checkpoint(ckpt) == ({}, {"fresh": True})


def test_never_pickles(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used")

    for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    save_checkpoint(ckpt, mixed(), {"step": 0})
    assert_same(load_checkpoint(ckpt)[0], mixed())


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]  # fmt: skip


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text(min_size=1, max_size=12).filter(lambda s: s != "__metadata__"),
                          max_size=6, unique=True))  # fmt: skip
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = bytearray(draw(st.binary(min_size=size, max_size=size)))
        if dtype == torch.bool:
            raw = bytearray(b % 2 for b in raw)
        flat = torch.frombuffer(raw, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(shape).clone()  # random bytes: NaN and Inf included
    return out


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=tensor_dicts(), meta=st.dictionaries(st.text(max_size=8), JSON, max_size=4))
def test_random_tensor_dicts_round_trip(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.safetensors"
        save_checkpoint(path, tensors, meta)
        got, got_meta = load_checkpoint(path, allow_nonfinite=True)
        assert_same(got, tensors)
        assert got_meta == meta
        assert os.listdir(folder) == ["c.safetensors"]


# ----------------------------------------------------------------------------- damage is refused


def big() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g).bfloat16()}


@pytest.mark.parametrize(
    "tensors", [big(), {"x": torch.ones(1)}], ids=["data-heavy", "header-heavy"]
)
def test_truncation_at_every_tenth_is_refused(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_checkpoint(ckpt, tensors, {"step": 5})
    whole = ckpt.read_bytes()
    for tenth in range(10):
        ckpt.write_bytes(whole[: len(whole) * tenth // 10])
        with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
            load_checkpoint(ckpt)
        assert "delete it to start fresh" in str(e.value) and "\n" not in str(e.value)


def test_every_flipped_byte_is_refused(ckpt: Path) -> None:
    tensors = {"a": torch.tensor([1.0, 2.0]), "i": torch.tensor([7], dtype=torch.int16)}
    save_checkpoint(ckpt, tensors, {"step": 3})
    whole = ckpt.read_bytes()
    for pos in range(len(whole)):
        for mask in (0x01, 0x80):
            damaged = bytearray(whole)
            damaged[pos] ^= mask
            ckpt.write_bytes(bytes(damaged))
            with pytest.raises(CheckpointError):
                load_checkpoint(ckpt)


def test_flipped_data_byte_is_a_hash_mismatch(ckpt: Path) -> None:
    save_checkpoint(ckpt, big(), {"step": 5})
    damaged = bytearray(ckpt.read_bytes())
    damaged[-1000] ^= 0x10
    ckpt.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"truncated or corrupt \(hash mismatch\); delete it"):
        load_checkpoint(ckpt)


def _rewrite_header(path: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    whole = path.read_bytes()
    assert whole.count(old) == 1
    path.write_bytes(whole.replace(old, new))


def test_other_format_version_is_named(ckpt: Path) -> None:
    save_checkpoint(ckpt, big(), {})
    _rewrite_header(ckpt, b'"atoll_format":"1"', b'"atoll_format":"7"')
    with pytest.raises(CheckpointError, match="incompatible format version 7"):
        load_checkpoint(ckpt)


def test_header_that_is_not_json_is_corrupt(ckpt: Path) -> None:
    save_checkpoint(ckpt, big(), {})
    _rewrite_header(ckpt, b'"atoll_format":"1"', b'"atoll_format":"1}')
    with pytest.raises(
        CheckpointError, match=r"truncated or corrupt \(the header is not valid JSON\)"
    ):
        load_checkpoint(ckpt)


def test_files_that_are_not_checkpoints(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "pickled.pt")
    (tmp_path / "notes.txt").write_text("hello, this is not a checkpoint at all\n")
    save_file({"w": torch.ones(3)}, tmp_path / "foreign.safetensors")
    for name in ("pickled.pt", "notes.txt", "foreign.safetensors", "."):
        with pytest.raises(CheckpointError, match="is not a checkpoint"):
            load_checkpoint(tmp_path / name)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent.safetensors")


def test_expected_shapes_and_dtypes(ckpt: Path) -> None:
    save_checkpoint(ckpt, big(), {})
    right = {"w": ((256, 256), torch.float32), "b": ((256,), torch.bfloat16)}
    assert_same(load_checkpoint(ckpt, expected=right)[0], big())
    cases = [
        ({**right, "m": ((2,), torch.float32)}, "is missing tensor 'm'"),
        (
            {**right, "w": ((256, 128), torch.float32)},
            r"tensor 'w' has shape \(256, 256\).*expected shape \(256, 128\)",
        ),
        (
            {**right, "b": ((256,), torch.float16)},
            "tensor 'b' .* dtype torch.bfloat16, expected .* torch.float16",
        ),
        ({"w": right["w"]}, "has unexpected tensor 'b'"),
    ]
    for expected, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(ckpt, expected=expected)


FLOATS = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
if hasattr(torch, "float8_e5m2"):
    FLOATS.append(torch.float8_e5m2)


@pytest.mark.parametrize("dtype", FLOATS)
def test_nonfinite_is_refused_unless_allowed(ckpt: Path, dtype: torch.dtype) -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.zeros(1_100_000, dtype=dtype)
        w[-1] = bad  # in the second 1 Mi slice that the check looks at
        save_checkpoint(ckpt, {"n": torch.arange(3), "w": w}, {})
        with pytest.raises(
            CheckpointError, match="tensor 'w' holds NaN or Inf.*allow_nonfinite=True"
        ):
            load_checkpoint(ckpt)
        assert_same(load_checkpoint(ckpt, allow_nonfinite=True)[0], {"n": torch.arange(3), "w": w})


def test_save_refuses_what_it_cannot_store_and_keeps_the_old_file(ckpt: Path) -> None:
    save_checkpoint(ckpt, big(), {"step": 1})
    bad = [
        ({"w": torch.ones(2)}, {"loss": float("nan")}, ValueError),
        ({"w": torch.ones(2)}, {"when": object()}, TypeError),
        ({"__metadata__": torch.ones(2)}, {}, ValueError),
        ({"c": torch.ones(2, dtype=torch.complex64)}, {}, TypeError),
        ({"s": torch.eye(2).to_sparse()}, {}, TypeError),
        ({"x": [1.0, 2.0]}, {}, TypeError),
    ]
    for tensors, meta, error in bad:
        with pytest.raises(error):
            save_checkpoint(ckpt, tensors, meta)  # type: ignore[arg-type]
    assert_same(load_checkpoint(ckpt)[0], big())
    assert os.listdir(ckpt.parent) == [ckpt.name]


# ----------------------------------------------------------------------------- crashes


@pytest.mark.parametrize("where", ["replace", "fsync"])
def test_crash_before_the_rename_leaves_the_old_checkpoint(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    save_checkpoint(ckpt, big(), {"step": 1})

    def crash(*args: object) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(os, where, crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(ckpt, {"w": torch.zeros(3)}, {"step": 2})
    monkeypatch.undo()
    tensors, meta = load_checkpoint(ckpt)
    assert meta == {"step": 1}
    assert_same(tensors, big())
    assert os.listdir(ckpt.parent) == [ckpt.name]  # nothing partial under any name


def test_a_killed_writers_temporary_file_is_cleaned_up(tmp_path: Path) -> None:
    (tmp_path / ".state.safetensors.999-abcd.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / ".step-000007.safetensors.999-abcd.tmp").write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path / "state.safetensors", big(), {})
    assert sorted(os.listdir(tmp_path)) == [
        ".step-000007.safetensors.999-abcd.tmp",
        "state.safetensors",
    ]
    Checkpointer(tmp_path)
    assert os.listdir(tmp_path) == ["state.safetensors"]


# ----------------------------------------------------------------------------- Checkpointer


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step)), "step": torch.tensor([step])}


def test_checkpointer_prunes_to_keep_and_returns_the_newest(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck", keep=2)
    assert ck.latest() is None
    for step in range(5):
        path = ck.save(step, state(step), {"step": step})
    assert path.name == "step-000004.safetensors"
    assert ck.steps() == [3, 4]
    latest = ck.latest()
    assert latest is not None
    assert latest[1] == {"step": 4}
    assert_same(latest[0], state(4))


def _damage(path: Path) -> None:
    damaged = bytearray(path.read_bytes())
    damaged[-3] ^= 0xFF
    path.write_bytes(bytes(damaged))


def test_latest_falls_back_past_corrupt_newer_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = Checkpointer(tmp_path, keep=3)
    for step in (1, 2, 3):
        ck.save(step, state(step), {"step": step})
    _damage(ck.path(3))
    ck.path(2).write_bytes(ck.path(2).read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="node.state.checkpoint"):
        latest = ck.latest()
    assert latest is not None and latest[1] == {"step": 1}
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 2
    assert "step 3" in skipped[0] and "hash mismatch" in skipped[0]
    assert "step 2" in skipped[1] and "truncated or corrupt" in skipped[1]
    _damage(ck.path(1))
    assert ck.latest() is None


def test_resuming_behind_a_corrupt_checkpoint_keeps_valid_ones(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, keep=2)
    for step in (4, 5, 6):
        ck.save(step, state(step), {"step": step})
    _damage(ck.path(6))
    latest = ck.latest()
    assert latest is not None and latest[1] == {"step": 5}
    ck.save(6, state(6), {"step": 6})  # the resumed run overwrites the corrupt one
    assert ck.steps() == [5, 6]
    assert ck.latest() is not None


def test_checkpointer_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(Path(tempfile.gettempdir()), keep=0)


SAVER = """
import os, sys, torch
from pathlib import Path
from node.state.checkpoint import Checkpointer
for _ in sys.stdin:  # one line per round: fork a saver that resumes from the latest checkpoint
    pid = os.fork()
    if pid == 0:
        try:
            ck = Checkpointer(Path(sys.argv[1]), keep=2)
            got = ck.latest()
            step = 0 if got is None else got[1]["step"] + 1
            while True:
                w, n = torch.full((1_000_000,), float(step)), torch.arange(step % 7)
                ck.save(step, {"w": w, "n": n}, {"step": step})
                print(step, flush=True)
                step += 1
        finally:
            os._exit(1)
    print("pid", pid, flush=True)
    print("reaped", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Lines:
    """Whole lines from a pipe, each wait bounded."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    # a hang guard: the first line comes after the saver imported torch, which took over 30 s
    # at load 56 on 2 cores
    def next(self, timeout: float = 120.0) -> str:
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            assert ready, "the saver went quiet"
            chunk = os.read(self.fd, 1 << 16)
            assert chunk, "the saver exited"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


@pytest.fixture
def saver(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``python -c SAVER``: imports torch once (the slow part) and forks one saver per round."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", SAVER, str(tmp_path)]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _kill_while_saving(proc: subprocess.Popen[bytes], lines: Lines, delay: float) -> None:
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    pid, saved = 0, False
    while not (pid and saved):  # its pid and its first saved step, in either order
        line = lines.next()
        pid, saved = (int(line[4:]), saved) if line.startswith("pid ") else (pid, True)
    time.sleep(delay)  # fault injection, not synchronisation: SIGKILL at a random moment
    os.kill(pid, signal.SIGKILL)
    while not (line := lines.next()).startswith("reaped"):
        pass
    assert line == f"reaped {-signal.SIGKILL}"


@pytest.mark.timeout(300)  # a hang guard sized as Lines.next is
def test_kill_9_while_saving_always_leaves_a_valid_checkpoint(
    tmp_path: Path, saver: subprocess.Popen[bytes]
) -> None:
    assert saver.stdout is not None
    lines, rng, previous = Lines(saver.stdout.fileno()), random.Random(10), -1
    for _ in range(5):
        _kill_while_saving(saver, lines, rng.uniform(0.0, 0.2))
        ck = Checkpointer(tmp_path, keep=2)  # also sweeps the killed writer's temporary file
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        for step in ck.steps():  # every file under a final name is whole, not just the newest
            load_checkpoint(ck.path(step))
        latest = ck.latest()
        assert latest is not None
        tensors, meta = latest
        assert meta["step"] >= previous  # the saver resumed from it and went on
        want = {
            "w": torch.full((1_000_000,), float(meta["step"])),
            "n": torch.arange(meta["step"] % 7),
        }
        assert_same(tensors, want)
        previous = meta["step"]


# ----------------------------------------------------------------------------- crafted files


def craft(path: Path, tensors: dict[str, torch.Tensor], meta_json: str) -> None:
    """A checkpoint whose meta record is ``meta_json`` as given (any text), with a valid digest:
    what someone who can write to the folder, or hand over a file, can make."""
    from node.state.checkpoint_save import PendingCheckpoint, _item

    items = sorted((_item(n, t) for n, t in tensors.items()), key=lambda it: (-it.width, it.name))
    # written in place (no rename): the writer's own steps, with meta_json as given
    PendingCheckpoint(path, path, items, "2026-01-01T00:00:00+00:00", meta_json)._complete()


def test_a_header_nested_past_the_parsers_recursion_is_refused_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A JSON header nested 100,000 deep raised ``RecursionError`` out of ``load_checkpoint``
    (not a ``CheckpointError``), so ``latest`` let it through and the peer failed to start."""
    ck = Checkpointer(tmp_path)
    ck.save(1, state(1), {"step": 1})
    raw = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    ck.path(2).write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load_checkpoint(ck.path(2))
    with caplog.at_level(logging.WARNING, logger="node.state.checkpoint"):
        latest = ck.latest()
    assert latest is not None and latest[1] == {"step": 1}
    assert "skipping checkpoint step 2" in caplog.text and "nested too deeply" in caplog.text


@pytest.mark.parametrize(
    "meta_json, why",
    [
        ("[" * 100_000 + "]" * 100_000, "the meta record is nested too deeply"),
        ('{"step": 1e99999}', "the meta record is not valid JSON"),  # parses to inf: refused
        ('{"step": NaN}', "the meta record is not valid JSON"),
        (
            '{"step": ' + "9" * 5000 + "}",
            "the meta record is not valid JSON",
        ),  # past the digit limit
        ("[1, 2]", "the meta record is a JSON list, not an object"),
    ],
)
def test_a_crafted_meta_record_with_a_valid_digest_is_refused(
    tmp_path: Path, meta_json: str, why: str
) -> None:
    path = tmp_path / "step-000001.safetensors"
    craft(path, state(1), meta_json)
    with pytest.raises(CheckpointError, match=why.replace("(", r"\(")):
        load_checkpoint(path)
    assert Checkpointer(tmp_path).latest() is None  # skipped, not raised


# ----------------------------------------------------------------------------- written in two parts


def test_tensors_written_at_begin_may_change_before_finish(tmp_path: Path) -> None:
    """``begin_checkpoint`` writes the tensors named ``write_now`` into the file at once (an
    island's model, which trains on while the rest is written): changing them afterwards does
    not change the checkpoint, which is the same file ``save_checkpoint`` writes."""
    from node.state.checkpoint_save import begin_checkpoint

    want = mixed()
    live = {n: t.detach().clone() for n, t in want.items()}
    early = ["f64", "f32", "u8", "transposed", "empty"]
    pending = begin_checkpoint(tmp_path / "a", live, {"step": 3}, now=0.0, write_now=early)
    for name in early:
        live[name].zero_()  # trained on meanwhile
    assert not (tmp_path / "a").exists()  # nothing under the final name until it is finished
    pending.finish()
    got, meta = load_checkpoint(tmp_path / "a")
    assert meta == {"step": 3}
    assert_same(got, {n: t.detach() for n, t in want.items()})
    save_checkpoint(tmp_path / "b", {n: t.detach() for n, t in want.items()}, {"step": 3}, now=0.0)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_a_begun_checkpoint_that_is_abandoned_leaves_nothing(tmp_path: Path) -> None:
    from node.state.checkpoint_save import begin_checkpoint

    ck = Checkpointer(tmp_path)
    ck.save(1, state(1), {"step": 1})
    pending = begin_checkpoint(ck.path(2), state(2), {"step": 2}, write_now=["w"])
    pending.abandon()
    assert ck.steps() == [1] and not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(ValueError, match="write_now names tensors"):
        begin_checkpoint(ck.path(2), state(2), {"step": 2}, write_now=["nope"])
    assert not list(tmp_path.glob(".*.tmp"))
