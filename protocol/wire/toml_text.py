"""Reading a TOML document that came from someone else: its size is bounded before it is parsed,
and every way ``tomllib`` can fail is one ``DecodeError``."""

from __future__ import annotations

import tomllib
from typing import Any

from protocol.errors import DecodeError, Oversize

__all__ = ["load_bounded_toml"]


def load_bounded_toml(text: str | bytes, *, limit: int, what: str) -> dict[str, Any]:
    """The parsed document. Raises ``Oversize`` past ``limit`` bytes (checked before decoding or
    parsing) and ``DecodeError`` for text that is not UTF-8 or not TOML; both name ``what``."""
    if len(text) > limit:
        raise Oversize(f"{what}: {len(text)} bytes exceeds {limit}")
    try:
        raw = text.decode() if isinstance(text, bytes) else text
        return tomllib.loads(raw)
    # ValueError: UnicodeDecodeError, TOMLDecodeError, and int() of an integer of 4300+ digits;
    # RecursionError: arrays or inline tables nested ~1000 deep
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"{what} is not valid TOML: {' '.join(str(exc).split())}") from None
