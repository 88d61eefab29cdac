"""What a peer's ``/v1/status`` must look like for ``atoll status`` to draw it: ``_not_a_status``
says what is wrong with an answer (its fields of the kinds ``render_status`` uses), or None."""

from __future__ import annotations

import re
from typing import Any

_FRAGMENT_KEY = re.compile(r"[0-9]{1,9}")


def _kind(value: object) -> str:
    """A JSON value's kind, as JSON names it."""
    kinds = (
        (bool, "a boolean"),
        (int | float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    )
    return next((name for cls, name in kinds if isinstance(value, cls)), "null")


def _not_a_status(status: object) -> str | None:
    """Why ``status`` is not a ``/v1/status`` answer (its fields of the kinds the tables use), or None."""
    if not isinstance(status, dict):
        return f"{_kind(status)}, not an object"
    shapes = (
        ("members", list),
        ("owners", dict),
        ("versions", list),
        ("refused_members", dict),
        ("remote_errors", dict),
    )
    for key, cls in shapes:
        if key in status and not isinstance(status[key], cls):
            return f"{key} is {_kind(status[key])}, not {_kind(cls())}"
    adm = status.get("admission")
    if adm and not isinstance(adm, dict):
        return f"admission is {_kind(adm)}, not an object"
    numbers = {
        "bytes_sent": status.get("bytes_sent", 0),
        "bytes_received": status.get("bytes_received", 0),
        **{f"remote_errors.{k}": v for k, v in status.get("remote_errors", {}).items()},
    }
    if adm:
        refused = adm.get("refused", {})
        if not isinstance(refused, dict):
            return f"admission.refused is {_kind(refused)}, not an object"
        numbers.update({f"admission.refused.{k}": v for k, v in refused.items()})
    bad = next(
        (k for k, v in numbers.items() if isinstance(v, bool) or not isinstance(v, int | float)),
        None,
    )
    if bad is not None:
        return f"{bad[:80]} is {_kind(numbers[bad])}, not a number"
    return _member_problem(status.get("members", [])) or _owner_problem(status.get("owners", {}))


def _member_problem(members: list[Any]) -> str | None:
    for i, m in enumerate(members):
        if not isinstance(m, dict):
            return f"members[{i}] is {_kind(m)}, not an object"
        if not isinstance(m.get("peer_id"), str):
            return f"members[{i}].peer_id is {_kind(m.get('peer_id'))}, not a string"
        roles = m.get("roles", [])
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            return f"members[{i}].roles is not an array of strings"
    return None


def _owner_problem(owners: dict[str, Any]) -> str | None:
    for p, o in owners.items():
        if not _FRAGMENT_KEY.fullmatch(p):
            return f"owners has key {p[:20]!r}, not a fragment number"
        if o is not None and not (
            isinstance(o, dict) and isinstance(o.get("peer_id"), str) and "url" in o
        ):
            return f"owners[{p}] is neither null nor an object with a peer_id string and a url"
    return None
