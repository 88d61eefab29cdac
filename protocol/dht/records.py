"""Signed, expiring DHT records (key -> subkey -> value) and a store with caps and rate limits.

This module is the import point; the pieces, each with its theory of operation, live in:

- ``protocol.dht.signed_record``: the ``SignedRecord`` wire struct, what its signature covers,
  ``sign_record`` and ``verify_record``;
- ``protocol.dht.record_store``: ``RecordStore``, its caps and room policy (fair share first,
  expiry second), ``PutResult`` and ``source_key``;
- ``protocol.dht.store_limits``: ``StoreLimits``, the token buckets on STORE, ``ReadLimits`` on
  the records FIND_VALUE answers carry, and ``RateLimited``;
- ``protocol.dht.delta_reads``: ``known_tag``/``known_tags`` and ``unknown_to``, so a FIND_VALUE
  answer leaves out the records its reader already holds; ``only_subkeys`` for a FIND_VALUE
  that asks for a few subkeys by id.
"""

from __future__ import annotations

from protocol.dht.delta_reads import (
    CONTENT_TAG_BYTES,
    KNOWN_TAG_BYTES,
    KNOWN_TAG_ID_BYTES,
    Answer,
    answer,
    content_tag,
    known_tag,
    known_tags,
    only_subkeys,
    renewed,
    unknown_to,
)
from protocol.dht.record_store import RECORD_OVERHEAD_BYTES, PutResult, RecordStore, source_key
from protocol.dht.signed_record import (
    DEFAULT_MAX_VALUE_BYTES,
    RECORD_REFRESH_STRUCT_CODE,
    RECORD_STRUCT_CODE,
    RecordRefresh,
    RecordSigner,
    SignedRecord,
    record_signing_bytes,
    sign_record,
    verify_record,
)
from protocol.dht.signed_record import DOMAIN as DOMAIN
from protocol.dht.store_limits import RateLimited, ReadLimits, StoreLimits

__all__ = [
    "CONTENT_TAG_BYTES",
    "DEFAULT_MAX_VALUE_BYTES",
    "KNOWN_TAG_BYTES",
    "KNOWN_TAG_ID_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "RECORD_REFRESH_STRUCT_CODE",
    "RECORD_STRUCT_CODE",
    "Answer",
    "PutResult",
    "RateLimited",
    "ReadLimits",
    "RecordRefresh",
    "RecordSigner",
    "RecordStore",
    "SignedRecord",
    "StoreLimits",
    "answer",
    "content_tag",
    "known_tag",
    "known_tags",
    "only_subkeys",
    "record_signing_bytes",
    "renewed",
    "sign_record",
    "unknown_to",
    "verify_record",
    "source_key",
]
