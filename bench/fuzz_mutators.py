"""How the fuzzer makes hostile inputs from valid ones: byte edits and msgpack tree edits.

Randomness is an argument (``random.Random``) so a run is reproducible; the tree edits take an
index and a value instead, so hypothesis can draw (and shrink) them too.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

__all__ = ["count_nodes", "mutate_bytes", "mutate_tree", "random_value"]


# ── mutators ─────────────────────────────────────────────────────────────────────────────────
_INTERESTING_BYTES = (
    0x00,
    0x01,
    0x7F,
    0x80,
    0xFF,
    0xC0,
    0xC1,
    0xC2,
    0xC4,
    0xC6,
    0xCA,
    0xCB,
    0xCF,
    0xD3,
    0xD9,
    0xDB,
    0xDC,
    0xDD,
    0xDE,
    0xDF,
    0x90,
    0x9F,
    0x80,
    0x8F,
)
_INTERESTING_U32 = (0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 20)


def mutate_bytes(data: bytes, rng: random.Random, others: Sequence[bytes] = ()) -> bytes:
    """One to eight byte-level edits of ``data``: flips, overwrites, cuts, inserts, splices."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op, pos = rng.randrange(9), rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[pos % len(buf)] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[pos % len(buf)] = rng.choice(_INTERESTING_BYTES)
        elif op == 2 and len(buf) >= 4:
            struct.pack_into(">I", buf, min(pos, len(buf) - 4), rng.choice(_INTERESTING_U32))
        elif op == 3:
            del buf[pos:]
        elif op == 4:
            buf[pos:pos] = rng.randbytes(rng.choice((1, 2, 4, 16)))
        elif op == 5:
            del buf[pos : pos + rng.choice((1, 2, 8, 64))]
        elif op == 6:
            buf[pos:pos] = buf[pos : pos + rng.choice((1, 8, 64))]
        elif op == 7 and buf and rng.random() < 0.2:  # a long run: huge numbers, long names
            buf[pos:pos] = buf[pos % len(buf) : pos % len(buf) + 1] * rng.choice((30, 5000))
        elif op == 7 and others:
            other = rng.choice(others)
            buf[pos:] = other[rng.randrange(len(other) + 1) :]
        else:
            buf += rng.randbytes(rng.choice((1, 8, 100)))
    return bytes(buf)


_INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    127,
    128,
    255,
    256,
    65535,
    1 << 31,
    (1 << 32) - 1,
    1 << 53,
    (1 << 63) - 1,
    -(1 << 63),
    (1 << 64) - 1,
)
_INTERESTING_FLOATS = (
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e308,
    -1e308,
    5e-324,
    float("inf"),
    float("-inf"),
    float("nan"),
)


def random_value(rng: random.Random, depth: int = 0) -> object:
    """A random msgpack-able value: scalars of every type and small nested containers."""
    kind = rng.randrange(9 if depth < 3 else 7)
    if kind == 0:
        return rng.choice((None, True, False))
    if kind == 1:
        return rng.choice(_INTERESTING_INTS)
    if kind == 2:
        return rng.randint(-(1 << 63), (1 << 64) - 1)
    if kind == 3:
        return rng.choice(_INTERESTING_FLOATS)
    if kind == 4:
        return "".join(
            chr(rng.choice((32, 0, 0x7F, 0xE9, 0x2603, 0xD800, 0x1F600, 104)))
            for _ in range(rng.choice((0, 1, 8, 200, 2000)))
        )
    if kind == 5:
        return rng.randbytes(rng.choice((0, 1, 16, 32, 64, 2000)))
    if kind == 6:
        return rng.choice(("none", "int4", "float32", "http://x", "owner", "s", ""))
    n = rng.choice((0, 1, 2, 6))
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(n)]
    return {
        rng.choice(("swarm", "shape", "x", "", 0, 1, -1)): random_value(rng, depth + 1)
        for _ in range(n)
    }


def count_nodes(tree: object) -> int:
    """Nodes of ``tree`` in pre-order: itself, then list items, then each map's keys and values."""
    if isinstance(tree, (list, tuple)):
        return 1 + sum(count_nodes(v) for v in tree)
    if isinstance(tree, dict):
        return 1 + sum(1 + count_nodes(v) for v in tree.values())
    return 1


_DELETED = object()


def mutate_tree(tree: object, index: int, op: str, value: object) -> object:
    """A copy of ``tree`` with node ``index`` (pre-order, modulo the count) replaced by
    ``value`` (op "replace"), removed ("delete") or given ``value`` as a sibling ("insert")."""
    counter = [index % count_nodes(tree)]
    out = _edit(tree, counter, op, value)
    return None if out is _DELETED else out


def _hashable(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _edit(node: object, counter: list[int], op: str, value: object) -> object:
    if counter[0] < 0:
        return node
    if counter[0] == 0:
        counter[0] = -1
        if op == "replace":
            return value
        if op == "delete":
            return _DELETED
        if isinstance(node, list):
            return [*node, value]
        if isinstance(node, dict):
            return {**node, _hashable(value): value}
        return [node, value]
    counter[0] -= 1
    if isinstance(node, (list, tuple)):
        return [v for v in (_edit(v, counter, op, value) for v in node) if v is not _DELETED]
    if isinstance(node, dict):
        out: dict[object, object] = {}
        for k, v in node.items():
            key = k  # a key is a leaf: replaced, deleted or paired, never walked into
            if counter[0] == 0:
                key = _edit(k, counter, op, value)
            elif counter[0] > 0:
                counter[0] -= 1
            new = _edit(v, counter, op, value)
            if key is not _DELETED and new is not _DELETED:
                out[_hashable(key)] = new
        return out
    return node
