"""Long-polls wait on events, share their membership reads, and are capped per address in open
swarms; ``/v1/status`` is cached (issue 48: each ``/final`` long-poll looped every 0.1 s and read
the members every 0.5 s, fresh keys bypassed the per-key cap, and every status call walked the
whole DHT store)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import make_mocked_request

from node.wire.admission import ADMITTED, Admitted
from node.wire.transport import Busy
from tests.node.fakes import signer
from tests.node.test_peer import _contribute, _ending_owner

pytestmark = pytest.mark.timeout(60)

LEARNER = signer(5).peer_id


def _counting(node) -> list[int]:  # type: ignore[no-untyped-def]
    """Count the node's end-of-run checks (``tell_expected`` calls)."""
    calls = [0]
    real = node.expected.tell_expected

    async def tell_expected(owner, *, at_end: bool = False) -> int:  # type: ignore[no-untyped-def]
        calls[0] += 1
        return await real(owner, at_end=at_end)

    node.expected.tell_expected = tell_expected
    return calls


async def test_final_long_polls_share_one_membership_read_and_do_not_spin() -> None:
    """Ten final long-polls held 1 s while a learner is still at work cost a couple of shared
    membership reads (they were 10 x 2 reads and 10 x 10 checks), and all of them answer at the
    first read after the learner's "stopped" record appears."""
    node, owner, clock = _ending_owner({LEARNER: True})
    checks = _counting(node)
    polls = [asyncio.create_task(node.finals.wait(owner, 5.0)) for _ in range(10)]
    await asyncio.sleep(1.0)
    assert not any(p.done() for p in polls)
    reads = node.membership.refreshes
    assert 1 <= reads <= 3, reads  # one read per FINAL_READ_S for all ten, not one per poll
    assert checks[0] <= 10 * (reads + 1), checks[0]  # one check per poll per event
    from node.dht.membership import Member, MemberRecord

    stopped = MemberRecord(
        url="http://127.0.0.1:1", roles=("learner",), reachable=False, manifest="m", learning=False
    )
    node.membership.records[LEARNER] = Member(LEARNER, stopped, expires_at=2e9)
    started = time.monotonic()
    finals = await asyncio.gather(*polls)
    assert all(f is owner.latest for f in finals)
    assert time.monotonic() - started < 0.9  # the next shared read (0.5 s), not a timeout


async def test_a_final_long_poll_wakes_when_the_owner_publishes() -> None:
    """The owner still merging the last round: the poll waits on the publication itself (an
    event), not a 0.1 s loop."""
    node, owner, clock = _ending_owner({LEARNER: True})
    waiting = [1]

    async def tell_expected(owner, *, at_end: bool = False) -> int:  # type: ignore[no-untyped-def]
        return waiting[0]

    node.expected.tell_expected = tell_expected
    poll = asyncio.create_task(node.finals.wait(owner, 20.0))
    await asyncio.sleep(0.05)  # waiting for the learner
    waiting[0] = 0  # the last learner's work arrives: merged at the end of its grace window
    assert (await _contribute(owner, LEARNER)).accepted and not owner.idle()
    await asyncio.sleep(0.1)
    assert not poll.done()
    checks = node.finals.final_checks
    clock.advance(1.5)
    published = time.monotonic()
    await owner.tick()  # the grace window ends: merged and published
    final = await asyncio.wait_for(poll, 2.0)
    assert final is owner.latest and owner.version == 4
    assert time.monotonic() - published < 0.1
    assert (
        node.finals.final_checks <= checks + 2
    )  # woken by the publication (and at most one shared read)


async def test_fresh_keys_do_not_buy_more_long_polls_from_one_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In an open swarm a key costs nothing: each fresh key got its own two-per-fragment cap, so
    one address held as many long-polls as it had keys. Now the address is capped whatever keys
    it names (an IPv6 sender at its /64, /56 and /48)."""
    import node.peer.serving as serving
    from protocol.dht.netgroups import PrefixCounts

    monkeypatch.setattr(serving, "MAX_POLLS_PER_ADDRESS", 6)
    node, owner, _ = _ending_owner({})
    node.serving._polls_by_address = PrefixCounts(serving.MAX_POLLS_PER_ADDRESS)

    def poll(n: int, remote: str) -> object:
        request = make_mocked_request(
            "GET", "/v1/fragments/0/next?after=3&wait=5", match_info={"p": "0", "kind": "next"}
        ).clone(remote=remote)
        request[ADMITTED] = Admitted(n.to_bytes(32, "big"), None)  # a fresh key each time
        return request

    attacker = "2a00:1450:4001:812::1"
    held = [asyncio.create_task(node.serving.on_fetch(poll(n, attacker))) for n in range(6)]
    await asyncio.sleep(0.05)
    with pytest.raises(Busy, match="whatever keys"):
        await node.serving.on_fetch(poll(99, attacker))
    for n in range(18):  # other /64s of the same /56: it holds 4 caps in all
        held.append(
            asyncio.create_task(
                node.serving.on_fetch(poll(100 + n, f"2a00:1450:4001:8{0x20 + n:02x}::1"))
            )
        )
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in held)
    with pytest.raises(Busy, match="/56"):
        await node.serving.on_fetch(poll(200, "2a00:1450:4001:8ff::1"))
    other = asyncio.create_task(
        node.serving.on_fetch(poll(500, "203.0.114.9"))
    )  # another address is not affected
    await asyncio.sleep(0.05)
    assert not other.done()
    await owner.retire()
    await asyncio.gather(*held, other)
    assert not node.serving._polls_by_address.held and not node.serving._long_polls


async def test_status_is_cached_and_repeated_calls_cost_one_walk() -> None:
    node, _, _ = _ending_owner({})
    node.membership = None  # not joined yet: status() is all this node's own
    walks = [0]
    real = node._records_by_signer

    def records_by_signer() -> dict[str, int]:
        walks[0] += 1
        return real()

    node._records_by_signer = records_by_signer
    request = make_mocked_request("GET", "/v1/status")
    first = await node._on_status(request)
    for _ in range(50):
        again = await node._on_status(request)
        assert again.body == first.body
    assert walks[0] == 1
    assert json.loads(first.body)["peer_id"] == node.signer.peer_id.hex()
    node._status_json.clear()  # as if the window had passed
    await node._on_status(request)
    assert walks[0] == 2
