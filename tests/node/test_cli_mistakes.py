"""Each common command-line mistake, run as a real ``python -m node`` process: a non-zero exit and
a short message on stderr that names the problem, never a traceback.

The swarm (keys, two manifests) is made with ``atoll keygen`` / ``atoll swarm init``; one
bootstrap node of swarm s1 listens on 127.0.0.1 for the mistakes that need a live peer.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.swarms import ENV, ROOT, Proc, admin

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

COMMAND_TIMEOUT_S = 120.0  # a mistake is found before any training: seconds, even on a busy machine


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Keys, manifests of swarms s1 and s2, and a live bootstrap node of s1 (its URL)."""
    folder = tmp_path_factory.mktemp("swarm")
    for name in ("f1", "f2", "boot", "peer"):
        admin("keygen", "--out", str(folder / f"{name}.key"))
    for name, founder in (("s1", "f1"), ("s2", "f2")):
        admin(
            "swarm",
            "init",
            "--name",
            name,
            "--founder",
            str(folder / f"{founder}.key"),
            "--model",
            "tiny",
            "--out",
            str(folder / f"{name}.toml"),
        )
    boot = Proc(
        [
            "bootstrap",
            "--listen",
            "127.0.0.1:0",
            "--manifest",
            str(folder / "s1.toml"),
            "--key",
            str(folder / "boot.key"),
        ],
        folder / "boot.log",
    )
    try:
        first = boot.lines.get(timeout=90)
        assert "listening at" in first, first
        yield {
            "url": first.rsplit(" ", 1)[-1],
            "s1": str(folder / "s1.toml"),
            "s2": str(folder / "s2.toml"),
            "key": str(folder / "peer.key"),
            "folder": str(folder),
        }
    finally:
        boot.stop()


def mistake(*args: str) -> str:
    """Run ``atoll ARGS``; check it failed in a few lines without a traceback; return stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "node", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    err = out.stderr.strip()
    assert out.returncode != 0, (out.stdout, err)
    assert "Traceback" not in err and "Exception" not in err, err
    assert 1 <= len(err.splitlines()) <= 3, err
    return err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join(swarm: dict[str, str], *extra: str, manifest: str = "s1") -> list[str]:
    return [
        "join",
        "--initial-peers",
        swarm["url"],
        "--manifest",
        swarm[manifest],
        "--key",
        swarm["key"],
        "--listen",
        "127.0.0.1:0",
        *extra,
    ]


def test_local_corpus_that_does_not_exist() -> None:
    err = mistake("local", "--corpus", "/no/such/path", "--model", "tiny")
    assert err == (
        "atoll local: corpus path /no/such/path does not exist: pass a text file, a folder of text "
        "files, or no corpus path to train on the Python standard library"
    )


def test_local_corpus_too_short_for_the_model(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("hello\n")
    err = mistake("local", "--corpus", str(tmp_path / "short.txt"), "--model", "tiny")
    assert "short.txt" in err and "too small" in err and "pass a longer text" in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["local", "--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["local", "--peers", "0"], "--peers must be >= 1, got 0"),
        (["local", "--model", "huge"], "unknown model preset 'huge'"),
        (
            ["local", "--eval-every", "0", "--threads", "0"],
            "--threads must be 1..{cores} (the cores of this machine), got 0; "
            "--eval-every must be >= 1",
        ),
        (
            ["local", "--threads", "100000"],
            "--threads must be 1..{cores} (the cores of this machine), got 100000",
        ),
        (
            ["local", "--peers", "100000"],
            "--peers must be at most 256 for atoll local, which starts every peer as a "
            "process on this machine, got 100000",
        ),
        (["local", "--adopt-alpha", "0.5"], "to blend, add --adopt-rebase 0"),
        (["local", "--adopt-rebase", "2"], "--adopt-rebase must be 0 or 1, got 2"),
        (["local", "--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
        (["local", "--seed", "4294967296"], "--seed must be in 0..4294967295, got 4294967296"),
        (
            ["local", "--sharding", "random"],
            "--sharding must be one of contiguous, striped; got 'random'",
        ),
    ],
)
def test_local_bad_flag_values(args: list[str], says: str) -> None:
    assert says.format(cores=os.cpu_count() or 1) in mistake(*args)


def test_join_unreachable_initial_peer(swarm: dict[str, str]) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    err = mistake(
        "join",
        "--initial-peers",
        dead,
        "--manifest",
        swarm["s1"],
        "--key",
        swarm["key"],
        "--listen",
        "127.0.0.1:0",
    )
    assert err == (
        f"atoll join: no initial peer answered: {dead} (connection refused); check --initial-peers "
        "and that those peers are running"
    )


def test_join_port_in_use(swarm: dict[str, str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = mistake(*join(swarm, "--listen", f"127.0.0.1:{port}"))
    assert f"port {port} is in use" in err and "--listen" in err


def test_join_wrong_swarm_manifest(swarm: dict[str, str]) -> None:
    err = mistake(*join(swarm, manifest="s2"))
    assert f"{swarm['url']} is a peer of swarm 's1'" in err and "not of swarm 's2'" in err


def test_join_wrong_swarm_id(swarm: dict[str, str]) -> None:
    err = mistake(
        "join", "--initial-peers", swarm["url"], "--swarm", "0" * 32, "--key", swarm["key"]
    )
    assert "is a peer of swarm 's1'" in err and f"not of swarm {'0' * 32} that --swarm names" in err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--corpus", "/no/such/path"], "corpus path /no/such/path does not exist"),
        (["--threads", "0"], "--threads must be 1..{cores} (the cores of this machine), got 0"),
        (["--steps", "-"], "argument --steps: invalid int value"),
        (["--listen", "localhost"], "--listen 'localhost' is not HOST:PORT"),
    ],
)
def test_join_bad_flags(swarm: dict[str, str], extra: list[str], says: str) -> None:
    assert says.format(cores=os.cpu_count() or 1) in mistake(*join(swarm, *extra))


def test_join_bad_files_and_addresses(swarm: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("not a manifest\n")
    cases = {  # independent processes: run at once
        "no key at /no/such.key; make one with atoll keygen": (
            "join",
            "--initial-peers",
            swarm["url"],
            "--manifest",
            swarm["s1"],
            "--key",
            "/no/such.key",
        ),
        "manifest is not valid TOML": (
            "join",
            "--initial-peers",
            swarm["url"],
            "--manifest",
            str(tmp_path / "bad.toml"),
            "--key",
            swarm["key"],
        ),
        "'127.0.0.1:7000' is not a peer's address": (
            "join",
            "--initial-peers",
            "127.0.0.1:7000",
            "--manifest",
            swarm["s1"],
            "--key",
            swarm["key"],
        ),
    }
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        errors = dict(
            zip(cases, pool.map(lambda args: mistake(*args), cases.values()), strict=True)
        )
    for expected, err in errors.items():
        assert expected in err, err


def test_status_of_a_peer_that_is_not_there() -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    err = mistake("status", "--peer", dead)
    assert (
        err
        == f"atoll status: {dead} did not answer (connection refused); check --peer and that the peer is running"
    )
