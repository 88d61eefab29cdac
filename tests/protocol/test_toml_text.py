"""protocol.wire.toml_text: a stranger's TOML is refused by size before it is read, and every
way it can fail to parse is one DecodeError naming what it was."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import DecodeError, Oversize
from protocol.wire.toml_text import load_bounded_toml


def test_a_document_is_parsed() -> None:
    assert load_bounded_toml(b'[swarm]\nname = "a"\n', limit=64, what="manifest") == {
        "swarm": {"name": "a"}
    }


def test_size_is_refused_before_decoding() -> None:
    with pytest.raises(Oversize, match="recipe: 65 bytes exceeds 64"):
        load_bounded_toml(b"\xff" * 65, limit=64, what="recipe")


@pytest.mark.parametrize(
    "text",
    [b"\xff\xfe", "a = [" * 2000, "n = " + "9" * 5000, "[swarm\nname = 1"],
    ids=["not utf-8", "nested 2000 deep", "a 5000-digit integer", "broken table"],
)
def test_every_parse_failure_is_one_decode_error(text: str | bytes) -> None:
    with pytest.raises(DecodeError, match="^manifest is not valid TOML: "):
        load_bounded_toml(text, limit=1 << 20, what="manifest")


@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_raise_decode_error(data: bytes) -> None:
    try:
        assert isinstance(load_bounded_toml(data, limit=1 << 10, what="recipe"), dict)
    except DecodeError as exc:
        assert "\n" not in str(exc)
