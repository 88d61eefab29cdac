"""A user's mistake or a hostile peer's bad answer is one line on stderr and a non-zero exit: never
a traceback, never a hang. The hostile peer is a small HTTP server on 127.0.0.1 (port 0) in a
thread, answering ``/v1/status`` and the manifest with the wrong shape, or a byte at a time."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from node.cli import main
from node.config import RunConfig
from node.run import join
from node.run.join import SlowAnswer, SwarmError, fetch_manifest, http_fetch
from protocol.wire.signing import Signer

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 0.5  # the tests' deadline for a whole answer; the trickle sends a byte every 20 ms


class _Peer(ThreadingHTTPServer):
    daemon_threads = True
    body = b""
    trickle = False
    stopping: threading.Event


class _Handler(BaseHTTPRequestHandler):
    server: _Peer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header(
            "Content-Length", str(1 << 20 if self.server.trickle else len(self.server.body))
        )
        self.end_headers()
        if not self.server.trickle:
            self.wfile.write(self.server.body)
            return
        with contextlib.suppress(OSError):  # the client hung up: done
            while not self.server.stopping.is_set():
                self.wfile.write(b" ")
                self.wfile.flush()
                self.server.stopping.wait(0.02)  # the trickle's pace, not a synchronisation

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.do_GET()

    def log_message(self, *_args: object) -> None:
        pass


@contextlib.contextmanager
def peer(body: bytes = b"", *, trickle: bool = False) -> Iterator[str]:
    server = _Peer(("127.0.0.1", 0), _Handler)
    server.body, server.trickle, server.stopping = body, trickle, threading.Event()
    # shutdown() waits for serve_forever's next poll: its default half second, paid per test
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join()


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int) -> str:
    """Run ``atoll ARGV``: it must exit ``code`` with one line on stderr and no traceback."""
    got = main(argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err.strip()


# --- atoll local: the swarm name and float flags -----------------------------------------------
@pytest.mark.parametrize("name", ["bad name", ""])
def test_a_swarm_name_the_manifest_refuses_is_one_line(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    err = one_line(
        capsys, ["local", "--model", "tiny", "--peers", "1", "--steps", "5", "--swarm", name], 2
    )
    assert err == (
        "atoll local: --swarm must be 1-64 letters, digits, '.', '_' or '-', starting with a letter "
        f"or digit; got {name!r}"
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--lr", "inf"),
        ("--weight-decay", "inf"),
        ("--grace-cap-s", "inf"),
        ("--duration", "inf"),
        ("--slow", "0@inf"),
    ],
)
def test_a_float_flag_of_inf_is_refused(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    err = one_line(
        capsys, ["local", "--model", "tiny", "--peers", "1", "--steps", "5", flag, value], 2
    )
    assert err.startswith("atoll local: ") and flag in err, err


@pytest.mark.parametrize("value", ["0", "4"])
def test_may_own_outside_the_peers_is_refused(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """``atoll local --may-own N``: only peers 0..N-1 may own, so N is 1..--peers."""
    err = one_line(capsys, ["local", "--model", "tiny", "--peers", "3", "--may-own", value], 2)
    assert err == f"atoll local: --may-own must be 1..3, got {value}", err


# --- atoll peer --config -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read it: Is a directory"),
        (b"\xde\xad\xbe\xef\x00\xff", "not a text file"),
        (b"[1, 2, 3]", "a JSON list, not an object of config fields"),
        (b"{not json", "not JSON"),
        (b'{"peers": 2, "pears": 3}', "unknown config keys ['pears']"),
        (b'{"peers": "two"}', "peers = 'two' should be int"),
        (b'{"lr": true}', "lr = True should be float"),
    ],
)
def test_a_peer_config_that_is_not_one_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, says: str
) -> None:
    path = tmp_path / "config.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    err = one_line(capsys, ["peer", "--config", str(path), "--index", "0"], 2)
    assert err.startswith(f"atoll peer: --config {path}: ") and says in err, err


def test_a_config_written_by_atoll_local_still_loads(tmp_path: Path) -> None:
    cfg = RunConfig(peers=4, model="tiny", corpus="/x", outer_lr=0.7, corpus_max_bytes=None)
    (tmp_path / "c.json").write_text(cfg.to_json())
    assert RunConfig.load(tmp_path / "c.json") == cfg
    assert RunConfig.from_json('{"outer_lr": 1}').outer_lr == 1  # an int where a float goes


# --- atoll status: a status of the wrong shape -------------------------------------------------
@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[1,2,3]", "an array, not an object"),
        (b"null", "null, not an object"),
        (b'"x"', "a string, not an object"),
        (b"5", "a number, not an object"),
        (b"<html>hi</html>", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b'{"members": "abc"}', "members is a string, not an array"),
        (b'{"members": [1, 2]}', "members[0] is a number, not an object"),
        (b'{"members": [{"peer_id": Infinity}]}', "members[0].peer_id is a number, not a string"),
        (
            b'{"swarm": NaN, "members": [{"peer_id": "ab", "roles": [1]}]}',
            "members[0].roles is not an array of strings",
        ),
        (b'{"owners": {"0": {"peer_id": 5}}}', "owners[0] is neither null nor an object"),
        (b'{"owners": {"x": null}}', "owners has key 'x', not a fragment number"),
        (b'{"owners": 5}', "owners is a number, not an object"),
        (b'{"versions": "x"}', "versions is a string, not an array"),
        (b'{"remote_errors": {"a": "b"}}', "remote_errors.a is a string, not a number"),
        (b'{"bytes_sent": "lots"}', "bytes_sent is a string, not a number"),
        (b'{"admission": [1]}', "admission is an array, not an object"),
        (b'{"admission": {"refused": {"x": null}}}', "admission.refused.x is null, not a number"),
        (b'{"swarm": 1' + b"0" * 5000 + b"}", "not JSON"),
        (b"[" * 100000 + b"]" * 100000, "JSON nested too deeply"),
    ],
)
def test_a_status_that_is_not_atolls_is_one_line(
    capsys: pytest.CaptureFixture[str], body: bytes, says: str
) -> None:
    with peer(body) as url:
        for extra in ([], ["--json"]):
            err = one_line(capsys, ["status", "--peer", url, *extra], 1)
            assert err.startswith(
                f"atoll status: {url}/v1/status answered a status that is not Atoll's: "
            ), err
            assert says in err, err


def test_a_status_of_the_right_shape_is_drawn(capsys: pytest.CaptureFixture[str]) -> None:
    status = {
        "swarm": "s",
        "peer_id": "ab" * 16,
        "url": "http://x",
        "members": [{"peer_id": "ab" * 16, "roles": []}],
        "owners": {"0": {"peer_id": "cd" * 16, "url": "http://y"}, "1": None},
        "versions": [3],
        "refused_members": {},
        "remote_errors": {"bad": 2},
        "bytes_sent": 5,
        "admission": None,
    }
    with peer(json.dumps(status).encode()) as url:
        assert main(["status", "--peer", url]) == 0
    out = capsys.readouterr().out
    assert "cdcdcdcdcdcd" in out and "remote errors 2" in out


# --- a peer that trickles its answer: every fetch has an overall deadline ----------------------
def test_a_trickled_answer_ends_at_the_deadline() -> None:
    with peer(trickle=True) as url:
        start = time.monotonic()
        with pytest.raises(SlowAnswer, match=f"no whole answer within {DEADLINE_S:g} s"):
            http_fetch(url + "/v1/status", timeout=DEADLINE_S)
        assert time.monotonic() - start < DEADLINE_S + 5  # not a byte a read: the whole answer


def test_status_of_a_trickling_peer_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(join, "STATUS_TIMEOUT_S", DEADLINE_S)
    with peer(trickle=True) as url:
        err = one_line(capsys, ["status", "--peer", url], 1)
    assert err == (
        f"atoll status: {url} did not answer (no whole answer within {DEADLINE_S:g} s); check --peer "
        "and that the peer is running"
    )


def test_join_through_a_trickling_peer_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(join, "MANIFEST_TIMEOUT_S", DEADLINE_S)
    with peer(trickle=True) as url, pytest.raises(SwarmError) as err:
        fetch_manifest(
            [url],
            swarm="ab" * 16,
            signer=Signer.from_seed(bytes(32)),
            cert=None,
            require_answer=True,
        )
    assert str(err.value) == (
        f"no initial peer answered: {url} (no whole answer within {DEADLINE_S:g} s); check "
        "--initial-peers and that those peers are running"
    )


def test_publish_to_a_trickling_peer_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from node.run import admin

    assert main(["keygen", "--out", str(tmp_path / "f.pem")]) == 0
    assert (
        main(
            [
                "swarm",
                "init",
                "--name",
                "s",
                "--founder",
                str(tmp_path / "f.pem"),
                "--model",
                "tiny",
                "--out",
                str(tmp_path / "s.toml"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    monkeypatch.setattr(admin, "PUBLISH_TIMEOUT_S", DEADLINE_S)
    with peer(trickle=True) as url:
        err = one_line(
            capsys,
            [
                "swarm",
                "publish",
                str(tmp_path / "s.toml"),
                "--peer",
                url,
                "--founder",
                str(tmp_path / "f.pem"),
            ],
            1,
        )
    assert err == f"atoll swarm publish: {url} did not answer within {DEADLINE_S:.0f} s"
