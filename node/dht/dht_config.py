"""A DHT node's parameters (``DHTConfig``) and counters (``DHTMetrics``), shared by its serving
side (``node.dht.kademlia``) and its client side (``node.dht.lookups``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from protocol.dht.records import DEFAULT_MAX_VALUE_BYTES

__all__ = ["DHTConfig", "DHTMetrics"]


@dataclass(frozen=True, slots=True)
class DHTConfig:
    """Kademlia parameters, timeouts and caps of one node."""

    k: int = 20  # bucket size and replication factor
    alpha: int = 3  # lookup queries in flight
    request_timeout_s: float = 5.0
    lookup_timeout_s: float = 30.0
    refresh_interval_s: float = 3600.0  # refresh a bucket idle this long (paper: an hour)
    republish_interval_s: float = 3600.0  # re-sign our records this often (or at half their ttl)
    maintenance_period_s: float = 60.0  # how often run() wakes; 0: start() does not spawn it
    record_ttl_cap_s: float = 24 * 3600.0
    store_rate: float = 10.0  # Store requests a second per signing key, after...
    store_burst: float = 50.0  # ...a burst of this many
    store_ip_rate: float = 100.0  # records stored a second per requester IP (IPv6: per /64)...
    store_ip_burst: float = 1000.0  # ...after a burst of this many
    read_ip_rate: float = 5_000.0  # records FindValue answers carry a second per requester IP...
    read_ip_burst: float = 20_000.0  # ...after a burst of this many
    max_store_bytes: int = 64 << 20  # values plus 1 KiB a record (RECORD_OVERHEAD_BYTES)
    max_subkeys_per_key: int = 1_000
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_request: int = 1 << 20  # bytes of a sealed request (Store is at most 64 records)
    max_reply: int = 8 << 20  # bytes of a sealed reply (a ValueReply of many subkeys)
    max_failures: int = 3  # RPC failures before a contact is evicted
    replacement_cache: int = 10
    max_background_pings: int = 16
    ping_fresh_s: float = 60.0  # a full bucket's oldest contact heard from this recently is alive
    max_claims: int = 64  # senders' claimed addresses waiting for our ping...
    claim_rate: float = 10.0  # ...pinged at this many a second, after...
    claim_burst: float = 50.0  # ...a burst of this many...
    max_claim_pings: int = 8  # ...with at most this many in flight
    claim_retry_s: float = 60.0  # an address that did not answer is not pinged again this soon
    # a Store reuses the nodes a lookup found this long (0: look up every time), merged with
    # nearer ones the routing table learns since, and looks up again once fewer than half took it:
    # at 60 s the lookups were most of a steady peer's FindNode (~8 requests a minute at 32 peers)
    store_lookup_reuse_s: float = 300.0


@dataclass(slots=True)
class DHTMetrics:
    """Counters of one node. ``refusals``: inbound requests or records refused, by error class;
    ``failures``: outbound calls that failed, by kind; ``claims``: what became of addresses that
    senders claimed (queued, dropped, answered, unanswered); hops: completed lookups by hop
    count. The record store counts its own evictions (``records.counts``)."""

    rpcs_in: Counter[str] = field(default_factory=Counter)
    rpcs_out: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    claims: Counter[str] = field(default_factory=Counter)  # senders' claimed addresses, by outcome
    refreshes: Counter[str] = field(default_factory=Counter)  # record refreshes read (no value)
    node_hops: Counter[int] = field(default_factory=Counter)
    value_hops: Counter[int] = field(default_factory=Counter)
