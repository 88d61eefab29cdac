"""What a person sees of a peer: the progress line, the milestones, JSON logs, status tables."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest

from node.run.console import JoinView, JsonFormatter, ProgressLine, render_status, setup_logging

PROGRESS = {
    "index": 0,
    "step": 120,
    "loss": 2.34567,
    "versions": [4, 4, 3, 4],
    "bytes_sent": 2_500_000,
    "bytes_received": 1_200_000,
    "peers": 3,
}


def test_progress_line_rewrites_one_line_and_prints_above_it() -> None:
    out = io.StringIO()
    line = ProgressLine(out)
    line.show("step 1")
    line.show("step 2")
    line.above("a log record")
    line.close()
    assert out.getvalue() == ("\r\033[Kstep 1\r\033[Kstep 2\r\033[Ka log record\n\r\033[Kstep 2\n")


def test_join_view_shows_step_loss_versions_bytes_and_peers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = io.StringIO()
    view = JoinView(ProgressLine(out), json_events=False, steps=600)
    view("progress", **PROGRESS)
    assert out.getvalue().endswith(
        "step 120/600  loss 2.346  versions 4,4,3,4  sent 2.5 MB  received 1.2 MB  peers 3"
    )
    view("ready", index=0)  # not for people
    view("joined", index=0, versions=[4, 4, 3, 4], synced=[0, 1, 2, 3])
    assert (
        "\r\033[Kjoined: 4 fragments synced from their owners, versions 4,4,3,4; training\n"
        in out.getvalue()
    )
    assert capsys.readouterr().out == ""  # no JSON events on a terminal


def test_join_view_keeps_the_json_events_for_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    view = JoinView(None, json_events=True, steps=600)
    view("progress", **PROGRESS)
    view("listening", index=0, url="http://127.0.0.1:7000", peer_id="ab" * 32)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == [
        {"event": "progress", **PROGRESS},
        {"event": "listening", "index": 0, "url": "http://127.0.0.1:7000", "peer_id": "ab" * 32},
    ]


def test_json_logs_one_object_per_record_with_extra_fields() -> None:
    out = io.StringIO()
    setup_logging("INFO", out, json_logs=True)
    try:
        logging.getLogger("atoll.test").warning("merged %d contributions", 3, extra={"fragment": 2})
        logging.getLogger("atoll.test").debug("not shown at INFO")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("atoll.test").exception("failed")
    finally:
        setup_logging("WARNING", io.StringIO())
    first, second = (json.loads(x) for x in out.getvalue().splitlines())
    assert set(first) == {"time", "level", "logger", "message", "fragment"}
    assert (first["level"], first["logger"], first["message"], first["fragment"]) == (
        "WARNING",
        "atoll.test",
        "merged 3 contributions",
        2,
    )
    assert first["time"].endswith("+00:00")
    assert second["message"] == "failed" and "ValueError: boom" in second["exception"]


def test_json_formatter_never_fails_on_odd_extras() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
    record.path = object()
    assert json.loads(JsonFormatter().format(record))["path"].startswith("<object")


def _status() -> dict[str, Any]:
    me, other = "a" * 64, "b" * 64
    return {
        "swarm": "s",
        "peer_id": me,
        "url": "http://127.0.0.1:7001",
        "reachable": True,
        "learning": True,
        "step": 362,
        "members": [
            {
                "peer_id": other,
                "url": "http://127.0.0.1:7002",
                "roles": ["learner"],
                "lab": None,
                "certified_roles": [],
                "reachable": False,
                "learning": True,
                "step": 225,
            },
            {
                "peer_id": me,
                "url": "http://127.0.0.1:7001",
                "roles": ["learner", "owner"],
                "lab": "lab-a",
                "certified_roles": ["learner", "owner"],
                "reachable": True,
                "learning": True,
                "step": 323,
            },
        ],
        "refused_members": {},
        "admission": {
            "id": "f" * 32,
            "name": "two-labs",
            "version": 2,
            "admission": "open",
            "admitted": 189,
            "refused": {"expired": 2},
        },
        "owners": {"0": {"peer_id": me, "url": "http://127.0.0.1:7001"}, "1": None},
        "versions": [20, 13],
        "owned": {"0": 21},
        "bytes_sent": 9_900_000,
        "bytes_received": 8_300_000,
        "remote_errors": {"stale": 1},
        "version_jumps_refused": 0,
    }


def test_status_tables() -> None:
    text = render_status(_status())
    lines = text.splitlines()
    assert (
        lines[0]
        == f"peer {'a' * 12} at http://127.0.0.1:7001; swarm 'two-labs' ({'f' * 32}), open, manifest v2"
    )
    assert lines[1] == "step 362, learning, reachable"
    header = next(i for i, x in enumerate(lines) if x.startswith("MEMBER"))
    assert lines[header].split() == [
        "MEMBER",
        "URL",
        "LAB",
        "ROLES",
        "REACHABLE",
        "LEARNING",
        "STEP",
    ]
    assert lines[header + 1].split() == [
        "a" * 12 + "*",
        "http://127.0.0.1:7001",
        "lab-a",
        "learner,owner",
        "yes",
        "yes",
        "323",
    ]
    assert lines[header + 2].split() == [
        "b" * 12,
        "http://127.0.0.1:7002",
        "-",
        "learner",
        "no",
        "yes",
        "225",
    ]
    frag = next(i for i, x in enumerate(lines) if x.startswith("FRAGMENT"))
    assert lines[frag + 1].split() == ["0", "20", "a" * 12 + "*", "http://127.0.0.1:7001"]
    assert lines[frag + 2].split() == ["1", "13", "(none)", "-"]
    assert "bytes sent 9.9 MB, received 8.3 MB; members 2, refused 0; remote errors 1" in text
    assert "requests admitted 189, refused 2 (expired: 2)" in text


def test_status_of_a_bootstrap_node() -> None:
    text = render_status(
        {
            "role": "bootstrap",
            "peer_id": "c" * 64,
            "url": "http://127.0.0.1:7000",
            "dht_contacts": 4,
            "dht_keys": 9,
            "admission": None,
        }
    )
    assert text.splitlines() == [
        f"bootstrap node {'c' * 12} at http://127.0.0.1:7000; no swarm manifest (DHT only)",
        "DHT contacts 4, keys 9",
    ]
