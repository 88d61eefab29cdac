"""Iterative lookup: unit behaviour, and a 500-node in-memory Kademlia network driven in a loop."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import pytest

from protocol.dht.lookup import Lookup, LookupResult
from protocol.dht.records import SignedRecord
from protocol.dht.routing import RoutingTable
from protocol.errors import LocalProtocolError
from protocol.ids import xor_distance
from protocol.wire.messages import PeerInfo

TARGET = bytes(32)


def c(n: int) -> PeerInfo:
    """A contact at XOR distance ``n`` from TARGET."""
    return PeerInfo(peer_id=n.to_bytes(32, "big"), address=f"http://sim/{n}")


def fake_record(tag: int) -> SignedRecord:
    return SignedRecord(
        key=TARGET, subkey=bytes([tag]) * 32, value=b"v", expires_at=1.0,
        public_key=bytes(32), signature=bytes(64),
    )  # fmt: skip


# ── unit behaviour ──────────────────────────────────────────────────────────────────────────


def test_queries_closest_first_with_alpha_in_flight() -> None:
    lk = Lookup(TARGET, [c(9), c(3), c(5), c(7)], k=3, alpha=2)
    assert lk.next_queries(0.0) == [c(3), c(5)]
    assert lk.next_queries(0.0) == []  # alpha already in flight
    assert lk.in_flight == 2 and lk.pending() == [c(3), c(5)]
    lk.on_response(c(3).peer_id, [c(1), c(2)], 1.0)
    assert lk.next_queries(1.0) == [c(1)]


def test_done_when_k_closest_answered_and_farther_pending_ignored() -> None:
    lk = Lookup(TARGET, [c(1), c(2), c(3), c(4)], k=2, alpha=3)
    assert lk.next_queries(0.0) == [c(1), c(2)]  # only the k-nearest window is queried
    lk.on_response(c(1).peer_id, [], 1.0)
    assert not lk.done
    lk.on_response(c(2).peer_id, [], 1.0)
    assert lk.done and lk.next_queries(2.0) == []
    res = lk.result()
    assert res.closest == [c(1), c(2)] and res.hops == 1 and res.queried == 2 and not res.found


def test_failure_moves_window_to_next_contact() -> None:
    lk = Lookup(TARGET, [c(1), c(2), c(3)], k=2, alpha=3)
    lk.next_queries(0.0)
    lk.on_failure(c(1).peer_id, 1.0)
    assert lk.next_queries(1.0) == [c(3)]
    lk.on_response(c(2).peer_id, [], 2.0)
    lk.on_response(c(3).peer_id, [], 2.0)
    res = lk.result()
    assert lk.done and res.closest == [c(2), c(3)] and res.failed == 1


def test_closer_contact_from_answer_is_queried_and_hops_counted() -> None:
    lk = Lookup(TARGET, [c(64)], k=1, alpha=1)
    for hop, (asked, told) in enumerate([(64, 32), (32, 8), (8, 1)], start=1):
        assert lk.next_queries(float(hop)) == [c(asked)]
        lk.on_response(c(asked).peer_id, [c(told)], float(hop))
    assert lk.next_queries(9.0) == [c(1)]
    lk.on_response(c(1).peer_id, [c(64)], 9.0)  # rediscovery at a greater depth changes nothing
    res = lk.result()
    assert lk.done and res.closest == [c(1)] and res.hops == 4 and res.queried == 4


def test_unsolicited_and_duplicate_answers_are_ignored_and_counted() -> None:
    lk = Lookup(TARGET, [c(1), c(2)], k=2, alpha=1)
    note = lk.on_response(c(2).peer_id, [c(0)], 0.0)
    assert not note.accepted and "never" not in note.reason and "unqueried" in note.reason
    assert not lk.on_response(c(77).peer_id, [], 0.0).accepted
    lk.next_queries(0.0)
    assert lk.on_response(c(1).peer_id, [], 1.0).accepted
    again = lk.on_response(c(1).peer_id, [c(3)], 1.0)
    assert not again.accepted and "answered" in again.reason
    assert lk.result().ignored == 3 and c(3) not in lk.result().closest


def test_answer_contacts_are_deduped_and_capped_at_k() -> None:
    lk = Lookup(TARGET, [c(100)], k=3, alpha=1, own_id=c(50).peer_id)
    lk.next_queries(0.0)
    undialable = PeerInfo(peer_id=c(1).peer_id)
    note = lk.on_response(c(100).peer_id, [undialable, c(10), c(10), c(50), c(11), c(12)], 1.0)
    assert note.accepted and note.new_contacts == 1 and "over cap" in note.reason
    assert lk.next_queries(1.0) == [c(10)]  # no address, own id (50), beyond cap: never queried


def test_failure_of_peer_not_in_flight_is_a_local_error() -> None:
    lk = Lookup(TARGET, [c(1)])
    with pytest.raises(LocalProtocolError):
        lk.on_failure(c(1).peer_id, 0.0)
    with pytest.raises(LocalProtocolError):
        Lookup(b"short", [])
    with pytest.raises(LocalProtocolError):
        Lookup(TARGET, [], alpha=0)


def test_empty_lookup_is_done_at_once() -> None:
    lk = Lookup(TARGET, [])
    assert lk.done and lk.next_queries(0.0) == []
    assert lk.result() == LookupResult([], (), None, 0, 0, 0, 0)


def test_find_value_stops_at_first_value_and_names_cache_peer() -> None:
    lk = Lookup(TARGET, [c(1), c(2), c(3), c(4)], k=4, alpha=3, find_value=True)
    lk.next_queries(0.0)
    lk.on_response(c(1).peer_id, [], 1.0)
    assert not lk.done
    rec = fake_record(7)
    lk.on_response(c(3).peer_id, [], 1.0, value=[rec])
    res = lk.result()
    assert lk.done and res.found and res.value == (rec,)
    assert res.closest_without_value == c(1) and res.hops == 1


def test_find_value_can_wait_for_several_holders() -> None:
    lk = Lookup(TARGET, [c(1), c(2)], k=2, alpha=2, find_value=True, min_values=2)
    lk.next_queries(0.0)
    lk.on_response(c(1).peer_id, [], 1.0, value=[fake_record(1)])
    assert not lk.done
    lk.on_response(c(2).peer_id, [], 1.0, value=[fake_record(2)])
    res = lk.result()
    assert lk.done and len(res.value) == 2 and res.closest_without_value is None


def test_a_holder_whose_records_are_all_known_to_the_asker_counts_as_a_holder() -> None:
    """Delta reads: "I hold 5 records, all of which you named" ends the lookup like records do;
    an empty answer that claims nothing does not, nor does ``omitted`` in a node lookup."""
    lk = Lookup(TARGET, [c(1), c(2), c(3)], k=3, alpha=3, find_value=True, min_values=2)
    lk.next_queries(0.0)
    lk.on_response(c(1).peer_id, [], 1.0, value=[])
    lk.on_response(c(2).peer_id, [], 1.0, value=[], omitted=5)
    assert not lk.done
    lk.on_response(c(3).peer_id, [], 1.0, value=[fake_record(3)], omitted=4)
    res = lk.result()
    assert lk.done and res.found and res.sources == 2 and len(res.value) == 1
    assert res.closest_without_value == c(1)
    nodes = Lookup(TARGET, [c(1)], k=1, alpha=1)
    nodes.next_queries(0.0)
    nodes.on_response(c(1).peer_id, [], 1.0, omitted=5)
    assert not nodes.result().found


# ── a 500-node network ──────────────────────────────────────────────────────────────────────


@dataclass
class Network:
    rng: random.Random
    contacts: dict[bytes, PeerInfo]
    tables: dict[bytes, RoutingTable]
    dead: set[bytes]

    def seen(self, at: bytes, who: bytes) -> None:
        action = self.tables[at].on_seen(self.contacts[who], 0.0)
        if action is not None:  # in this loop every live oldest answers its ping
            alive = action.oldest.peer_id not in self.dead
            self.tables[at].on_ping_result(action.oldest.peer_id, alive, 0.0)

    def lookup(self, start: bytes, target: bytes, *, learn: bool = False) -> LookupResult:
        """Drive one lookup, answering in-flight queries in random order (no sockets, no time)."""
        lk = Lookup(target, self.tables[start].closest(target), own_id=start)
        pending: list[PeerInfo] = []
        while not lk.done:
            pending += lk.next_queries(0.0)
            peer = pending.pop(self.rng.randrange(len(pending))).peer_id
            if peer in self.dead:
                lk.on_failure(peer, 0.0)
                continue
            if learn:
                self.seen(peer, start)
                self.seen(start, peer)
            lk.on_response(peer, self.tables[peer].closest(target), 0.0)
        return lk.result()


def build_network(n: int, seed: int) -> Network:
    """Nodes join one at a time: a few random earlier nodes as seeds, then a self-lookup (§2.3)."""
    rng = random.Random(seed)
    ids = [rng.randbytes(32) for _ in range(n)]
    net = Network(
        rng,
        {p: PeerInfo(peer_id=p, address=f"http://sim/{i}") for i, p in enumerate(ids)},
        {},
        set(),
    )
    net.tables = {p: RoutingTable(p) for p in ids}
    for j, p in enumerate(ids[1:], start=1):
        for q in rng.sample(ids[:j], min(j, 3)):
            net.seen(p, q)
        net.lookup(p, p, learn=True)
    return net


@pytest.fixture(scope="module")
def network() -> Network:
    return build_network(500, seed=2)


def true_closest(
    net: Network, start: bytes, target: bytes, dead: frozenset[bytes] = frozenset()
) -> list[bytes]:
    live = [p for p in net.tables if p not in dead and p != start]
    return sorted(live, key=lambda p: xor_distance(p, target))[:20]


def test_lookups_find_the_true_k_closest(network: Network) -> None:
    rng = random.Random(11)
    hops = []
    for _ in range(40):
        start, target = rng.choice(list(network.tables)), rng.randbytes(32)
        res = network.lookup(start, target)
        assert [c.peer_id for c in res.closest] == true_closest(network, start, target)
        hops.append(res.hops)
    print(f"median hops {statistics.median(hops)}, max {max(hops)}")
    assert 1 <= statistics.median(hops) <= 6


def test_lookups_survive_a_fifth_of_nodes_failing(network: Network) -> None:
    rng = random.Random(12)
    dead = frozenset(rng.sample(list(network.tables), 100))
    live = [p for p in network.tables if p not in dead]
    network.dead = set(dead)
    try:
        runs = [
            (s, t, network.lookup(s, t))
            for s, t in ((rng.choice(live), rng.randbytes(32)) for _ in range(40))
        ]
    finally:
        network.dead = set()
    exact, recall = 0, []
    for start, target, res in runs:
        got, truth = [c.peer_id for c in res.closest], true_closest(network, start, target, dead)
        assert not dead & set(got)
        exact += got == truth
        recall.append(len(set(got) & set(truth)) / len(truth))
    print(f"exact {exact}/40, mean recall {statistics.mean(recall):.3f}")
    assert exact >= 34 and statistics.mean(recall) >= 0.97
    assert sum(res.failed for _, _, res in runs) > 40  # dead peers were met, and routed around
    assert 1 <= statistics.median(res.hops for _, _, res in runs) <= 8
