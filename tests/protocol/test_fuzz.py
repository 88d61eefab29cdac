"""Hostile bytes: every decoder of peer input returns a value or raises a RemoteProtocolError.

The targets are ``bench.fuzz_targets.targets()`` (the same list ``python -m bench.fuzz`` runs for
minutes): random bytes, truncations and bit flips of valid encodings, and valid msgpack trees
with one node of the wrong type. Then decoding is bounded: tiny inputs that declare huge
lengths, deep nesting or map bombs allocate no more than a few MiB. Last, regression cases for
the crashes the fuzzer found.
"""

from __future__ import annotations

import base64
import contextlib
import struct
import tracemalloc
from collections.abc import Callable

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz_mutators import count_nodes, mutate_tree
from bench.fuzz_targets import MAX_SIZE, Target, attempt, targets
from node.dht.bootstrap import _target as dialback_target
from node.dht.membership import MemberRecord
from node.state.serve import (
    Manifest,
    RangeNotSatisfiable,
    etag_version,
    parse_content_range,
    parse_range,
)
from protocol.errors import DecodeError, Oversize, RemoteProtocolError
from protocol.wire.codec import MAGIC, BodyReader, decode
from protocol.wire.membership import SwarmManifest, parse_public_key
from protocol.wire.request_auth import RequestAuth
from protocol.wire.signing import SealedReader, open_envelope

# decompress reads hostile bytes in place; torch warns (once) that a bytes buffer is read-only
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

TARGETS = {t.name: t for t in targets()}
TREE_TARGETS = [name for name, t in TARGETS.items() if t.build is not None]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(target: Target, data: bytes) -> None:
    failure = attempt(target, data)
    assert failure is None, f"{target.name}: {failure}"


# ── properties ───────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("name", TARGETS)
@FUZZ
@given(data=st.binary(max_size=600))
def test_random_bytes(name: str, data: bytes) -> None:
    check(TARGETS[name], data)


@pytest.mark.parametrize("name", TARGETS)
@FUZZ
@given(
    data=st.data(),
    flips=st.lists(st.integers(0, 1 << 20), max_size=4),
    cut=st.none() | st.integers(0, 1 << 20),
    garbage=st.binary(max_size=16),
)
def test_truncated_and_bit_flipped_seeds(
    name: str, data: st.DataObject, flips: list[int], cut: int | None, garbage: bytes
) -> None:
    seed = bytearray(data.draw(st.sampled_from(TARGETS[name].seeds)))
    for pos in flips:
        seed[pos // 8 % len(seed)] ^= 1 << (pos % 8)
    if cut is not None:
        seed = seed[: cut % (len(seed) + 1)] + garbage
    check(TARGETS[name], bytes(seed))


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=80)
    | st.sampled_from(["none", "int4", "float32", "http://x", "owner", "", "s"])
)
MSGPACK_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-3, 3), inner, max_size=4)
    ),
    max_leaves=5,
)


@pytest.mark.parametrize("name", TREE_TARGETS)
@FUZZ
@given(
    data=st.data(),
    op=st.sampled_from(["replace", "replace", "delete", "insert"]),
    value=MSGPACK_VALUES,
)
def test_wrong_types_in_valid_structures(
    name: str, data: st.DataObject, op: str, value: object
) -> None:
    target = TARGETS[name]
    assert target.build is not None
    tree = data.draw(st.sampled_from(target.trees))
    index = data.draw(st.integers(0, count_nodes(tree) - 1))
    check(target, target.build(mutate_tree(tree, index, op, value)))


def test_every_seed_is_accepted() -> None:
    """The seeds are valid, so mutations start from something that gets deep."""
    for target in TARGETS.values():
        for seed in target.seeds:
            target.feed(seed)  # raises if a seed is refused


# ── bounded decoding ─────────────────────────────────────────────────────────────────────────
def _frame(header: bytes) -> bytes:
    return struct.pack(">4sBI", MAGIC, 1, len(header)) + header


_NESTED = b"\x91" * 100_000 + b"\xc0"  # [[[[…nil…]]]]
_MAP_BOMB = b"\x9f" + b"\x8f" * 15  # arrays of maps of 15 entries, nothing after
BOMBS: dict[str, bytes] = {
    "array32 of 2^32-1": b"\xdd\xff\xff\xff\xff",
    "map32 of 2^32-1": b"\xdf\xff\xff\xff\xff",
    "str32 of 4 GiB": b"\xdb\xff\xff\xff\xff",
    "bin32 of 4 GiB": b"\xc6\xff\xff\xff\xff",
    "ext32 of 4 GiB": b"\xc9\xff\xff\xff\xff\x01",
    "deep nesting": _NESTED,
    "open arrays of 65535": b"\xdc\xff\xff" * 1023,  # msgpack preallocates 10k slots each
    "map bomb": _MAP_BOMB,
    "header of 3 arrays of 2^32-1": b"\x93" + b"\xdd\xff\xff\xff\xff" * 3,
}
DECODERS: dict[str, Callable[[bytes], object]] = {
    "codec": lambda b: decode(_frame(b), max_size=MAX_SIZE),
    "envelope": lambda b: open_envelope(b[:512], max_size=MAX_SIZE),
    "member record": MemberRecord.decode,
    "manifest": lambda b: Manifest.parse(b, max_total=1 << 30),
}


def peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        with contextlib.suppress(RemoteProtocolError):
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("bomb", BOMBS)
@pytest.mark.parametrize("decoder", DECODERS)
def test_bombs_are_refused_without_allocating(decoder: str, bomb: str) -> None:
    data = BOMBS[bomb]
    with pytest.raises(RemoteProtocolError):
        DECODERS[decoder](data)
    assert peak_bytes(lambda: DECODERS[decoder](data)) < 4 << 20


@pytest.mark.parametrize(
    "head",
    [
        struct.pack(">4sBI", MAGIC, 1, 0xFFFFFFFF),  # header length 4 GiB
        _frame(msgpack.packb([1, {}, [1 << 40, 1 << 40]])),  # blobs of 1 TiB each
        _frame(msgpack.packb([1, {}, list(range(60_000))])),  # 60k blob lengths, no blobs
    ],
)
def test_codec_declared_sizes_are_not_allocated(head: bytes) -> None:
    with pytest.raises((DecodeError, Oversize)):
        decode(head, max_size=MAX_SIZE)
    assert peak_bytes(lambda: decode(head, max_size=MAX_SIZE)) < 4 << 20


def test_streamed_readers_refuse_huge_declared_lengths_before_allocating() -> None:
    def body() -> None:
        BodyReader(1 << 30).feed(struct.pack(">Q", (1 << 64) - 1))

    def sealed() -> None:
        SealedReader(1 << 30).feed(struct.pack(">I", 0xFFFFFFFF))

    for fn in (body, sealed):
        with pytest.raises(Oversize):
            fn()
        assert peak_bytes(fn) < 1 << 20


# ── regressions: what the fuzzer found ───────────────────────────────────────────────────────
@pytest.mark.parametrize("etag", ["v" + "9" * 5000 + "-ab", "v" + "1" * 20 + "-ab", "v٣-ab"])
def test_etag_with_a_huge_or_non_ascii_version_is_not_an_etag(etag: str) -> None:
    # was ValueError (int() of more than 4300 digits); non-ASCII digits were accepted
    assert etag_version(etag) is None


def test_etag_version_still_reads_ours() -> None:
    assert etag_version("v" + "9" * 19 + "-0af") == 10**19 - 1
    assert etag_version("v12-0123abcdef") == 12


@pytest.mark.parametrize(
    "value", ["bytes 0-" + "9" * 5000 + "/1", "bytes 1-2/" + "7" * 20, "bytes ٣-4/5"]
)
def test_content_range_with_huge_positions_is_not_one(value: str) -> None:
    # was ValueError in node.state.sync (int() of more than 4300 digits)
    assert parse_content_range(value) is None


def test_content_range_parses() -> None:
    assert parse_content_range("bytes 5-9/10") == (5, 10, 10)


@pytest.mark.parametrize("url", ["http://[::1", "http://[zz]:80", "https://[1.2.3.4]:1"])
def test_dialback_url_with_a_bad_ipv6_host_is_a_decode_error(url: str) -> None:
    # was ValueError from urlsplit: a 500 instead of a 400
    with pytest.raises(DecodeError):
        dialback_target({"url": url})


def test_suffix_range_of_an_empty_body_is_unsatisfiable() -> None:
    # was (0, 0): an empty 206 with "Content-Range: bytes 0--1/0"
    with pytest.raises(RangeNotSatisfiable):
        parse_range("bytes=-5", 0)
    assert parse_range("bytes=-5", 3) == (0, 3)


@pytest.mark.parametrize(
    "toml",
    [
        "a = " + "[" * 3000 + "]" * 3000,  # was RecursionError
        "a = " + "{b=" * 3000 + "1" + "}" * 3000,  # was RecursionError
        "[swarm]\nname = 'x'\nfounder = '"
        + "0" * 64
        + "'\ncreated = 1"
        + "0" * 400,  # OverflowError
        "[swarm]\nname = 'x'\nfounder = '" + "0" * 64 + "'\nversion = 1" + "0" * 5000,  # ValueError
    ],
)
def test_hostile_manifest_toml_is_a_decode_error(toml: str) -> None:
    with pytest.raises(DecodeError):
        SwarmManifest.from_toml(toml)


@pytest.mark.parametrize("key", ["00" * 31 + "\t\t", "00" * 15 + "\t\t" + "00" * 16])
def test_hex_keys_with_whitespace_are_refused(key: str) -> None:
    # bytes.fromhex skips whitespace: these were accepted as 31-byte keys
    sig = base64.b64encode(bytes(64)).decode()
    with pytest.raises(DecodeError):
        RequestAuth.parse(f"v2 {key} 1700000000.0 - {'00' * 16} {sig}")
    with pytest.raises(DecodeError):
        RequestAuth.parse(f"v2 {'00' * 32} 1700000000.0 {key} {'00' * 16} {sig}")  # as a recipient
    with pytest.raises(DecodeError):
        parse_public_key(key.replace("\t", " "))


def test_manifest_recipe_integers_beyond_64_bits_are_a_decode_error() -> None:
    # tomllib reads any integer; signing_bytes (msgpack) raised OverflowError in verify()
    founder = "0" * 64
    with pytest.raises(DecodeError, match="64-bit"):
        SwarmManifest.from_toml(
            f"[swarm]\nname = 'x'\nfounder = '{founder}'\n[recipe]\nn = {10**20}"
        )
