"""Member records: strict decoding, manifest agreement, owner choice over reachable members."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import pytest

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord, Membership, manifest_hash, members_key
from protocol.errors import DecodeError


def _record(**kw: object) -> MemberRecord:
    fields: dict[str, object] = dict(url="http://127.0.0.1:9000", roles=("learner", "owner"), reachable=True,
                                     manifest="m", learning=True, step=3)
    fields.update(kw)
    return MemberRecord(**fields)  # type: ignore[arg-type]


def test_record_round_trip_fits_a_dht_value() -> None:
    rec = _record()
    raw = rec.encode()
    assert MemberRecord.decode(raw) == rec and len(raw) < 1024


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb(["http://x", ["admin"], True, "m", True, 0]),
    msgpack.packb(["ftp://x", ["learner"], True, "m", True, 0]),
    msgpack.packb(["http://x", ["learner"], "yes", "m", True, 0]),
    msgpack.packb({"url": "http://x"}),
])
def test_bad_records_are_refused_with_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError, match="bad member record"):
        MemberRecord.decode(raw)


def test_manifest_covers_swarm_wide_fields_only() -> None:
    base = RunConfig()
    assert manifest_hash(base) == manifest_hash(dataclasses.replace(base, steps=5, threads=2, corpus="x"))
    assert manifest_hash(base) != manifest_hash(dataclasses.replace(base, fragments=8))
    assert manifest_hash(base) != manifest_hash(dataclasses.replace(base, model="tiny"))
    assert members_key("a") != members_key("b")


def test_owners_only_among_reachable_owner_role_members() -> None:
    ms = Membership.__new__(Membership)
    far = time.time() + 60
    ms.members = {
        b"a" * 32: Member(b"a" * 32, _record(url="http://a"), far, certified_owner=True),
        b"b" * 32: Member(b"b" * 32, _record(url="", reachable=False, roles=("learner",)), far),
        b"c" * 32: Member(b"c" * 32, _record(url="http://c", reachable=False), far, certified_owner=True),
        b"d" * 32: Member(b"d" * 32, _record(url="http://d", learning=False), far, certified_owner=True),
        b"e" * 32: Member(b"e" * 32, _record(url="http://e"), far),  # asks to own, not certified to
    }
    assert sorted(ms.owner_candidates()) == [b"a" * 32, b"d" * 32]
    owners = {ms.owner_of("s", p)[0] for p in range(16)}  # type: ignore[index]
    assert owners <= {b"a" * 32, b"d" * 32}
    assert ms.owner_of("s", 0, exclude={b"a" * 32}) == (b"d" * 32, "http://d")
    assert ms.learners() == 4
