"""The DHT's wire messages (type codes 32-63): Kademlia's four RPCs and their replies.

Theory of operation (Maymounkov & Mazières, "Kademlia", IPTPS 2002, section 2.3). Kademlia has
four RPCs: PING probes liveness, FIND_NODE asks for the ``k`` contacts nearest a target id,
FIND_VALUE does the same but returns the stored value instead when the peer holds one, and STORE
asks a peer to hold records. Each request names its ``sender`` so the receiver can add it to its
routing table (``RoutingTable.on_seen``). The envelope that carries a message already proves the
sender's public key; the node calls ``check_sender`` to make sure ``sender.peer_id`` is that
key's id before it trusts the address.

``REPLY_TO`` maps each request to the one reply class the node may accept for it. Every class
is a frozen, slotted, keyword-only dataclass registered with ``protocol.wire.messages``; field
types and generic caps are checked there, the counts below here, all raising ``DecodeError``.
Records in ``Store`` and ``ValueReply`` are only shaped on decode: the node runs
``verify_record`` (or ``RecordStore.put``) on each before using it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.dht.records import (
    CONTENT_TAG_BYTES,
    KNOWN_TAG_BYTES,
    KNOWN_TAG_ID_BYTES,
    RecordRefresh,
    SignedRecord,
)
from protocol.errors import DecodeError, NotAuthorized
from protocol.ids import ID_BYTES, peer_id_from_public_key
from protocol.wire.messages import Message, PeerInfo, register

__all__ = [
    "DHT_MESSAGES",
    "MAX_ONLY_SUBKEYS",
    "MAX_REPLY_PEERS",
    "MAX_REPLY_RECORDS",
    "MAX_STORE_RECORDS",
    "REPLY_TO",
    "FindNode",
    "FindValue",
    "NodesReply",
    "Ping",
    "Pong",
    "Refresh",
    "Store",
    "StoreReply",
    "ValueReply",
    "check_sender",
]

MAX_REPLY_PEERS = 64  # k = 20 is what we send; room for peers configured with a larger k
MAX_STORE_RECORDS = 64
MAX_REPLY_RECORDS = 4096  # one key's subkeys, e.g. a large swarm's member list
MAX_ONLY_SUBKEYS = 64  # subkeys one FindValue may single out (``FindValue.only``)


def _require(ok: bool, reason: str) -> None:
    if not ok:
        raise DecodeError(reason)


def _id(value: bytes, where: str) -> None:
    _require(len(value) == ID_BYTES, f"{where} must be {ID_BYTES} bytes, got {len(value)}")


def _at_most(items: tuple[object, ...], cap: int, where: str) -> None:
    _require(len(items) <= cap, f"{where}: {len(items)} items exceed the cap {cap}")


def check_sender(sender: PeerInfo, public_key: bytes) -> None:
    """Raise ``NotAuthorized`` unless ``sender`` is the peer whose key signed the envelope."""
    if sender.peer_id != peer_id_from_public_key(public_key):
        raise NotAuthorized(f"sender {sender.peer_id.hex()[:16]} is not the envelope's signer")


@register(32)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ping(Message):
    """Are you alive? (the routing table's ``PingCandidate``)."""

    sender: PeerInfo


@register(33)
@dataclass(frozen=True, slots=True, kw_only=True)
class Pong(Message):
    """I am alive."""

    sender: PeerInfo


@register(34)
@dataclass(frozen=True, slots=True, kw_only=True)
class FindNode(Message):
    """Which contacts do you know nearest ``target``?"""

    sender: PeerInfo
    target: bytes

    def _check(self) -> None:
        _id(self.target, "FindNode.target")


@register(35)
@dataclass(frozen=True, slots=True, kw_only=True)
class FindValue(Message):
    """Send me the records under ``key``, or the contacts you know nearest it; leave out the
    records ``known`` names (``protocol.dht.records.known_tag``: I hold them or newer ones).
    ``only``: send only the records whose subkeys start with one of these prefixes (a lookup of
    a few members by id, ``protocol.dht.records.only_subkeys``); empty: every record.
    ``same`` and ``renew`` name records by content (``protocol.dht.records.content_tag``): leave
    out one whose value is unchanged, or send only its newer expiry (``ValueReply.refreshes``);
    ``protocol.dht.delta_reads``. The three tag lists together name at most
    ``MAX_REPLY_RECORDS`` records."""

    sender: PeerInfo
    key: bytes
    known: tuple[bytes, ...] = ()
    only: tuple[bytes, ...] = ()
    same: tuple[bytes, ...] = ()
    renew: tuple[bytes, ...] = ()
    # left out of the bytes when empty, and taken as empty when absent (older senders)
    ADDED: ClassVar[frozenset[str]] = frozenset({"only", "same", "renew"})

    def _check(self) -> None:
        _id(self.key, "FindValue.key")
        tags = len(self.known) + len(self.same) + len(self.renew)
        _require(
            tags <= MAX_REPLY_RECORDS,
            f"FindValue names {tags} records in known, same and renew; the cap is "
            f"{MAX_REPLY_RECORDS}",
        )
        _require(
            all(len(t) == KNOWN_TAG_BYTES for t in self.known),
            f"FindValue.known: every tag must be {KNOWN_TAG_BYTES} bytes",
        )
        _require(
            all(len(t) == CONTENT_TAG_BYTES for t in self.same + self.renew),
            f"FindValue.same and renew: every tag must be {CONTENT_TAG_BYTES} bytes",
        )
        _at_most(self.only, MAX_ONLY_SUBKEYS, "FindValue.only")
        _require(
            all(len(t) == KNOWN_TAG_ID_BYTES for t in self.only),
            f"FindValue.only: every subkey prefix must be {KNOWN_TAG_ID_BYTES} bytes",
        )


@register(36)
@dataclass(frozen=True, slots=True, kw_only=True)
class Store(Message):
    """Please hold these records (each verified by the receiver on its own)."""

    sender: PeerInfo
    records: tuple[SignedRecord, ...]

    def _check(self) -> None:
        _require(len(self.records) > 0, "Store carries no records")
        _at_most(self.records, MAX_STORE_RECORDS, "Store.records")


@register(37)
@dataclass(frozen=True, slots=True, kw_only=True)
class NodesReply(Message):
    """The contacts nearest the target that the replier knows."""

    peers: tuple[PeerInfo, ...]

    def _check(self) -> None:
        _at_most(self.peers, MAX_REPLY_PEERS, "NodesReply.peers")


@register(38)
@dataclass(frozen=True, slots=True, kw_only=True)
class ValueReply(Message):
    """The records held under the key (maybe none) that the asker did not name as known,
    ``omitted``: how many held records were left out as known, and contacts nearer the key;
    ``refreshes``: newer expiries of records the asker named in ``FindValue.renew``."""

    records: tuple[SignedRecord, ...]
    peers: tuple[PeerInfo, ...]
    omitted: int = 0
    refreshes: tuple[RecordRefresh, ...] = ()
    ADDED: ClassVar[frozenset[str]] = frozenset({"refreshes"})

    def _check(self) -> None:
        _at_most(self.records + self.refreshes, MAX_REPLY_RECORDS, "ValueReply.records+refreshes")
        _at_most(self.peers, MAX_REPLY_PEERS, "ValueReply.peers")
        _require(
            0 <= self.omitted <= MAX_REPLY_RECORDS,
            f"ValueReply.omitted must be in [0, {MAX_REPLY_RECORDS}], got {self.omitted}",
        )


@register(39)
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreReply(Message):
    """How many records were stored, and one reason for each that was not."""

    accepted: int
    reasons: tuple[str, ...]

    def _check(self) -> None:
        _require(self.accepted >= 0, f"StoreReply.accepted must be >= 0, got {self.accepted}")
        total = self.accepted + len(self.reasons)
        _require(
            total <= MAX_STORE_RECORDS, f"StoreReply covers {total} > {MAX_STORE_RECORDS} records"
        )


@register(40)
@dataclass(frozen=True, slots=True, kw_only=True)
class Refresh(Message):
    """Please hold these newer expiries of records you hold under ``key`` (a republication
    whose value did not change: ``RecordStore.refresh``); answered with a ``StoreReply``, whose
    refusals name the refreshes of records not held (the sender then stores them whole)."""

    sender: PeerInfo
    key: bytes
    refreshes: tuple[RecordRefresh, ...]

    def _check(self) -> None:
        _id(self.key, "Refresh.key")
        _require(len(self.refreshes) > 0, "Refresh carries no refreshes")
        _at_most(self.refreshes, MAX_STORE_RECORDS, "Refresh.refreshes")


DHT_MESSAGES: tuple[type[Message], ...] = (
    Ping, Pong, FindNode, FindValue, Store, NodesReply, ValueReply, StoreReply, Refresh,
)  # fmt: skip
REPLY_TO: dict[type[Message], type[Message]] = {
    Ping: Pong,
    FindNode: NodesReply,
    FindValue: ValueReply,
    Store: StoreReply,
    Refresh: StoreReply,
}
