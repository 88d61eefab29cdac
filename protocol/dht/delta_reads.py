"""Delta reads: the tags a FIND_VALUE names for the records its reader holds, and what a
responder leaves out for them.

A reader that already holds records under a key names them in its FIND_VALUE as
``known_tag``s (the first ``KNOWN_TAG_ID_BYTES`` of the subkey and the expiry it holds);
``unknown_to`` is what a responder then sends: only records newer than the reader's, plus a count
of the records it held and left out, so "I hold the value, you have it already" costs a few bytes
instead of every member's record. A reader can only make itself miss records by naming tags;
a publisher cannot make anyone miss another's record without a 128-bit prefix collision on
the other's peer id.

Republications without resending the value. A member re-signs its record every few seconds
with a later expiry, mostly with the same value; an expiry tag then fetches the whole record
again each time. A reader may instead name a record by its *content*: ``content_tag`` (subkey
prefix and an 8-byte digest of the value). ``answer`` leaves out a record named in ``same`` whose
value has that digest (the reader holds this content and needs no newer expiry yet), sends a
``RecordRefresh`` (expiry and signature, no value) for one named in ``renew`` with that digest,
and the whole record for any other content. So a steady swarm's reads cost O(records changed)
plus one refresh a record a ``renew`` window, not a whole record each republication. A digest
collision helps no one: a refresh is checked against the reader's own value by the publisher's
signature, and only the publisher can make its own new value look unchanged.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from protocol.dht.signed_record import RecordRefresh, SignedRecord
from protocol.errors import DecodeError

__all__ = [
    "CONTENT_DIGEST_BYTES",
    "CONTENT_TAG_BYTES",
    "KNOWN_TAG_BYTES",
    "KNOWN_TAG_ID_BYTES",
    "Answer",
    "answer",
    "content_tag",
    "known_tag",
    "known_tags",
    "only_subkeys",
    "renewed",
    "unknown_to",
]

KNOWN_TAG_ID_BYTES = 16  # of the subkey: a forged match needs a 128-bit prefix collision
KNOWN_TAG_BYTES = KNOWN_TAG_ID_BYTES + 8  # ... then the expiry held, as a little-endian float64
_EXPIRY = struct.Struct("<d")
CONTENT_DIGEST_BYTES = 8  # of SHA-256 over the value: a collision only ever hides one's own change
CONTENT_TAG_BYTES = KNOWN_TAG_ID_BYTES + CONTENT_DIGEST_BYTES


def known_tag(rec: SignedRecord) -> bytes:
    """What a reader that holds ``rec`` names in a FIND_VALUE so responders leave it out."""
    return rec.subkey[:KNOWN_TAG_ID_BYTES] + _EXPIRY.pack(rec.expires_at)


def known_tags(records: Iterable[SignedRecord]) -> tuple[bytes, ...]:
    """``known_tag`` of each record, one per subkey prefix (the newest expiry), in subkey order."""
    newest: dict[bytes, SignedRecord] = {}
    for rec in records:
        prefix = rec.subkey[:KNOWN_TAG_ID_BYTES]
        held = newest.get(prefix)
        if held is None or rec.expires_at > held.expires_at:
            newest[prefix] = rec
    return tuple(known_tag(newest[p]) for p in sorted(newest))


def unknown_to(
    records: Sequence[SignedRecord], tags: Iterable[bytes]
) -> tuple[list[SignedRecord], int]:
    """The records a reader that sent ``tags`` does not hold yet, and how many were left out.

    A record is left out when the reader names its subkey prefix with an expiry at or after the
    record's: the reader holds it or a newer one. Tags are shaped by ``FindValue``'s checks;
    a malformed one here is a ``DecodeError``.
    """
    held: dict[bytes, float] = {}
    for tag in tags:
        if len(tag) != KNOWN_TAG_BYTES:
            raise DecodeError(f"a known-record tag is {KNOWN_TAG_BYTES} bytes, got {len(tag)}")
        (expiry,) = _EXPIRY.unpack_from(tag, KNOWN_TAG_ID_BYTES)
        prefix = tag[:KNOWN_TAG_ID_BYTES]
        if math.isfinite(expiry) and expiry > held.get(prefix, -math.inf):
            held[prefix] = expiry
    if not held:
        return list(records), 0
    out = [r for r in records if r.expires_at > held.get(r.subkey[:KNOWN_TAG_ID_BYTES], -math.inf)]
    return out, len(records) - len(out)


def only_subkeys(records: Sequence[SignedRecord], only: Iterable[bytes]) -> list[SignedRecord]:
    """The records whose subkey starts with one of the ``only`` prefixes (all of them when
    ``only`` is empty): a reader that needs a few members' records by id, not the whole key."""
    wanted = {bytes(p[:KNOWN_TAG_ID_BYTES]) for p in only}
    if not wanted:
        return list(records)
    return [r for r in records if r.subkey[:KNOWN_TAG_ID_BYTES] in wanted]


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()[:CONTENT_DIGEST_BYTES]


def content_tag(rec: SignedRecord) -> bytes:
    """What a reader that holds ``rec``'s value names in ``same`` or ``renew``."""
    return rec.subkey[:KNOWN_TAG_ID_BYTES] + _digest(rec.value)


def _by_prefix(tags: Iterable[bytes], size: int, what: str) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for tag in tags:
        if len(tag) != size:
            raise DecodeError(f"a {what} tag is {size} bytes, got {len(tag)}")
        out[bytes(tag[:KNOWN_TAG_ID_BYTES])] = bytes(tag[KNOWN_TAG_ID_BYTES:])
    return out


@dataclass(frozen=True, slots=True)
class Answer:
    """What a responder sends for one delta read: whole records, refreshes of records whose
    value the reader holds, and how many held records were left out as known."""

    records: list[SignedRecord]
    refreshes: list[RecordRefresh]
    omitted: int


def answer(
    records: Sequence[SignedRecord],
    *,
    known: Iterable[bytes] = (),
    same: Iterable[bytes] = (),
    renew: Iterable[bytes] = (),
) -> Answer:
    """A responder's answer to a reader that named ``known`` (expiry tags, ``unknown_to``),
    ``same`` and ``renew`` (content tags, module docstring). A record named by content is
    judged by its content (a record named both ways: by content); any other as ``unknown_to``.
    A malformed tag is a ``DecodeError``."""
    same_d = _by_prefix(same, CONTENT_TAG_BYTES, "content")
    renew_d = _by_prefix(renew, CONTENT_TAG_BYTES, "content")
    rest: list[SignedRecord] = []
    full: list[SignedRecord] = []
    refreshes: list[RecordRefresh] = []
    omitted = 0
    for rec in records:
        prefix = rec.subkey[:KNOWN_TAG_ID_BYTES]
        digest = same_d.get(prefix)
        if digest is None and prefix in renew_d:
            if renew_d[prefix] == _digest(rec.value):
                refreshes.append(RecordRefresh.of(rec))
            else:
                full.append(rec)
        elif digest is None:
            rest.append(rec)
        elif digest == _digest(rec.value):
            omitted += 1
        else:
            full.append(rec)
    sent, left_out = unknown_to(rest, known)
    return Answer(records=full + sent, refreshes=refreshes, omitted=omitted + left_out)


def renewed(
    refreshes: Iterable[RecordRefresh], held: Mapping[bytes, SignedRecord]
) -> tuple[list[SignedRecord], int]:
    """The held records (``held``: subkey -> record) that ``refreshes`` carry a later expiry
    for, rebuilt with it (still to be verified: ``verify_record``), and how many refreshes named
    a record not held or no later than the one held (a responder's waste, to be counted)."""
    out: list[SignedRecord] = []
    ignored = 0
    for ref in refreshes:
        rec = held.get(ref.subkey)
        if rec is None or not ref.expires_at > rec.expires_at:
            ignored += 1
            continue
        out.append(ref.refreshed(rec))
    return out, ignored
