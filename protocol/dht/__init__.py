"""Atoll's Kademlia DHT, sans-IO (Maymounkov & Mazières, IPTPS 2002).

``routing``: the k-bucket routing table, which asks for pings instead of sending them.
``lookup``: the iterative FIND_NODE / FIND_VALUE as a state object the node drives.
``records``: signed, expiring key -> subkey records and their store (the import point for
``signed_record``, ``record_store``, ``store_limits`` and ``delta_reads``).
``ratelimit``: token buckets, per peer or address.
``messages``: the DHT's wire messages (type codes 32-63).
"""

from protocol.dht.lookup import Lookup, LookupResult, ResponseNote
from protocol.dht.messages import (
    DHT_MESSAGES,
    REPLY_TO,
    FindNode,
    FindValue,
    NodesReply,
    Ping,
    Pong,
    Store,
    StoreReply,
    ValueReply,
    check_sender,
)
from protocol.dht.ratelimit import RateLimiter, TokenBucket
from protocol.dht.records import (
    PutResult,
    RecordSigner,
    RecordStore,
    SignedRecord,
    sign_record,
    verify_record,
)
from protocol.dht.routing import PingCandidate, RoutingTable

__all__ = [
    "DHT_MESSAGES",
    "REPLY_TO",
    "FindNode",
    "FindValue",
    "Lookup",
    "LookupResult",
    "NodesReply",
    "Ping",
    "PingCandidate",
    "Pong",
    "PutResult",
    "RateLimiter",
    "RecordSigner",
    "RecordStore",
    "ResponseNote",
    "RoutingTable",
    "SignedRecord",
    "Store",
    "StoreReply",
    "TokenBucket",
    "ValueReply",
    "check_sender",
    "sign_record",
    "verify_record",
]
