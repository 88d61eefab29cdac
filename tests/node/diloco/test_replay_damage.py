"""A damaged or edited merger log is one line from ``atoll replay``: the log, the line number and
what is wrong there, and exit 1; never a traceback. A blob name that is a path is refused, not
read. (The log is a real owner's, from ``test_eventlog._run``, edited one record at a time.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node.cli import main
from node.diloco.eventlog import EmptyLog, LogError, payload_dir, replay
from tests.node.diloco.test_eventlog import _run

Edit = Callable[[list[Any]], None]


def _first(records: list[Any], kind: str) -> int:
    return next(i for i, r in enumerate(records) if isinstance(r, dict) and r.get("kind") == kind)


def _set(kind: str, key: str, value: object) -> Edit:
    return lambda rs: rs[_first(rs, kind)].__setitem__(key, value)


def _set_content(key: str, value: object) -> Edit:
    return lambda rs: rs[0]["content"].__setitem__(key, value)


EDITS: dict[str, tuple[Edit, str]] = {
    "line-is-array": (lambda rs: rs.insert(2, [1]), ":3: an array, not a merger log record"),
    "line-is-null": (lambda rs: rs.insert(2, None), ":3: null, not a merger log record"),
    "line-is-string": (lambda rs: rs.insert(2, "hello"), ":3: a string, not a merger log record"),
    "line-is-number": (lambda rs: rs.insert(2, 5), ":3: a number, not a merger log record"),
    "no-kind": (lambda rs: rs.insert(2, {"x": 1}), ":3: a record without a kind"),
    "unknown-kind": (lambda rs: rs.insert(2, {"kind": "bogus"}), ":3: unknown event 'bogus'"),
    "start-is-list": (lambda rs: rs.__setitem__(0, [1]), ":1: an array, not a merger log record"),
    "decision-list": (
        _set("contribution", "decision", []),
        "contribution record: decision is an array, not an object",
    ),
    "codec": (_set_content("codec", "bogus"), ":1: start record: content.codec must be one of"),
    "update-codec": (
        _set_content("update_codec", "bogus"),
        ":1: start record: content.update_codec must be null",
    ),
    "block-size": (
        _set_content("block_size", 0),
        ":1: start record: content.block_size must be an integer >= 1, got 0",
    ),
    "threads": (
        _set_content("threads", 0),
        ":1: start record: content.threads must be an integer in 1..1024, got 0",
    ),
    "shapes": (
        _set_content("shapes", [[-5, 3]]),
        ":1: start record: content.shapes is not a list of tensor shapes",
    ),
    "aggregate": (
        lambda rs: rs[0]["content"]["outer"].__setitem__("aggregate", "bogus"),
        ":1: start record: aggregate must be one of",
    ),
    "quorum": (
        lambda rs: rs[0]["config"].__setitem__("quorum", -1),
        ":1: start record: MergeConfig: quorum must be >= 1",
    ),
    "gamma": (
        lambda rs: rs[0]["config"].__setitem__("gamma", float("nan")),
        ":1: start record: MergeConfig: gamma must be in [0, 1]",
    ),
    "tokens": (
        _set("contribution", "tokens", -1),
        "contribution record: tokens must be an integer in 0..2**64-1, got -1",
    ),
    "base-version": (
        _set("contribution", "base_version", 10**30),
        "contribution record: base_version must be an integer",
    ),
    "norm": (
        _set("contribution", "norm", float("nan")),
        "contribution record: norm must be a finite number, got NaN",
    ),
    "peer": (
        _set("contribution", "peer", "zz"),
        "contribution record: peer must be a peer id in hex",
    ),
    "expect": (
        _set("expect", "n", -1),
        "expect record: n must be an integer in 0..2**64-1, got -1",
    ),
    "version": (
        _set("version", "version", "x"),
        'version record: version must be an integer in 0..2**64-1, got "x"',
    ),
    "blob-traversal": (
        _set("state", "blob", "../../secret.safetensors"),
        'state record: blob "../../secret.safetensors" is not a file name in the payload folder',
    ),
    "blob-absolute": (
        _set("state", "blob", "/etc/passwd"),
        'blob "/etc/passwd" is not a file name',
    ),
    "blob-dot": (_set("state", "blob", "."), 'blob "." is not a file name'),
    "blob-int": (_set("state", "blob", 5), "blob 5 is not a file name"),
    "payload-traversal": (
        _set("contribution", "payload", "../x.msg"),
        'blob "../x.msg" is not a file name',
    ),
}


@pytest.fixture(scope="module")
def owner_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    import asyncio

    folder = tmp_path_factory.mktemp("owner")
    log = asyncio.run(_run(folder))
    return log, [json.loads(line) for line in log.read_text().splitlines()]


def _edited(tmp_path: Path, owner_log: tuple[Path, list[Any]], edit: Edit) -> Path:
    log, records = owner_log
    records = json.loads(json.dumps(records))  # a deep copy
    edit(records)
    out = tmp_path / "owner-0.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    payload_dir(out).symlink_to(payload_dir(log))
    return out


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_damaged_record_is_one_line_naming_its_line(
    tmp_path: Path, owner_log: tuple[Path, list[Any]], capsys: pytest.CaptureFixture[str], name: str
) -> None:
    edit, says = EDITS[name]
    log = _edited(tmp_path, owner_log, edit)
    with pytest.raises(LogError) as err:
        replay(log)
    assert str(err.value).startswith(f"{log}:") and says in str(err.value), err.value
    assert main(["replay", str(log)]) == 1
    out, stderr = capsys.readouterr()
    assert out == "" and stderr == f"atoll replay: {err.value}\n"


def test_an_edited_contribution_then_a_refused_event_names_where_the_replay_diverged(
    tmp_path: Path, owner_log: tuple[Path, list[Any]]
) -> None:
    log = _edited(
        tmp_path, owner_log, _set("contribution", "steps", 0)
    )  # refused, where the owner merged it
    line = _first(owner_log[1], "contribution") + 1
    with pytest.raises(LogError) as err:
        replay(log)
    assert "record: the replayed merger refuses it (" in str(err.value)
    assert f"the replay diverged from the log at line {line}: the log was edited" in str(err.value)


def test_a_blob_that_is_a_path_is_never_read(
    tmp_path: Path, owner_log: tuple[Path, list[Any]]
) -> None:
    (tmp_path / "secret.safetensors").write_bytes(
        b"not yours"
    )  # two folders up from the payload folder
    (tmp_path / "logs").mkdir()
    log = _edited(tmp_path / "logs", owner_log, _set("state", "blob", "../../secret.safetensors"))
    with pytest.raises(LogError, match="refused, nothing read"):
        replay(log)


def test_an_empty_log_holds_no_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "owner-0.jsonl"
    empty.write_text("\n")
    with pytest.raises(EmptyLog):
        replay(empty)
    assert main(["replay", str(empty)]) == 1
    assert capsys.readouterr().err == (
        f"atoll replay: {empty} holds no records: an owner's log starts with a start "
        "line; is this a merger log?\n"
    )


def test_a_binary_file_is_not_a_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "owner-0.jsonl"
    junk.write_bytes(b"\xde\xad\xbe\xef\x00\xff\n")
    assert main(["replay", str(junk)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"atoll replay: {junk}:1: not a JSON line") and len(err.splitlines()) == 1


def test_an_unedited_log_still_replays(owner_log: tuple[Path, list[Any]]) -> None:
    log, _ = owner_log
    result = replay(log)
    assert result.mismatches == [] and result.decisions >= 12 and result.unchecked is None
