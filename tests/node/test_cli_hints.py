"""Every ``atoll ...`` command the CLI prints as a hint works as printed: each one parses with the
real parser, and where it is cheap it runs. ``atoll bootstrap``'s join line joins a certified
swarm through the live bootstrap node (the joiner's checks pass and it starts, before training);
``atoll swarm revoke``'s publish line hands the new manifest to that node, which tells an unsigned
post how to sign it. Placeholders in
capitals (``PATH``, ``KEY``, ``URL``) stand for what only the user knows."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from node.cli import _parser, main
from node.dht.bootstrap import join_hint
from node.dht.swarm import MANIFEST_PATH
from node.run.peer_http import http_fetch
from node.wire.identity import IdentityError, load_certificate, load_key, load_manifest
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer
from tests.integration.swarms import ENV, Proc, make_swarm

pytestmark = pytest.mark.timeout(120)

# a command: ``atoll`` and a sub-command, up to the end of the sentence (";", ")" or the line's end)
HINT = re.compile(
    r"atoll (?:keygen|swarm [a-z-]+|join|bootstrap|status|local|replay|simulate) [^;)\n]*"
)


def hints(text: str) -> list[str]:
    return [h.strip() for h in HINT.findall(text)]


def parsed(command: str) -> argparse.Namespace:
    """``command`` parsed by the real ``atoll`` parser (a usage mistake fails the test)."""
    argv = shlex.split(command)
    assert argv[0] == "atoll", command
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return _parser().parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"{command!r} does not parse: {err.getvalue().strip()}") from None


def run(command: str) -> tuple[int, str]:
    """``command`` run by ``atoll``'s ``main`` in this process: (exit status, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(shlex.split(command)[1:])
    return code, out.getvalue()


def test_the_join_hints_parse_for_every_kind_of_bootstrap_node() -> None:
    signer = Signer.from_seed(os.urandom(32))
    for admission in ("open", "certified"):
        m = SwarmManifest(name="s", founder=signer.public_key, admission=admission, created=1.0)
        text = join_hint("https://10.0.0.1:7000", m)
        commands = hints(text)
        assert len(commands) == 2, text  # the join, and the keygen that makes its key
        args = parsed(commands[0])
        assert args.swarm == m.swarm_id and args.initial_peers == ["https://10.0.0.1:7000"]
        assert (args.cert is not None) == (admission == "certified")
        assert parsed(commands[1]).out == Path("peer.key")
    commands = hints(join_hint("http://10.0.0.1:7000", None))
    assert parsed(commands[0]).manifest == Path("swarm.toml") and parsed(commands[1])


def test_the_bootstrap_join_line_joins_as_printed_and_the_revoke_line_publishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = make_swarm(
        tmp_path / "swarm",
        name="hints",
        admission="certified",
        labs=("lab-a",),
        recipe=["--model", "tiny", "--fragments", "2"],
    )
    files.certify("boot", lab="lab-a", roles="learner")
    boot = Proc(
        ["bootstrap", "--listen", "127.0.0.1:0", *files.args("boot")], tmp_path / "boot.log"
    )
    try:
        url = boot.wait_line("listening at", 30).rsplit(" ", 1)[-1]
        printed = boot.wait_line("join with:", 10) + "\n" + boot.wait_line("atoll keygen", 10)
        join, keygen = hints(printed)
        assert f"--initial-peers {url}" in join
        joiner = tmp_path / "joiner"
        joiner.mkdir()
        monkeypatch.chdir(joiner)
        assert run(keygen)[0] == 0  # the joiner makes its key as told
        files.keys["peer"] = joiner / "peer.key"
        certified = files.certify("peer", lab="lab-a")  # its lab's authority certifies it
        certified.rename(joiner / "peer.cert")
        parsed(join)
        started = subprocess.Popen(  # the join as printed: its checks pass and it starts
            [sys.executable, "-m", "node", *shlex.split(join)[1:]],
            cwd=joiner,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert started.stdout is not None
        banner = started.stdout.readline()  # printed once every check passed, before training
        started.kill()
        _, err = started.communicate(timeout=30)
        assert "atoll join: swarm 'hints'" in banner and "lab lab-a" in banner, banner + err

        code, out = run(
            f"atoll swarm revoke {files.manifest} --founder {files.key('founder')} "
            f"--peer {files.key('gone')}"
        )
        assert code == 0, out
        (publish,) = hints(out)
        parsed(publish)
        code, out = run(publish.replace("--peer URL", f"--peer {url}"))
        assert code == 0, out
        # a manifest posted without the founder's signature: the node says how to sign it
        status, reason = http_fetch(
            url + MANIFEST_PATH, method="POST", body=files.manifest.read_bytes(), timeout=10
        )
        assert status == 401
        (sign,) = hints(reason.decode())
        assert parsed(sign).swarm_command == "publish"
    finally:
        boot.stop()


def _messages(tmp_path: Path) -> list[str]:
    """What the identity loaders say when a key, a manifest or a certificate cannot be used."""
    missing = tmp_path / "none"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    other = tmp_path / "ec.pem"
    other.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    for path in (not_pem, encrypted, other):
        path.chmod(0o600)
    out = []
    for load, path in (
        (load_key, missing),
        (load_key, not_pem),
        (load_key, encrypted),
        (load_key, other),
        (load_manifest, missing),
        (load_certificate, missing),
    ):
        with pytest.raises(IdentityError) as exc:
            load(path)
        out.append(str(exc.value))
    return out


def test_the_identity_hints_parse_and_keygen_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages = _messages(tmp_path)
    commands = [h for m in messages for h in hints(m)]
    assert len(commands) == len(messages), messages  # each says how to make what is missing
    for command in commands:
        parsed(command)
    monkeypatch.chdir(tmp_path)
    for command in {c for c in commands if c.startswith("atoll keygen")}:
        made = command.replace("PATH", "made.key")
        assert run(made)[0] == 0, made
        Path(shlex.split(made)[-1]).unlink()
