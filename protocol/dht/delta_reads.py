"""Delta reads: the tags a FIND_VALUE names for the records its reader holds, and what a
responder leaves out for them.

A reader that already holds records under a key names them in its FIND_VALUE as
``known_tag``s (the first ``KNOWN_TAG_ID_BYTES`` of the subkey and the expiry it holds);
``unknown_to`` is what a responder then sends: only records newer than the reader's, plus a count
of the records it held and left out, so "I hold the value, you have it already" costs a few bytes
instead of every member's record. A reader can only make itself miss records by naming tags;
a publisher cannot make anyone miss another's record without a 128-bit prefix collision on
the other's peer id.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence

from protocol.dht.signed_record import SignedRecord
from protocol.errors import DecodeError

__all__ = [
    "KNOWN_TAG_BYTES",
    "KNOWN_TAG_ID_BYTES",
    "known_tag",
    "known_tags",
    "only_subkeys",
    "unknown_to",
]

KNOWN_TAG_ID_BYTES = 16  # of the subkey: a forged match needs a 128-bit prefix collision
KNOWN_TAG_BYTES = KNOWN_TAG_ID_BYTES + 8  # ... then the expiry held, as a little-endian float64
_EXPIRY = struct.Struct("<d")


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
