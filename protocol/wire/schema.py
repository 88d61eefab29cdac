"""The wire schema machinery: kinds, the type-code registries, value checks, the bases.

The concrete messages and structs live in ``protocol.wire.messages``, which re-exports all of
this.

Theory of operation. Every message is a frozen, slotted, keyword-only dataclass. Its field
annotations *are* its wire schema: when a class is registered, the annotations are resolved once
into a tuple of ``(name, Kind)`` pairs, where a ``Kind`` is one of

* ``Scalar(t)`` for ``int`` (signed 64-bit), ``float`` (finite), ``str``, ``bool`` and small
  inline ``bytes`` (ids, hashes);
* ``Blob()`` for ``bytes | bytearray | memoryview``: a possibly huge buffer the codec sends as raw
  bytes after the header, never copying it into msgpack;
* ``Maybe(k)`` for ``X | None``, ``TupleOf(k)`` for ``tuple[X, ...]``;
* ``StructOf(classes)`` for a nested struct (or a union of them) registered with
  :func:`register_struct` (``EncodedTensor`` and ``PeerInfo`` in ``messages``).

Two registries map codes to classes: ``MESSAGE_TYPES`` for top-level messages and
``STRUCT_TYPES`` for nested structs, each with codes 1-31 general/DiLoCo, 32-63 DHT, 64-95
membership, 96-127 reserved. A duplicate code is our own bug: ``LocalProtocolError``. A new
message elsewhere (e.g. ``protocol/dht/messages.py``) is declared as::

    @register(33)
    @dataclass(frozen=True, slots=True, kw_only=True)
    class FindNode(Message):
        target: bytes
        def _check(self) -> None: ...      # ranges; raise DecodeError(reason)

Validation happens in ``__post_init__``: the generic :func:`check_fields` checks every field
against the schema and the size caps in ``CAPS`` (and turns an ``int`` given for a ``float``
field into a float), then the class's own ``_check`` checks ranges. Since decoding constructs
the same classes, every violation raises ``DecodeError``: a remote error when a peer sent it.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import ClassVar, TypeVar

from protocol.errors import DecodeError, LocalProtocolError

__all__ = [
    "CAPS",
    "MESSAGE_TYPES",
    "STRUCT_TYPES",
    "Blob",
    "Caps",
    "Kind",
    "Maybe",
    "Message",
    "Scalar",
    "Schema",
    "StructOf",
    "TupleOf",
    "WireStruct",
    "check_fields",
    "check_value",
    "register",
    "register_struct",
    "schema_of",
    "struct_code",
]


@dataclass(frozen=True, slots=True)
class Caps:
    """Size caps every encoder and decoder enforces (the wire's table of limits)."""

    max_str: int = 1024  # UTF-8 bytes of any str field
    max_bytes: int = 1024  # any inline bytes field (ids, hashes, signatures)
    max_tuple: int = 16_384  # elements of any tuple field
    max_fields: int = 32  # fields of one message or struct
    max_blobs: int = 65_536  # out-of-line buffers in one message
    max_header: int = 8 << 20  # msgpack header bytes of one message
    max_name: int = 128  # swarm names and roles
    max_address: int = 256  # "http://host:port"
    max_roles: int = 16
    max_wait_s: float = 600.0  # long-poll wait of FetchFragment
    max_type_code: int = 127


CAPS = Caps()
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


# ── schema kinds ─────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True, slots=True)
class Scalar:
    type: type  # int, float, str, bool or bytes


@dataclass(frozen=True, slots=True)
class Blob:
    """A buffer sent out of line, after the header."""


@dataclass(frozen=True, slots=True)
class Maybe:
    inner: Kind


@dataclass(frozen=True, slots=True)
class TupleOf:
    inner: Kind


@dataclass(frozen=True, slots=True)
class StructOf:
    classes: tuple[type, ...]


Kind = Scalar | Blob | Maybe | TupleOf | StructOf
Schema = tuple[tuple[str, Kind], ...]

_SCALARS = (int, float, str, bool, bytes)
_BLOB_TYPES = frozenset({bytes, bytearray, memoryview})
_NONE = type(None)

MESSAGE_TYPES: dict[int, type[Message]] = {}
STRUCT_TYPES: dict[int, type] = {}
_STRUCT_CODES: dict[type, int] = {}
_SCHEMAS: dict[type, Schema] = {}

T = TypeVar("T", bound=type)
M = TypeVar("M", bound="type[Message]")


def _kind_of(hint: object, where: str) -> Kind:
    """The ``Kind`` of one resolved annotation; raises LocalProtocolError if unsupported."""
    if hint in _SCALARS:
        return Scalar(typing.cast(type, hint))
    if isinstance(hint, type) and hint in _STRUCT_CODES:
        return StructOf((hint,))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return TupleOf(_kind_of(args[0], where))
    if origin in (types.UnionType, typing.Union):
        rest = tuple(a for a in args if a is not _NONE)
        inner = _kind_of_union(rest, where)
        return Maybe(inner) if len(rest) < len(args) else inner
    raise LocalProtocolError(f"{where}: unsupported wire type {hint!r}")


def _kind_of_union(args: tuple[object, ...], where: str) -> Kind:
    if len(args) == 1:
        return _kind_of(args[0], where)
    if set(args) == _BLOB_TYPES:
        return Blob()
    if all(isinstance(a, type) and a in _STRUCT_CODES for a in args):
        return StructOf(typing.cast(tuple[type, ...], args))
    raise LocalProtocolError(f"{where}: unsupported union {args!r}")


def schema_of(cls: type) -> Schema:
    """The wire schema of a dataclass (computed once); raises LocalProtocolError if unfit."""
    schema = _SCHEMAS.get(cls)
    if schema is not None:
        return schema
    if not is_dataclass(cls) or not getattr(cls, "__dataclass_params__").frozen:  # noqa: B009
        raise LocalProtocolError(f"{cls.__name__} is not a frozen dataclass")
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError) as e:
        raise LocalProtocolError(f"{cls.__name__}: cannot resolve annotations: {e}") from e
    schema = tuple(
        (f.name, _kind_of(hints[f.name], f"{cls.__name__}.{f.name}")) for f in fields(cls)
    )
    if len(schema) > CAPS.max_fields or any(not f.init for f in fields(cls)):
        raise LocalProtocolError(f"{cls.__name__}: at most {CAPS.max_fields} init fields")
    _SCHEMAS[cls] = schema
    return schema


def _check_code(code: int, table: dict[int, type], cls: type) -> None:
    if type(code) is not int or not 1 <= code <= CAPS.max_type_code:
        raise LocalProtocolError(f"type code {code!r} outside 1..{CAPS.max_type_code}")
    if code in table:
        raise LocalProtocolError(f"type code {code} already registered to {table[code].__name__}")
    if cls in table.values():
        raise LocalProtocolError(f"{cls.__name__} is already registered")


def register(code: int) -> Callable[[M], M]:
    """Class decorator: register a ``Message`` subclass under ``code``.

    Raises LocalProtocolError on a duplicate or out-of-range code, or a class whose
    annotations are not a supported wire schema.
    """

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, Message)):
            raise LocalProtocolError(f"{cls!r} is not a Message subclass")
        _check_code(code, typing.cast(dict[int, type], MESSAGE_TYPES), cls)
        schema_of(cls)
        cls.TYPE_CODE = code
        MESSAGE_TYPES[code] = cls
        return cls

    return decorate


def register_struct(code: int) -> Callable[[T], T]:
    """Class decorator: make a dataclass usable as a nested field, tagged ``code`` on the wire.

    Raises LocalProtocolError on a duplicate or out-of-range code or an unfit class.
    """

    def decorate(cls: T) -> T:
        _check_code(code, STRUCT_TYPES, cls)
        schema_of(cls)
        STRUCT_TYPES[code] = cls
        _STRUCT_CODES[cls] = code
        return cls

    return decorate


def struct_code(cls: type) -> int:
    """The wire code of a registered struct class; raises LocalProtocolError if unregistered."""
    code = _STRUCT_CODES.get(cls)
    if code is None:
        raise LocalProtocolError(f"{cls.__name__} is not a registered wire struct")
    return code


# ── value checks ─────────────────────────────────────────────────────────────────────────────
def check_value(kind: Kind, value: object, where: str) -> object:
    """``value`` checked against ``kind`` and the caps (an int for a float becomes a float).

    Raises DecodeError naming ``where`` on a wrong type or a value beyond a cap.
    """
    try:
        return _check_value(kind, value, None)
    except DecodeError:
        pass
    # the same checks again, naming where (outside the handler: no chained first error); on
    # the way that passes, no place name is built at all
    return _check_value(kind, value, where)


def _check_value(kind: Kind, value: object, where: str | None) -> object:
    """``check_value``; ``where`` None: the error's place left unnamed (the caller asks again)."""
    if isinstance(kind, Scalar):
        return _check_scalar(kind.type, value, where)
    if isinstance(kind, Blob):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise DecodeError(f"{where}: expected a bytes-like buffer, got {type(value).__name__}")
        return value
    if isinstance(kind, Maybe):
        return None if value is None else _check_value(kind.inner, value, where)
    if isinstance(kind, TupleOf):
        if type(value) is not tuple:
            raise DecodeError(f"{where}: expected a tuple, got {type(value).__name__}")
        if len(value) > CAPS.max_tuple:
            raise DecodeError(f"{where}: {len(value)} elements exceed the cap {CAPS.max_tuple}")
        inner = kind.inner
        if isinstance(inner, Scalar) and inner.type is not float and where is None:
            for v in value:  # nothing to convert: the tuple itself is the answer
                _check_scalar(inner.type, v, None)
            return value
        if where is None:
            return tuple([_check_value(inner, v, None) for v in value])
        return tuple(_check_value(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if type(value) not in kind.classes:
        names = "|".join(c.__name__ for c in kind.classes)
        raise DecodeError(f"{where}: expected {names}, got {type(value).__name__}")
    return value


def _check_scalar(t: type, value: object, where: str | None) -> object:
    if t is float and type(value) is int:
        value = float(value) if abs(value) < 1 << 1000 else math.inf
    if type(value) is not t:
        raise DecodeError(f"{where}: expected {t.__name__}, got {type(value).__name__}")
    if t is bytes:  # the commonest (ids, tags, signatures): one cap to check
        if len(value) > CAPS.max_bytes:  # type: ignore[arg-type]  # bytes, checked above
            raise DecodeError(f"{where}: {len(value)} inline bytes exceed the cap {CAPS.max_bytes}")  # type: ignore[arg-type]
        return value
    if t is int and not INT_MIN <= value <= INT_MAX:  # type: ignore[operator]  # an int
        raise DecodeError(f"{where}: integer {value} outside signed 64-bit range")
    if t is float and not math.isfinite(value):  # type: ignore[arg-type]  # a float
        raise DecodeError(f"{where}: float {value} is not finite")
    if t is str:
        try:
            n = len(value.encode())  # type: ignore[attr-defined]  # a str
        except UnicodeEncodeError as e:
            raise DecodeError(f"{where}: string is not valid UTF-8") from e
        if n > CAPS.max_str:
            raise DecodeError(f"{where}: string of {n} bytes exceeds the cap {CAPS.max_str}")
    return value


def check_fields(obj: object) -> None:
    """Check every field of a wire dataclass against its schema; raises DecodeError."""
    cls = type(obj)
    try:
        _check_fields(obj, cls, None)
        return
    except DecodeError:
        pass
    _check_fields(obj, cls, cls.__name__)  # again, naming the field (see ``check_value``)


def _check_fields(obj: object, cls: type, name_of: str | None) -> None:
    for name, kind in schema_of(cls):
        value = getattr(obj, name)
        checked = _check_value(kind, value, None if name_of is None else f"{name_of}.{name}")
        if checked is not value:
            object.__setattr__(obj, name, checked)


# ── bases ────────────────────────────────────────────────────────────────────────────────────
class WireStruct:
    """Base of wire dataclasses: generic schema check, then the class's own ``_check``.

    A subclass that defines ``__post_init__`` must call ``super().__post_init__()``.
    """

    __slots__ = ()

    def __post_init__(self) -> None:
        check_fields(self)
        self._check()

    def _check(self) -> None:
        """Range checks beyond types; raise DecodeError with a reason."""


class Message(WireStruct):
    """Base of top-level messages; ``TYPE_CODE`` is set by :func:`register`."""

    __slots__ = ()
    TYPE_CODE: ClassVar[int]
