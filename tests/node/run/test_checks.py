"""The checks ``atoll local`` and ``atoll join`` run before a peer starts: one line per mistake."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from node.cli import _one_line
from node.config import RunConfig
from node.run.checks import CheckError, check_listen, check_recipe, check_run, host_port, peer_url
from node.run.local import last_error

TEXT = "def f(x):\n    return x * 2\n" * 400  # ~11 kB of text


def test_numbers_model_device_and_link_are_all_named_at_once() -> None:
    cfg = RunConfig(
        model="huge", lr=0.0, eval_every=0, grace_gamma=-1.0, device="gpu9", link="speed=fast"
    )
    with pytest.raises(CheckError) as err:
        check_run(cfg)
    text = str(err.value)
    for says in (
        "--lr must be finite and > 0, got 0.0",
        "--eval-every must be >= 1, got 0",
        "--grace-gamma must be finite and >= 0, got -1.0",
        "--model: unknown model preset 'huge'",
        "--device 'gpu9' is not a device",
        "--link: bad link spec 'speed=fast'",
    ):
        assert says in text
    assert "\n" not in text
    # the outer step's fields a swarm recipe may set are refused by RunConfig itself, all at once too
    with pytest.raises(ValueError) as outer:
        RunConfig(outer_momentum=1.0, outer_lr=0.0)
    assert "--outer-momentum must be in [0, 1), got 1.0" in str(outer.value)
    assert "--outer-lr must be finite and > 0, got 0.0" in str(outer.value)


@pytest.mark.parametrize("name", ["bad name", "", "-x", "x" * 65, "a/b"])
def test_a_swarm_name_the_manifest_refuses_is_one_line(name: str) -> None:
    with pytest.raises(CheckError) as err:
        check_run(RunConfig(model="tiny", swarm=name))
    assert str(err.value).startswith("--swarm must be 1-64 letters, digits, '.', '_' or '-'"), (
        err.value
    )
    check_run(RunConfig(model="tiny", swarm="lab-2.run_1"))
    check_run(
        RunConfig(model="tiny", swarm="0123456789abcdef0123456789abcdef")
    )  # atoll join: the swarm id


@pytest.mark.parametrize("field", ["lr", "weight_decay", "grace_gamma", "grace_cap_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_float_flag_must_be_finite(field: str, value: float) -> None:
    with pytest.raises(CheckError, match=f"--{field.replace('_', '-')} must be finite"):
        check_run(RunConfig(model="tiny", **{field: value}))


def test_a_recipe_is_checked_as_every_peer_would() -> None:
    check_recipe(RunConfig(model="tiny"))
    with pytest.raises(CheckError) as err:
        check_recipe(
            RunConfig(model="tiny", block_size=0, batch_size=0, lr=float("inf"), threads=10**6)
        )
    # recipe fields only (the learners' schedule, --lr here, is in the recipe; --threads is not)
    assert str(err.value) == (
        "--batch-size must be >= 1, got 0; --lr must be finite and > 0, got inf; "
        "--block-size must be >= 1, got 0"
    )
    with pytest.raises(
        CheckError, match="--fragments 100000: 100000 fragments for only 29 tensors"
    ):
        check_recipe(RunConfig(model="tiny", fragments=100000))
    with pytest.raises(
        CheckError, match="--fragments 1: 1 fragment cannot keep 2 embedding tensors apart"
    ):
        check_recipe(RunConfig(model="tiny", fragments=1))


def test_corpus_checks(tmp_path: Path) -> None:
    check_run(RunConfig(model="tiny"))  # no --corpus: the standard library
    (tmp_path / "code.py").write_text(TEXT)
    check_run(RunConfig(model="tiny", corpus=str(tmp_path / "code.py")))
    check_run(RunConfig(model="tiny", corpus=str(tmp_path)))  # a folder of text files
    with pytest.raises(CheckError, match=r"corpus path .*nope does not exist: pass a text file"):
        check_run(RunConfig(corpus=str(tmp_path / "nope")))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(CheckError, match="corpus is empty: no text bytes found"):
        check_run(RunConfig(corpus=str(empty)))
    with pytest.raises(
        CheckError, match="fewer than a window of 257: use a bigger corpus or fewer shards"
    ):
        check_run(RunConfig(model="medium", peers=64, corpus=str(tmp_path / "code.py")))


def test_listen_checks() -> None:
    assert host_port("127.0.0.1:7000", "--listen") == ("127.0.0.1", 7000)
    assert host_port(":0", "--listen") == ("0.0.0.0", 0)
    for bad in ("localhost", "host:port", "1.2.3.4:70000"):
        with pytest.raises(CheckError, match="is not HOST:PORT"):
            host_port(bad, "--listen")
    check_listen("127.0.0.1", 0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            CheckError, match=f"port {port} is in use; pick another port, or 127.0.0.1:0"
        ):
            check_listen("127.0.0.1", port)
    with pytest.raises(CheckError, match="is not an address of this machine"):
        check_listen("no-such-host.invalid", 7000)


def test_peer_urls() -> None:
    for good in ("http://127.0.0.1:7000", "https://peer.example.org:443/", "http://[::1]:7000"):
        assert peer_url(good) == good
    for bad in (
        "127.0.0.1:7000",
        "http://127.0.0.1",
        "ftp://h:1",
        "http://h:1/v1/status",
        "http://h:x",
    ):
        with pytest.raises(CheckError, match="is not a peer's address: expected http"):
            peer_url(bad)


def _task_group_failure(exc: Exception) -> Exception:
    """What ``asyncio.TaskGroup`` raises when one of its tasks raises ``exc``: an exception group."""

    async def fail() -> None:
        raise exc

    async def run() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(fail())

    try:
        asyncio.run(run())
    except Exception as group:
        return group
    raise AssertionError("the task group did not fail")


def test_a_launchers_failure_is_its_first_peer_failure_in_one_line(tmp_path: Path) -> None:
    log = tmp_path / "peer0.log"
    log.write_text(
        '2026 atoll INFO starting\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "    raise FileNotFoundError(...)\nFileNotFoundError: corpus path /x does not exist\n"
    )
    assert last_error(log) == "FileNotFoundError: corpus path /x does not exist"
    group = _task_group_failure(
        RuntimeError(f"peer 0 exited before listening: {last_error(log)}\n(log: {log})")
    )
    assert _one_line(group) == f"peer 0 exited before listening: {last_error(log)} (log: {log})"
    assert _one_line(TimeoutError()).startswith("timed out waiting for the peers")
    with pytest.raises(KeyError):  # a bug keeps its traceback
        _one_line(_task_group_failure(KeyError("x")))
