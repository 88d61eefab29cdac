"""Hostile DHT peers over real HTTP on 127.0.0.1: claimed addresses are pinged before they enter
routing; Store floods from fresh keys are limited per IP and the store stays under its byte cap."""

from __future__ import annotations

import dataclasses
import time

import pytest

from protocol.dht.messages import FindValue, Ping, Pong, Store, StoreReply, ValueReply
from protocol.dht.records import RECORD_OVERHEAD_BYTES, sign_record
from protocol.ids import key_id
from protocol.wire.signing import Signer
from tests.node.dht.test_dht import FAST, eventually, info, network, raw, signer

pytestmark = pytest.mark.timeout(30)

DEAD = "http://127.0.0.1:1/v1/dht"  # nothing listens on port 1


async def test_a_claimed_address_enters_routing_only_after_it_answered_our_ping() -> None:
    async with network() as net:
        node, honest, other = await net.add(0), await net.add(1), await net.add(2)
        mallory, sybil = signer(80), signer(81)
        status, reply = await raw(net, node.me.address, mallory, Ping(sender=info(mallory, DEAD)))
        assert status == 200 and isinstance(reply, Pong)  # the request itself is answered
        await eventually(lambda: node.metrics.claims["unanswered"] == 1)
        assert mallory.peer_id not in node.routing and not node.routing.cached(mallory.peer_id)
        pings = node.metrics.rpcs_out["Ping"]
        await raw(
            net, node.me.address, sybil, Ping(sender=info(sybil, DEAD))
        )  # a fresh key, same address
        assert node.metrics.claims["ignored"] == 1 and node.metrics.rpcs_out["Ping"] == pings
        # someone else's live address: that node refuses our ping, which is sealed for mallory
        await raw(net, node.me.address, mallory, Ping(sender=info(mallory, other.me.address)))
        await eventually(lambda: node.metrics.claims["unanswered"] == 2)
        assert mallory.peer_id not in node.routing and not node.routing.cached(mallory.peer_id)
        assert (
            node.metrics.failures["status 403"] == 1
            and other.metrics.refusals["NotAuthorized"] == 1
        )
        assert node.metrics.failures["unreachable (ClientConnectorError)"] == 1
        # an honest node that answers gets in
        assert await honest.ping(node.me.address) == node.me
        await eventually(lambda: node.routing.get(honest.peer_id) == honest.me)
        assert node.metrics.claims["answered"] >= 1
        # a node we contact ourselves and that answers needs no claim
        assert await node.ping(other.me.address) == other.me
        assert node.routing.get(other.peer_id) == other.me


async def test_a_proven_claim_is_not_pinged_again_though_its_bucket_had_no_room() -> None:
    # one contact a bucket and no replacement cache: a second sender of a full bucket fits nowhere
    cfg = dataclasses.replace(FAST, k=1, replacement_cache=0)
    async with network() as net:
        node = await net.add(0, cfg)
        first = node.routing.bucket_index
        a, b = [i for i in range(1, 64) if first(signer(i).peer_id) == 0][:2]
        one, two = await net.add(a, cfg), await net.add(b, cfg)
        for n, sender in enumerate((one, two), 1):
            assert await sender.ping(node.me.address) == node.me
            await eventually(lambda n=n: node.metrics.claims["answered"] >= n)  # type: ignore[misc]
        assert node.routing.get(one.peer_id) == one.me and two.peer_id not in node.routing
        pings, queued = node.metrics.rpcs_out["Ping"], node.metrics.claims["queued"]
        for _ in range(3):  # proven within claim_retry_s: seen, no claim, no ping
            assert await two.ping(node.me.address) == node.me
        assert node.metrics.claims["queued"] == queued and node.claims.pending == 0
        assert node.metrics.rpcs_out["Ping"] == pings and two.peer_id not in node.routing


async def test_a_flood_of_claims_from_fresh_keys_is_bounded_and_paced() -> None:
    cfg = dataclasses.replace(FAST, max_claims=8, claim_rate=0.0, claim_burst=5, max_claim_pings=2)
    async with network() as net:
        node = await net.add(0, cfg)
        statuses = []
        for i in range(50):
            s = signer(1000 + i)
            status, _ = await raw(net, node.me.address, s, Ping(sender=info(s, f"{DEAD}/{i}")))
            statuses.append(status)
        assert statuses == [200] * 50
        await eventually(lambda: node.metrics.claims["unanswered"] == 5)  # the burst, then none
        claims = node.metrics.claims
        assert claims["queued"] + claims["dropped"] == 50 and claims["dropped"] >= 50 - 8 - 5
        assert node.claims.pending <= 8 and node.claims.in_flight == 0
        assert node.metrics.rpcs_out["Ping"] == 5 and len(node.routing) == 0
        friend = await net.add(1)
        assert await friend.ping(node.me.address) == node.me  # still serving


async def test_a_store_flood_from_fresh_keys_is_limited_per_ip_and_capped() -> None:
    cap = 24 * (1024 + RECORD_OVERHEAD_BYTES)
    cfg = dataclasses.replace(FAST, store_ip_rate=0.0, store_ip_burst=40, max_store_bytes=cap,
                              max_value_bytes=1024)  # fmt: skip
    async with network() as net:
        node = await net.add(0, cfg)
        members, now = key_id("atoll/demo/members"), time.time()
        honest = sign_record(
            Signer(key_id("honest member")), members, b"http://10.1.2.3:80", now + 20
        )
        assert node.records.put(honest, now, "10.1.2.3").stored  # a member on another host
        statuses = []
        for i in range(60):
            s = signer(2000 + i)
            rec = sign_record(
                s, members if i % 2 else key_id(f"junk {i}"), bytes(1024), now + 80_000 + i
            )
            status, reply = await raw(
                net, node.me.address, s, Store(sender=info(s), records=(rec,))
            )
            statuses.append(status)
            assert status != 200 or (isinstance(reply, StoreReply) and reply.accepted == 1)
        assert statuses == [200] * 40 + [429] * 20  # fresh keys do not escape the IP's budget
        assert node.metrics.refusals["RateLimited"] == 20
        assert node.records.nbytes <= cap and node.records.held_by("127.0.0.1") >= cap - 2 * 2048
        assert node.records.counts["evicted: store full"] == 40 - 23  # its own records, by expiry
        assert honest in node.records.get(members, time.time())


async def test_full_reads_of_a_large_key_from_one_address_are_refused_past_its_read_budget() -> (
    None
):
    """A FindValue of a key holding 1,000 records costs the responder ~12 ms of its event loop
    (the answer built and sealed) and the asker one signature (~0.1 ms): before reads were
    metered, one address reading such a key a few dozen times a second held a peer's loop.
    The records answers carry to one address are metered (``ReadLimits``): past the burst a read
    is a 429 before its answer is built, and what the address got stays within the budget."""
    async with network() as net:
        # no refill: what one address may read is the burst, whatever the box's load
        node = await net.add(0, dataclasses.replace(FAST, read_ip_rate=0.0, read_ip_burst=4500))
        key, now = key_id("atoll/large"), time.time()
        writers = [Signer.from_seed(i.to_bytes(32, "big")) for i in range(1, 1001)]
        records = [sign_record(w, key, b"v" * 700, now + 600) for w in writers]
        publisher = signer(90)
        for i in range(0, len(records), 64):
            status, reply = await raw(
                net,
                node.me.address,
                publisher,
                Store(sender=info(publisher), records=tuple(records[i : i + 64])),
            )
            assert status == 200 and isinstance(reply, StoreReply) and reply.accepted > 0, reply
        assert len(node.records.get(key, time.time())) == 1000
        reader, got, statuses = signer(91), 0, []
        for _ in range(20):
            status, reply = await raw(
                net, node.me.address, reader, FindValue(sender=info(reader), key=key)
            )
            statuses.append(status)
            if isinstance(reply, ValueReply):
                got += len(reply.records)
        assert node.metrics.refusals["RateLimited"] == 15
        # four reads of 1,000 records leave 500 of the 4,500: the fifth is answered (charged
        # after it, into debt), every later one refused before its answer is built
        assert statuses == [200] * 5 + [429] * 15 and got == 5 * 1000
