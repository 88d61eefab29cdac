"""node.state.atomic: readers see the old file or the whole new one; a failed write leaves the
old file and no temporary file behind."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from node.state.atomic import atomic_write, write_atomic


def test_a_write_replaces_the_file_whole_with_the_mode_asked(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "key.pem"
    write_atomic(path, b"old", mode=0o600)
    write_atomic(path, b"new contents", mode=0o644)
    assert path.read_bytes() == b"new contents"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["key.pem"]


def test_an_error_midway_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    write_atomic(path, b"the old tokens")
    with pytest.raises(OverflowError), atomic_write(path) as out:
        out.write(b"half of the new")
        raise OverflowError("a token id outside the dtype")
    assert path.read_bytes() == b"the old tokens"
    assert [p.name for p in tmp_path.iterdir()] == ["tokens.bin"]


def test_a_new_file_is_created_private_unless_a_mode_is_given(tmp_path: Path) -> None:
    path = tmp_path / "fresh"
    with atomic_write(path) as out:
        out.write(b"x")
        out.seek(0)
        out.write(b"y")  # seek and overwrite, as the token file's header does
    assert path.read_bytes() == b"y"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
