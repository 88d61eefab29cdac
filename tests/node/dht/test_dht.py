"""The DHT node over real HTTP on 127.0.0.1: a handful of nodes on one server, one process."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest

from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.route import DHTRouter
from node.wire.transport import Transport
from protocol.dht.messages import FindNode, FindValue, Ping, Pong, Store, StoreReply
from protocol.dht.records import SignedRecord, known_tags, record_signing_bytes, sign_record
from protocol.errors import LocalProtocolError
from protocol.ids import key_id, xor_distance
from protocol.wire.codec import encode
from protocol.wire.messages import Hello, Message, PeerInfo
from protocol.wire.signing import ReplayWindow, Signer, open_sealed, seal

pytestmark = pytest.mark.timeout(20)

FAST = DHTConfig(maintenance_period_s=0, request_timeout_s=3.0, lookup_timeout_s=10.0)


def signer(i: int) -> Signer:
    return Signer(hashlib.sha256(f"test-dht/{i}".encode()).digest())


class Net:
    """DHT nodes on one transport and router; closed on exit."""

    def __init__(self, transport: Transport, router: DHTRouter) -> None:
        self.transport, self.router = transport, router
        self.nodes: list[DHTNode] = []

    async def add(self, i: int, cfg: DHTConfig = FAST, *, dialable: bool = True,
                  clock: Callable[[], float] = time.time) -> DHTNode:  # fmt: skip
        address = self.router.url(str(i)) if dialable else ""
        node = DHTNode(signer(i), self.transport, address, cfg, clock=clock)
        if dialable:
            self.router.mount(node, str(i))
        await node.start()
        self.nodes.append(node)
        return node

    async def kill(self, node: DHTNode) -> None:
        self.router.unmount(node.me.address.rsplit("/", 1)[1])
        await node.close()


@asynccontextmanager
async def network() -> AsyncIterator[Net]:
    transport = Transport()
    router = DHTRouter(transport)
    await transport.start()
    net = Net(transport, router)
    try:
        yield net
    finally:
        for node in net.nodes:
            await node.close()
        await transport.close()


async def joined(net: Net, n: int, cfg: DHTConfig = FAST) -> list[DHTNode]:
    """``n`` nodes, every one bootstrapped from node 0."""
    nodes = [await net.add(i, cfg) for i in range(n)]
    for node in nodes[1:]:
        assert await node.bootstrap([nodes[0].me.address]) == 1
    return nodes


async def _eight_members(net: Net) -> tuple[list[DHTNode], DHTNode, bytes]:
    """Eight joined nodes that each store a ~220-byte record under one key, and a reader that
    cannot be dialled, bootstrapped from node 0: (nodes, reader, key)."""
    nodes = await joined(net, 8)
    reader = await net.add(99, dialable=False)
    assert await reader.bootstrap([nodes[0].me.address]) == 1
    key = key_id("swarm/members")
    for node in nodes:
        assert await node.store(key, b"http://member:1/" + bytes(200), 60) == 8
    return nodes, reader, key


async def raw(
    net: Net, address: str, sender: Signer, msg: Message | bytes
) -> tuple[int, Message | bytes]:
    """POST one sealed message (or raw bytes); the status and the opened reply (or error body)."""
    to = next((n.peer_id for n in net.nodes if n.me.address == address), b"")  # the addressed node
    body = msg if isinstance(msg, bytes) else sealed(sender, msg, to)
    status, buf, used, _ = await net.transport.request(
        "POST", address, chunks=[body], size=len(body)
    )
    try:
        data = bytes(memoryview(buf)[:used])
    finally:
        net.transport.pool.give(buf)
    if status != 200:
        return status, data
    return status, open_sealed(
        data, now=time.time(), replay=ReplayWindow(), max_size=1 << 20
    ).message


def sealed(sender: Signer, msg: Message, to: bytes = b"") -> bytes:
    return seal(encode(msg), sender, now=time.time(), nonce=os.urandom(16), recipient=to).tobytes()


def info(s: Signer, address: str = "") -> PeerInfo:
    return PeerInfo(peer_id=s.peer_id, address=address)


async def eventually(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


# ── joining and lookups ─────────────────────────────────────────────────────────────────────


async def test_bootstrap_from_one_entry_then_find_node_returns_true_closest() -> None:
    cfg = dataclasses.replace(FAST, k=4)
    async with network() as net:
        nodes = await joined(net, 10, cfg)
        for node in nodes:
            await node.maintain()  # the join refresh of every bucket
        assert all(len(n.routing) >= 3 for n in nodes)
        for t in range(5):
            target = key_id(f"target {t}")
            for node in nodes:
                others = sorted((n for n in nodes if n is not node),
                                key=lambda n: xor_distance(n.peer_id, target))  # fmt: skip
                result = await node.find_node(target)
                assert [c.peer_id for c in result.closest] == [n.peer_id for n in others[:4]]
        assert sum(nodes[0].metrics.node_hops.values()) > 0
        assert nodes[0].metrics.rpcs_in["FindNode"] > 0


async def test_store_and_get_round_trip_newest_per_subkey() -> None:
    async with network() as net:
        nodes = await joined(net, 8)
        key = key_id("swarm/members")
        assert await nodes[2].store(key, b"first", 60) == 8  # k = 20 > 8: every node holds it
        assert await nodes[5].store(key, b"other writer", 60) == 8
        assert await nodes[2].store(key, b"second", 120) == 8  # a later expiry replaces
        records = await nodes[7].get(key)
        by_writer = {r.subkey: r.value for r in records}
        assert by_writer == {nodes[2].peer_id: b"second", nodes[5].peer_id: b"other writer"}
        assert await nodes[3].get(key_id("never stored")) == []
        assert nodes[7].metrics.value_hops


async def test_a_node_among_the_nearest_reads_a_key_from_its_own_store() -> None:
    """``held_near``: what a node among the ``k`` nearest holds, read with no request; None
    from a node farther out, from one behind NAT, and for a key nobody stored."""
    cfg = dataclasses.replace(FAST, k=4)
    async with network() as net:
        nodes = await joined(net, 8, cfg)
        for node in nodes:
            await node.maintain()
        key = key_id("swarm/members")
        await nodes[1].store(key, b"record", 60)
        by_distance = sorted(nodes, key=lambda n: xor_distance(n.peer_id, key))
        sent = net.transport.bytes_sent
        near = by_distance[0].held_near(key)
        assert near is not None and [r.value for r in near] == [b"record"]
        assert net.transport.bytes_sent == sent  # read locally
        assert by_distance[-1].held_near(key) is None  # not among the 4 nearest
        assert by_distance[0].held_near(key_id("never stored")) is None
        hidden = await net.add(99, cfg, dialable=False)
        assert hidden.held_near(key) is None


async def test_a_delta_read_gets_only_newer_records_for_a_fraction_of_the_bytes() -> None:
    """A reader that names the records it holds (``known``) gets only newer ones; a responder
    holding nothing new still counts as having the value, so the lookup asks no more peers."""
    async with network() as net:
        nodes = await joined(net, 8)
        reader = await net.add(
            99, dialable=False
        )  # holds nothing locally: every record comes over the wire
        assert await reader.bootstrap([nodes[0].me.address]) == 1
        key = key_id("swarm/members")
        for node in nodes:
            assert await node.store(key, b"http://member:1/" + bytes(200), 60) == 8

        def reply_bytes() -> int:  # the test's nodes are mounted at /v1/dht/<i>
            return sum(
                n
                for route, n in net.transport.bytes_by_route.items()
                if route.startswith("reply ") and route.endswith(":FindValue")
            )

        before, asked = reply_bytes(), reader.metrics.rpcs_out["FindValue"]
        full = await reader.get(key, quorum=3)
        full_bytes, full_asked = (
            reply_bytes() - before,
            reader.metrics.rpcs_out["FindValue"] - asked,
        )
        assert {r.subkey for r in full} == {n.peer_id for n in nodes}

        before, asked = reply_bytes(), reader.metrics.rpcs_out["FindValue"]
        assert await reader.get(key, quorum=3, known=known_tags(full)) == []
        assert reader.metrics.rpcs_out["FindValue"] - asked <= full_asked
        assert reply_bytes() - before < full_bytes / 3

        assert await nodes[3].store(key, b"http://member:1/moved", 120) == 8
        newer = await reader.get(key, quorum=3, known=known_tags(full))
        assert [(r.subkey, r.value) for r in newer] == [
            (nodes[3].peer_id, b"http://member:1/moved")
        ]
        # a reader holding more records than a FindValue may name names the first 4096
        many = tuple(os.urandom(16) + bytes(8) for _ in range(5000)) + known_tags(full)
        assert len(await reader.get(key, quorum=3, known=many)) == 8


async def test_a_read_by_content_gets_refreshes_of_republished_values_not_the_values() -> None:
    """``held``: a republication of an unchanged value comes back as a refresh (its new expiry,
    rebuilt on the reader's own value and verified) only for a record due for one, for a
    fraction of a whole read's bytes; a changed value comes back whole; a delta read of one
    responder asks one node at a time."""
    async with network() as net:
        nodes, reader, key = await _eight_members(net)

        def reply_bytes() -> int:
            return sum(
                n
                for route, n in net.transport.bytes_by_route.items()
                if route.startswith("reply ") and route.endswith(":FindValue")
            )

        before = reply_bytes()
        full = await reader.get(key, quorum=1)
        full_bytes = reply_bytes() - before
        for node in nodes:  # every member republishes the same value with a later expiry
            assert await node.store(key, b"http://member:1/" + bytes(200), 120) == 8

        before, asked = reply_bytes(), reader.metrics.rpcs_out["FindValue"]
        assert await reader.get(key, held=full, renew_before=0.0) == []  # none due: left out
        assert reader.metrics.rpcs_out["FindValue"] - asked == 1  # one holder, not alpha = 3
        due = {r.subkey for r in full[:3]}
        renew_before = max(r.expires_at for r in full) + 1.0
        held = [r if r.subkey in due else replace(r, expires_at=renew_before + 5) for r in full]
        before = reply_bytes()
        got = await reader.get(key, held=held, renew_before=renew_before - 1.0)
        assert {r.subkey for r in got} == due
        assert all(r.value == b"http://member:1/" + bytes(200) and r.expires_at > 110 + time.time()
                   for r in got)  # fmt: skip
        assert reader.metrics.refreshes["received"] == 3
        assert reply_bytes() - before < full_bytes / 2

        assert await nodes[3].store(key, b"http://member:1/moved", 120) == 8
        changed = await reader.get(key, held=full, renew_before=0.0)
        assert [(r.subkey, r.value) for r in changed] == [
            (nodes[3].peer_id, b"http://member:1/moved")
        ]


async def test_a_record_stored_on_fewer_replicas_is_held_by_that_many_nearest() -> None:
    """``replicas``: the record goes to that many of the nodes nearest its key (and this one
    too when it is among them), and ``held_near`` with the same count reads it locally only
    there."""
    async with network() as net:
        nodes = await joined(net, 8)
        key = key_id("swarm/roster")
        by_distance = sorted(nodes, key=lambda n: xor_distance(n.peer_id, key))
        assert await by_distance[-1].store(key, b"record", 60, replicas=3) == 3
        holders = [n for n in nodes if n.records.get(key, time.time())]
        assert holders and set(holders) <= set(by_distance[:4]) and len(holders) == 3
        assert by_distance[-1].held_near(key, 3) is None
        assert await by_distance[0].store(key, b"mine", 60, replicas=3) == 4  # 3 and itself
        with pytest.raises(LocalProtocolError):
            await nodes[0].store(key, b"record", 60, replicas=0)


async def test_a_republished_unchanged_value_is_sent_as_a_refresh_and_whole_where_lost() -> None:
    """A republication of the same value goes to the nodes that hold it as a ``Refresh``
    (expiry and signature, for a fraction of a Store's bytes), and whole to a node that lost
    it; every holder ends with the new expiry; a new value goes whole again."""
    async with network() as net:
        nodes = await joined(net, 8)
        key = key_id("swarm/members")
        publisher = max(nodes, key=lambda n: xor_distance(n.peer_id, key))  # not a holder
        value = b"http://member:1/" + bytes(200)
        assert await publisher.store(key, value, 60, replicas=4) == 4
        holders = [n for n in nodes if n.records.get(key, time.time())]

        def sent(kind: str) -> int:  # requests only; the nodes are mounted at /v1/dht/<i>
            routes = net.transport.bytes_by_route.items()
            return sum(n for r, n in routes if not r.startswith("reply ") and r.endswith(kind))

        stored = sent(":Store")
        holders[0].records.prune(time.time() + 1e6)  # this one lost it
        assert await publisher.store(key, value, 120, replicas=4) == 4
        assert publisher.metrics.refreshes["sent"] == 3
        assert publisher.metrics.refreshes["refused, stored whole"] == 1
        for node in holders:
            (held,) = node.records.get(key, time.time())
            assert held.value == value and held.expires_at > time.time() + 100
        resent, refreshed = sent(":Store") - stored, sent(":Refresh")
        assert 0 < refreshed < 3 * resent  # three refreshes cost less than three whole stores
        assert await publisher.store(key, b"http://member:1/moved", 120, replicas=4) == 4
        assert publisher.metrics.refreshes["sent"] == 3  # a new value is stored whole


async def test_a_lookup_by_subkey_gets_those_records_alone_and_caches_nothing() -> None:
    """``only``: the records of the named subkeys, from a reader with nothing stored locally,
    for a fraction of a whole read's bytes; a subkey nobody stored gets nothing."""
    async with network() as net:
        nodes, reader, key = await _eight_members(net)
        sent = net.transport.bytes_sent
        whole = await reader.get(key)
        whole_bytes, sent = net.transport.bytes_sent - sent, net.transport.bytes_sent
        wanted = (nodes[2].peer_id, nodes[6].peer_id)
        got = await reader.get(key, only=tuple(p[:16] for p in wanted))
        assert len(whole) == 8 and sorted(r.subkey for r in got) == sorted(wanted)
        assert net.transport.bytes_sent - sent < whole_bytes / 2
        assert await reader.get(key, only=(bytes(16),)) == []
        assert len(await reader.get(key)) == 8  # nothing partial was cached in between


async def test_a_republication_reuses_its_lookup_until_the_neighbourhood_fails() -> None:
    async with network() as net:
        nodes = await joined(net, 6)
        key = key_id("swarm/members")
        writer = nodes[2]
        assert await writer.store(key, b"v1", 60) == 6
        lookups = writer.metrics.rpcs_out["FindNode"]
        assert await writer.store(key, b"v2", 60) == 6  # within store_lookup_reuse_s: no lookup
        assert writer.metrics.rpcs_out["FindNode"] == lookups
        assert {r.value for r in await nodes[5].get(key)} == {b"v2"}
        for dead in nodes[3:]:
            await net.kill(dead)
        assert await writer.store(key, b"v3", 60) == 3  # half the nodes it reused are gone...
        assert writer.metrics.rpcs_out["FindNode"] == lookups
        assert await writer.store(key, b"v4", 60) == 3  # ...so the next one looks the key up again
        assert writer.metrics.rpcs_out["FindNode"] > lookups
    async with network() as net:
        nodes = await joined(net, 4, dataclasses.replace(FAST, store_lookup_reuse_s=0))
        lookups = nodes[1].metrics.rpcs_out["FindNode"]
        await nodes[1].store(key, b"v1", 60)
        await nodes[1].store(key, b"v2", 60)
        assert nodes[1].metrics.rpcs_out["FindNode"] > lookups + 1


async def test_a_node_nearer_the_key_that_joined_since_the_lookup_takes_the_republication() -> None:
    """A republication reuses its lookup for ``store_lookup_reuse_s`` (minutes: one lookup a
    record every few minutes, not every minute), yet stores on a node nearer the key that joined
    meanwhile: the routing table learned it (its join reached us), and the targets merge it."""
    from protocol.ids import xor_distance

    async with network() as net:
        nodes = await joined(net, 8)
        key = key_id("swarm/roster")
        writer = nodes[2]
        assert await writer.store(key, b"v1", 60, replicas=3) == 3
        lookups = writer.metrics.rpcs_out["FindNode"]
        far = min(xor_distance(n.peer_id, key) for n in nodes)
        i = next(i for i in range(100, 10_000) if xor_distance(signer(i).peer_id, key) < far)
        newcomer = await net.add(i)
        assert await newcomer.bootstrap([writer.me.address]) == 1
        async with asyncio.timeout(10):  # the writer pings the newcomer's claim, then holds it
            while newcomer.peer_id not in writer.routing:
                await asyncio.sleep(0.01)
        assert await writer.store(key, b"v2", 60, replicas=3) == 3
        assert writer.metrics.rpcs_out["FindNode"] == lookups  # no second lookup
        assert [r.value for r in newcomer.records.get(key, time.time())] == [b"v2"]


async def test_node_behind_nat_stores_and_gets_but_is_never_routed() -> None:
    async with network() as net:
        nodes = await joined(net, 6)
        nat = await net.add(99, dialable=False)
        assert await nat.bootstrap([nodes[0].me.address]) == 1
        key = key_id("from behind nat")
        assert await nat.store(key, b"hello", 60) == 6  # held by every dialable node, not itself
        assert [r.value for r in await nat.get(key)] == [b"hello"]
        assert [r.value for r in await nodes[4].get(key)] == [b"hello"]
        await nodes[3].find_node(nat.peer_id)
        for node in nodes:
            assert nat.peer_id not in node.routing and not node.routing.cached(nat.peer_id)
            assert all(c.address for c in node.routing.contacts())
        assert len(nat.records) == 0


async def test_dead_peers_fail_lookups_over_to_live_ones_and_are_evicted() -> None:
    cfg = dataclasses.replace(FAST, max_failures=1)
    async with network() as net:
        nodes = await joined(net, 8, cfg)
        key = key_id("survives")
        await nodes[1].store(key, b"v", 60)
        dead = nodes[4]
        await net.kill(dead)
        assert [r.value for r in await nodes[6].get(key)] == [b"v"]
        for node in nodes[:4]:
            result = await node.find_node(dead.peer_id)
            assert dead.peer_id not in [c.peer_id for c in result.closest]
            assert dead.peer_id not in node.routing
        assert any(
            k.startswith("status 404") for k in nodes[0].metrics.failures
        )  # its name is unmounted


async def test_full_bucket_pings_oldest_and_replaces_it_when_dead() -> None:
    cfg = dataclasses.replace(FAST, k=1, ping_fresh_s=0.0, replacement_cache=2)
    async with network() as net:
        a = await net.add(0, cfg)
        bucket = a.routing.bucket_index
        same = [i for i in range(1, 60) if bucket(signer(i).peer_id) == 0][:2]  # half of all ids
        old, new = await net.add(same[0], cfg), await net.add(same[1], cfg)
        assert await old.ping(a.me.address) is not None
        await eventually(lambda: a.routing.get(old.peer_id) is not None)  # a pinged it back
        await net.kill(old)
        assert await new.ping(a.me.address) is not None  # bucket full: a probes old, finds it dead
        await eventually(lambda: a.routing.get(new.peer_id) is not None)
        assert old.peer_id not in a.routing


async def test_a_peer_default_node_shares_the_server_with_named_ones() -> None:
    async with network() as net:
        default = DHTNode(signer(0), net.transport, net.router.url(), FAST)
        net.router.mount(default)
        await default.start()
        net.nodes.append(default)
        named = await net.add(1)
        assert default.me.address == net.transport.url + "/v1/dht"
        assert await named.ping(default.me.address) == default.me
        await eventually(lambda: default.routing.get(named.peer_id) == named.me)
        with pytest.raises(LocalProtocolError):
            net.router.mount(named, "1")  # name taken
        with pytest.raises(LocalProtocolError):
            await named.store(b"short key", b"v", 60)


# ── maintenance ─────────────────────────────────────────────────────────────────────────────


async def test_maintain_republishes_before_expiry_and_prunes_expired() -> None:
    now = [time.time()]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    async with network() as net:
        nodes = [await net.add(i, clock=clock) for i in range(5)]
        for node in nodes[1:]:
            await node.bootstrap([nodes[0].me.address])
        key = key_id("republished")
        await nodes[1].store(key, b"v", 100)  # due for republish at half its ttl
        await nodes[2].store(key_id("left to expire"), b"w", 100)
        nodes[2].forget(key_id("left to expire"))
        first = nodes[3].records.get(key, now[0])[0].expires_at
        now[0] += 60
        report = await nodes[1].maintain()
        assert report.republished == 1
        assert nodes[3].records.get(key, now[0])[0].expires_at == pytest.approx(first + 60)
        now[0] += 60  # the forgotten record expires; the republished one lives on
        assert (await nodes[3].maintain()).pruned == 1
        assert [r.value for r in await nodes[4].get(key)] == [b"v"]
        now[0] += FAST.refresh_interval_s  # every bucket idle that long is refreshed
        report = await nodes[4].maintain()
        assert report.refreshed > 0


async def test_run_republishes_in_the_background_until_close() -> None:
    now = [time.time()]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    looping = dataclasses.replace(FAST, maintenance_period_s=0.02)
    async with network() as net:
        holder, writer = await net.add(0, clock=clock), await net.add(1, looping, clock=clock)
        await writer.bootstrap([holder.me.address])
        key = key_id("kept alive by run()")
        assert await writer.store(key, b"v", 10) == 2

        def expiry() -> float:
            return holder.records.get(key, now[0])[0].expires_at

        first = expiry()
        now[0] += 6  # past half the ttl: run() republishes with a later expiry
        await eventually(lambda: expiry() > first)
        await writer.close()  # cancels run() and waits for it
        second = expiry()
        now[0] += 6
        await holder.maintain()
        assert expiry() == second  # nothing runs after close


# ── refusals ────────────────────────────────────────────────────────────────────────────────


def forged(key: bytes, value: bytes, expires_at: float, *, signed_by: Signer,
           subkey: bytes | None = None) -> SignedRecord:  # fmt: skip
    sub = subkey or signed_by.peer_id
    sig = signed_by.sign(record_signing_bytes(key, sub, value, expires_at))
    return SignedRecord(key=key, subkey=sub, value=value, expires_at=expires_at,
                        public_key=signed_by.public_key, signature=sig)  # fmt: skip


async def test_bad_records_are_refused_with_reasons() -> None:
    async with network() as net:
        node = await net.add(0, dataclasses.replace(FAST, max_value_bytes=64, record_ttl_cap_s=600))
        me, other = signer(50), signer(51)
        key, now = key_id("k"), time.time()
        good = sign_record(me, key, b"ok", now + 60)
        bad_sig = dataclasses.replace(good, value=b"tampered")
        expired = sign_record(me, key, b"old", now - 5)
        oversized = sign_record(me, key, b"x" * 100, now + 60)
        too_long = sign_record(me, key, b"ttl", now + 3600)
        stolen = forged(key, b"mine now", now + 60, signed_by=me, subkey=other.peer_id)
        records = (good, bad_sig, expired, oversized, too_long, stolen)
        status, reply = await raw(net, node.me.address, me, Store(sender=info(me), records=records))
        assert status == 200 and isinstance(reply, StoreReply)
        assert reply.accepted == 1
        kinds = [r.split(":")[1].strip() for r in reply.reasons]
        assert kinds == ["BadSignature", "Stale", "Oversize", "Oversize", "NotAuthorized"]
        assert all(len(r) > 30 for r in reply.reasons)  # each says why
        refusals = node.metrics.refusals
        assert refusals["record Oversize"] == 2 and refusals["record BadSignature"] == 1
        assert refusals["record Stale"] == 1 and refusals["record NotAuthorized"] == 1
        assert [r.value for r in node.records.get(key, time.time())] == [b"ok"]


async def test_store_flood_is_rate_limited_while_others_still_store() -> None:
    async with network() as net:
        node = await net.add(0, dataclasses.replace(FAST, store_rate=0.0, store_burst=5))
        flooder, polite = signer(60), signer(61)
        key = key_id("flood")
        statuses = []
        for i in range(9):
            rec = sign_record(flooder, key, b"%d" % i, time.time() + 60 + i)
            status, _ = await raw(
                net, node.me.address, flooder, Store(sender=info(flooder), records=(rec,))
            )
            statuses.append(status)
        assert statuses == [200] * 5 + [429] * 4
        rec = sign_record(polite, key, b"polite", time.time() + 60)
        status, reply = await raw(
            net, node.me.address, polite, Store(sender=info(polite), records=(rec,))
        )
        assert status == 200 and isinstance(reply, StoreReply) and reply.accepted == 1
        status, _ = await raw(net, node.me.address, flooder, Ping(sender=info(flooder)))
        assert status == 200  # only Store is metered
        assert node.metrics.refusals["RateLimited"] == 4


async def test_garbage_and_forgeries_get_4xx_and_the_node_keeps_working() -> None:
    async with network() as net:
        node, friend = await net.add(0), await net.add(1)
        url, mallory, victim = node.me.address, signer(70), signer(71)
        ping = sealed(mallory, Ping(sender=info(mallory)))
        tampered = bytearray(ping)
        tampered[20] ^= 0xFF  # inside the signed public key
        cases: list[tuple[bytes, int]] = [
            (b"not a sealed message" * 10, 413),  # garbage: its "envelope length" is huge
            (b"\x00\x00\x00\x08" + os.urandom(64), 400),  # garbage with a plausible length
            (b"", 400),  # empty body
            (bytes(tampered), 401),  # bad envelope signature
            (ping, 200),
            (ping, 409),  # replayed
            (
                sealed(mallory, Ping(sender=info(victim, "http://127.0.0.1:1/x"))),
                403,
            ),  # not the signer
            (
                sealed(mallory, Hello(swarm="s", peer=info(mallory), roles=(), step=0)),
                403,
            ),  # not DHT
        ]
        for body, expected in cases:
            status, _ = await raw(net, url, mallory, body)
            assert status == expected, body[:40]
        status, _ = await raw(net, url + "x", mallory, sealed(mallory, Ping(sender=info(mallory))))
        assert status == 404  # no node mounted at that path
        assert sum(node.metrics.refusals.values()) == 7 and node.metrics.refusals["Replay"] == 1
        assert victim.peer_id not in node.routing
        bad_tags = object.__new__(FindValue)  # past the sender's own checks: a tag one byte short
        for name, value in dict(
            sender=info(mallory), key=bytes(32), known=(b"t" * 23,), only=(), same=(), renew=()
        ).items():
            object.__setattr__(bad_tags, name, value)
        status, body = await raw(net, url, mallory, sealed(mallory, bad_tags))
        assert status == 400 and b"24 bytes" in body  # type: ignore[operator]
        assert await friend.ping(url) == node.me  # still serving
        status, reply = await raw(
            net, url, mallory, FindNode(sender=info(mallory), target=bytes(32))
        )
        assert status == 200 and not isinstance(reply, bytes)
        assert isinstance((await raw(net, url, mallory, Ping(sender=info(mallory))))[1], Pong)


async def test_a_cancelled_call_gives_the_reply_buffer_back_only_after_its_reader_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A big reply is verified in a worker thread that reads the pooled buffer: when the call is
    cancelled meanwhile, the buffer must not go back to the pool (and be reused) before the
    thread is done with it."""
    from node.dht import lookups
    from node.wire.transport import Reply

    events: list[str] = []

    async def slow_open(*_a: object, **_kw: object) -> None:
        await asyncio.to_thread(time.sleep, 0.2)  # a thread hashing the body
        events.append("read")
        raise AssertionError("the call was cancelled: nobody looks at this")

    class OneReply:
        @asynccontextmanager
        async def reply(self, *_a: object, **_kw: object) -> AsyncIterator[Reply]:
            try:
                yield Reply(200, memoryview(bytearray(64)), {})
            finally:
                events.append("given back")

    monkeypatch.setattr(lookups, "open_off_loop", slow_open)
    monkeypatch.setattr(lookups, "split_sealed", lambda body, **_kw: (None, body))
    node = DHTNode(signer(1), OneReply(), "")  # type: ignore[arg-type]
    call = asyncio.create_task(node.caller.call("http://x/v1/dht", Ping(sender=node.me)))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert events == ["read", "given back"]
