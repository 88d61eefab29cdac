"""Which learners an owner's rounds wait for (``node.peer.expected``), against identities that
register as learners and send little (issue 47), with a fake clock."""

from __future__ import annotations

import dataclasses

from node.dht.membership import Member, MemberRecord
from tests.node.fakes import signer
from tests.node.test_peer import _contribute, _ending_owner


def _learning(pid: bytes, learning: bool = True) -> Member:
    record = MemberRecord(
        url="http://127.0.0.1:1",
        roles=("learner",),
        reachable=False,
        manifest="m",
        learning=learning,
    )
    return Member(pid, record, expires_at=2e9)


async def test_identities_that_send_once_neither_stall_the_rounds_nor_shrink_the_merges() -> None:
    """Fifty identities register as learners, each sends one cheap contribution claiming a step
    time that makes its own silence bound 300 s, then goes quiet. Counted as learners for those
    300 s they held every round's quorum at half of 53, which the three learners at work never
    reach: no merge for five minutes. Now a round waits only for learners whose work this owner
    took within three of its own round times (here 4 s each: 12 s), so the learners' merges go
    on; and when the fifty then say "stopped", one merge of their work each does not count them
    as finished learners, so no merge is scaled to their share."""
    real = [signer(10 + i).peer_id for i in range(3)]
    sybils = [signer(60 + i).peer_id for i in range(50)]
    node, owner, clock = _ending_owner({pid: True for pid in real}, quorum=1, quorum_fraction=0.5)
    members = node.membership.members  # type: ignore[union-attr]

    async def honest_round() -> None:
        await node.expected.tell_expected(owner)
        for pid in real:
            await _contribute(owner, pid)  # 4 steps of 1 s
        clock.advance(4.0)
        await owner.tick()

    for _ in range(4):  # the owner's pace: a round every 4 s
        await honest_round()
    assert owner.version == 7 and owner.merger.round_seconds() == 4.0
    for pid in sybils:  # they register, and each sends one contribution
        members[pid] = _learning(pid)
    await node.expected.tell_expected(owner)
    for pid in sybils:
        assert (await _contribute(owner, pid, step_time=1e6)).accepted
    clock.advance(4.0)
    await owner.tick()
    burst = (
        owner.version
    )  # their work merged (in rounds of three: they were never heard from before)
    for _ in range(10):  # 40 s of the three learners at work
        await honest_round()
    assert owner.version >= burst + 7  # waited for 12 s at most: a stall of three rounds, not 75
    assert len(node.expected.learner_ids_waited_for(owner)) == 3
    for pid in sybils:  # they say "stopped"
        members[pid] = dataclasses.replace(
            members[pid], record=dataclasses.replace(members[pid].record, learning=False)
        )
    assert (
        node.expected.finished_learners() == 50
        and node.expected.finished_learners_heard(owner) == 0
    )
    before = owner.version
    await honest_round()
    assert owner.version == before + 1 and "scaled" not in owner.merges[-1]
