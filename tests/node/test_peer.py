"""PeerNode's admission of sealed requests: members at once, a new member after one lookup of
its record, strangers refused without costing more than one rate-limited lookup."""

from __future__ import annotations

import dataclasses

import pytest

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord
from node.peer import PeerNode
from tests.node.fakes import signer, tiny_model, tiny_plan


@dataclasses.dataclass
class FakeMembership:
    """The DHT's member records, as ``refresh`` would find them."""

    records: dict[bytes, Member]
    members: dict[bytes, Member] = dataclasses.field(default_factory=dict)
    refreshes: int = 0

    async def refresh(self) -> dict[bytes, Member]:
        self.refreshes += 1
        self.members = dict(self.records)
        return self.members


def _member(peer_id: bytes) -> Member:
    record = MemberRecord(url="http://127.0.0.1:1", roles=("learner",), reachable=False,
                          manifest="m", learning=True)
    return Member(peer_id, record, expires_at=2e9)


def _node() -> tuple[PeerNode, FakeMembership]:
    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    old, new = signer(2).peer_id, signer(3).peer_id
    membership = FakeMembership(records={old: _member(old), new: _member(new)})
    membership.members = {old: membership.records[old]}  # the new member published after our last read
    node.membership = membership  # type: ignore[assignment]
    return node, membership


async def test_a_new_member_is_admitted_after_one_lookup() -> None:
    node, membership = _node()
    assert await node._authorize(signer(2).peer_id) and membership.refreshes == 0
    assert await node._authorize(signer(3).peer_id) and membership.refreshes == 1
    assert await node._authorize(signer(3).peer_id) and membership.refreshes == 1


async def test_strangers_cost_at_most_one_lookup_per_gap() -> None:
    node, membership = _node()
    stranger, other = signer(40).peer_id, signer(41).peer_id
    assert not await node._authorize(stranger) and membership.refreshes == 1
    assert not await node._authorize(stranger) and membership.refreshes == 1  # remembered: no lookup
    assert not await node._authorize(other) and membership.refreshes == 1  # inside the gap: no lookup
    assert other not in node._unknown  # refused unread: may be looked up after the gap
    for n in range(100, 200):
        assert not await node._authorize(signer(n).peer_id)
    assert membership.refreshes == 1 and node.member_lookups == 1


def test_the_token_cap_must_come_from_the_swarm_config() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        PeerNode(RunConfig(), signer(1), model, tiny_plan(model))
