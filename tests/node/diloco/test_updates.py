"""Versions as updates (``--update-codec``), node side: an owner publishes each version as a
compressed update over the one before, a learner holding that one applies it and ends with the
owner's state bit for bit; anything else falls back to the full version. Replicas take the
same update in place of the whole state. In-memory transport, fake clock."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from node.diloco import fetching
from node.diloco.flat import flat_digest
from node.diloco.island import Island, IslandConfig, Outgoing
from node.diloco.learner import IslandNet, LearnerNetConfig, OwnerLinks, Reach
from node.diloco.owner import FragmentOwner
from node.diloco.replica import BaseNotHeld, Handed, ReplicaStore
from protocol.errors import DecodeError
from protocol.wire.messages import Ack, Contribution, FragmentUpdate, ReplicaState
from protocol.wire.signing import verify_sealed
from tests.node.fakes import (
    SWARM,
    FakeClock,
    MemoryOwnerPeer,
    MemoryTransport,
    flat_of,
    make_owner,
    shapes_of,
    signer,
    tiny_model,
    tiny_plan,
)

OWNER_URL = "http://owner.test"


class Rig:
    """Two learners (islands with their IslandNet) and one owner peer publishing updates."""

    def __init__(self, codec: str = "int8") -> None:
        torch.manual_seed(0)
        self.models = [tiny_model() for _ in range(2)]
        self.models[1].load_state_dict(self.models[0].state_dict())
        self.plan = tiny_plan(self.models[0])
        self.shapes = shapes_of(self.models[0], self.plan)
        self.clock, self.owner_key = FakeClock(), signer(1)
        self.handed: list[tuple[ReplicaState, ReplicaState | None]] = []
        self.store = ReplicaStore(
            SWARM, [sum(int(torch.Size(s).numel()) for s in sh) for sh in self.shapes]
        )
        self.owners: dict[int, FragmentOwner] = {
            p: make_owner(
                self.plan,
                self.shapes,
                p,
                flat_of(self.models[0], self.plan, p),
                self.clock,
                who=self.owner_key,
                quorum=1,
                late_policy="drop",
                update_codec=codec,
            )
            for p in range(len(self.plan.fragments))
        }
        for owner in self.owners.values():
            owner.replicate = self._replicate
        self.keys = [signer(7), signer(8)]
        self.peer = MemoryOwnerPeer(
            self.owner_key, self.owners, members={k.peer_id for k in self.keys}
        )
        self.transport = MemoryTransport()
        self.transport.add(OWNER_URL, self.peer)
        self.nets = []
        for model, key in zip(self.models, self.keys, strict=True):
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            island = Island(model, opt, self.plan, lambda _out: None, IslandConfig(inner_steps=4))
            self.nets.append(
                IslandNet(
                    island,
                    LearnerNetConfig(swarm=SWARM, shapes=self.shapes, codec="int8"),
                    OwnerLinks(
                        key,
                        Reach(
                            self.transport, owner_of=lambda p: (self.owner_key.peer_id, OWNER_URL)
                        ),
                    ),
                )
            )

    async def _replicate(
        self,
        state: ReplicaState,
        update: ReplicaState | None = None,
        theta_digest: bytes | None = None,
    ) -> str | None:
        self.handed.append((state, update))
        ack = self.store.offer(
            self.owner_key.peer_id, update if update is not None and self.store.states else state
        )
        return None if ack.accepted else ack.reason

    async def merge(self, learner: int = 0, p: int = 0) -> None:
        """One contribution from ``learner`` against the version it holds, merged at once."""
        net, owner = self.nets[learner], self.owners[p]
        await owner.set_expected(1)
        version, before = net.received[p], owner.version
        g = torch.Generator().manual_seed(owner.version)
        delta = 0.01 * torch.randn(owner.theta.numel(), generator=g)
        net.island.in_flight[p] = net.island.stats.step
        await net.sender.send(
            Outgoing(
                fragment=p,
                base_version=version,
                tokens=48,
                steps=4,
                step_time=0.0,
                sender_step=0,
                delta=delta,
            )
        )
        assert owner.version == before + 1, net.stats

    async def fetch(self, learner: int = 0, p: int = 0) -> tuple[int, torch.Tensor]:
        net = self.nets[learner]
        got = await net.fetch(p, after=net.received[p], wait_s=0.0)
        assert got is not None
        net.remember(p, *got)
        return got


async def test_a_learner_applies_each_update_and_holds_the_owners_state_bit_for_bit() -> None:
    rig = Rig()
    owner, net = rig.owners[0], rig.nets[0]
    for version in range(1, 6):
        await rig.merge()
        got = await rig.fetch()
        assert got[0] == version and torch.equal(got[1], owner.theta)
        assert net.known.digests[0][version] == owner.digest_of(version) == flat_digest(got[1])
    assert net.stats.updates_applied == 5 and net.stats.update_mismatches == 0
    # what came down is the update: about a quarter of the full fp32 version (int8 + scales)
    assert owner.update is not None
    update = verify_sealed(owner.update.tobytes(), max_size=1 << 20).message
    assert isinstance(update, FragmentUpdate) and update.version == 5 and update.base_version == 4
    sent = sum(len(t.data) + len(t.scales) for t in update.tensors)
    assert sent < 0.35 * owner.theta.numel() * 4
    assert owner.residual is not None and 0 < float(owner.residual.abs().max()) < 1e-3


async def test_work_on_an_updated_version_is_merged_not_sent_back() -> None:
    """A learner names the version it computed from an update by the owner-signed digest of the
    result; the owner knows that digest, so the next contribution is taken (no "resync")."""
    rig = Rig()
    await rig.merge()
    await rig.fetch()
    await rig.merge()  # based on the version that came as an update
    assert rig.nets[0].stats.base_mismatches == 0 and rig.owners[0].version == 2


async def test_a_learner_behind_by_more_than_one_version_gets_the_full_version() -> None:
    rig = Rig()
    await rig.merge(learner=0)
    await rig.fetch(learner=0)
    await rig.merge(learner=0)
    got = await rig.fetch(learner=1)  # still at version 0: the update is over version 1
    assert got[0] == 2 and torch.equal(got[1], rig.owners[0].theta)
    assert rig.nets[1].stats.updates_applied == 0 and rig.nets[1].stats.versions_received == 1


async def _one_behind() -> tuple[Rig, int, torch.Tensor]:
    """A rig whose learner 0 holds version 1 while the owner has published version 2 (an update
    over 1), and the version and state it holds."""
    rig = Rig()
    await rig.merge()
    await rig.fetch()
    await rig.merge()
    version, flat = rig.nets[0].latest[0]
    return rig, version, flat


async def test_a_learner_whose_state_differs_from_the_owners_takes_the_full_version() -> None:
    """A learner whose copy of the base is not the owner's (here: one value changed) would
    compute another state from the update: the base digest check sends it to the full version,
    and it ends with the owner's state."""
    rig, version, flat = await _one_behind()
    net, owner = rig.nets[0], rig.owners[0]
    wrong = flat.clone()
    wrong[0] += 1.0
    net.latest[0] = (version, wrong)
    net.known.digests[0][version] = flat_digest(wrong)
    got = await rig.fetch()
    assert torch.equal(got[1], owner.theta) and net.stats.update_mismatches == 1


async def test_a_tampered_update_is_refused_and_the_full_version_taken() -> None:
    """Update bytes that do not give the state the owner signed the hash of (here the owner's
    own update, with the learner's base changed after the digest check would pass) fail the
    result check: the full version is fetched."""
    rig, version, flat = await _one_behind()
    net, owner = rig.nets[0], rig.owners[0]
    net.latest[0] = (version, flat + 1e-3)  # the digest on record still names the owner's state
    got = await rig.fetch()
    assert torch.equal(got[1], owner.theta) and net.stats.update_mismatches == 1


async def test_the_replica_takes_the_update_and_holds_the_owners_state() -> None:
    rig = Rig()
    owner = rig.owners[0]
    for _ in range(3):
        await rig.merge()
        await rig.fetch()
    full, update = rig.handed[-1]
    assert update is not None and update.base_version == full.version - 1 and not update.momentum
    held = rig.store.states[0]
    assert held.version == owner.version and torch.equal(held.theta, owner.theta)
    # the update handoff is a fraction of the whole state
    size = sum(len(t.data) + len(t.scales) for t in update.theta)
    assert size < 0.35 * sum(len(t.data) for t in full.theta)


async def test_a_replica_refuses_an_update_over_a_state_it_does_not_hold() -> None:
    rig = Rig()
    await rig.merge()
    await rig.fetch()
    await rig.merge()  # the store now holds version 2
    full, update = rig.handed[-1]
    assert update is not None
    store = ReplicaStore(SWARM, rig.store.numels)
    with pytest.raises(DecodeError, match="whole state"):
        store.decode(update)
    with pytest.raises(
        DecodeError, match="whole state"
    ):  # held, but another content under that version
        rig.store.decode(dataclasses.replace(update, base_digest=bytes(32)))
    with pytest.raises(DecodeError, match="hash"):  # applies, but not to the digest it names
        rig.store.decode(
            dataclasses.replace(
                update, base_version=2, base_digest=rig.store.states[0].digest, version=3
            )
        )


async def test_a_replica_with_no_state_applies_the_update_over_its_own_learners_version() -> None:
    """A peer that was never this fragment's replica takes an update handoff over the version
    its learner fetched (digest-checked): no whole state on the wire. A learner that does not
    hold the base (or holds other bytes under it) makes it a plain refusal (``BaseNotHeld``)."""
    rig = Rig()
    owner = rig.owners[0]
    await rig.merge(learner=0)
    await rig.fetch(learner=0)  # learner 0 holds version 1; learner 1 still version 0
    await rig.merge(learner=0)
    _, update = rig.handed[-1]
    assert update is not None and update.base_version == 1 and update.version == 2
    fresh = ReplicaStore(SWARM, rig.store.numels)
    learned = rig.nets[0].held_state(0)
    assert learned is not None and learned[0] == 1
    theta, momentum = fresh.decode(update, learned)
    assert (
        momentum is None
        and torch.equal(theta, owner.theta)
        and fresh.offer(rig.owner_key.peer_id, update, decoded=(theta, momentum)).accepted
    )
    assert fresh.states[0].version == 2
    behind = rig.nets[1].held_state(0)
    assert behind is not None and behind[0] == 0
    for other in (behind, (1, bytes(32), learned[2]), None):
        with pytest.raises(BaseNotHeld, match="whole state"):
            ReplicaStore(SWARM, rig.store.numels).decode(update, other)


async def test_a_learner_holding_the_final_version_downloads_nothing_and_one_behind_takes_the_update() -> (
    None
):
    rig = Rig()
    owner = rig.owners[0]
    await rig.merge(learner=0)
    await rig.fetch(learner=0)
    got = await rig.nets[0].fetch(
        0, after=1, wait_s=0.0, final=True
    )  # holds the latest: it is final
    assert got is not None and got[0] == 1 and torch.equal(got[1], owner.theta)
    assert rig.nets[0].stats.finals_held == 1 and rig.nets[0].stats.versions_received == 1
    got = await rig.nets[1].fetch(
        0, after=0, wait_s=0.0, final=True
    )  # one behind: the update over 0
    assert got is not None and got[0] == 1 and torch.equal(got[1], owner.theta)
    assert rig.nets[1].stats.updates_applied == 1 and rig.nets[1].stats.finals_held == 0


class OwnOwners:
    """``LocalOwners`` over owners this very peer runs (what ``PeerNode`` does, minus membership)."""

    def __init__(self, owners: dict[int, FragmentOwner], me: bytes) -> None:
        self.owners, self.me = owners, me

    async def contribute_local(self, msg: Contribution, flat: torch.Tensor | None = None) -> Ack:
        return await self.owners[msg.fragment].contribute(self.me, msg, flat)

    async def version_local(
        self, p: int, *, after: int, wait_s: float, final: bool
    ) -> tuple[int, torch.Tensor, bytes] | None:
        owner = self.owners[p]
        if not final and await owner.wait_after(after, wait_s) is None:
            return None
        return owner.version, owner.theta, owner.digest_of(owner.version)


async def test_a_peer_reaches_the_fragments_it_owns_in_process() -> None:
    """A learner whose owner is its own peer sends and fetches without HTTP: nothing goes over
    the transport, the work is merged with the same error feedback, and the version it gets is
    the owner's state under the digest the owner knows it by (so its next work is taken)."""
    rig = Rig()
    me = rig.owner_key
    net = IslandNet(
        rig.nets[0].island,
        LearnerNetConfig(swarm=SWARM, shapes=rig.shapes, codec="int8"),
        OwnerLinks(
            me,
            Reach(rig.transport, owner_of=lambda p: (me.peer_id, OWNER_URL)),
            OwnOwners(rig.owners, me.peer_id),
        ),
    )
    rig.nets[0] = net
    before = rig.peer.requests
    for version in (1, 2):
        await rig.merge()
        got = await rig.fetch()
        assert got[0] == version and got[1] is rig.owners[0].theta
    assert rig.peer.requests == before and rig.transport.bytes_sent == 0
    assert net.stats.versions_local == 2 and net.stats.contributions_accepted == 2
    assert net.stats.base_mismatches == 0 and net.residuals  # int8 error feedback kept as over HTTP


class ReplicaOnly:
    """``LocalOwners`` of a peer that owns no fragment and is the owner's replica (its store)."""

    def __init__(self, store: ReplicaStore) -> None:
        self.store = store

    async def contribute_local(self, msg: Contribution, flat: torch.Tensor | None = None) -> Ack:
        raise AssertionError("this peer owns nothing")

    async def version_local(
        self, p: int, *, after: int, wait_s: float, final: bool
    ) -> tuple[int, torch.Tensor, bytes] | None:
        raise AssertionError("this peer owns nothing")

    def replica_version(self, p: int, owner_id: bytes) -> Handed | None:
        return self.store.version_from(p, owner_id)


async def test_the_replicas_learner_takes_the_version_from_its_store_not_the_wire() -> None:
    """The replica holds each version before it is published: its own learner takes it from
    there (no request, no byte), names it by the owner's digest so its next work is merged, and
    a state that does not hash to that digest, or one another peer handed over, is downloaded."""
    rig = Rig()
    net = IslandNet(
        rig.nets[0].island,
        LearnerNetConfig(swarm=SWARM, shapes=rig.shapes, codec="int8"),
        OwnerLinks(
            rig.keys[0],
            Reach(rig.transport, owner_of=lambda p: (rig.owner_key.peer_id, OWNER_URL)),
            ReplicaOnly(rig.store),
        ),
    )
    rig.nets[0] = net
    owner = rig.owners[0]
    for version in (1, 2):
        await rig.merge()
        before = rig.peer.requests
        got = await rig.fetch()
        assert (
            got[0] == version
            and got[1] is rig.store.states[0].theta
            and torch.equal(got[1], owner.theta)
        )
        assert rig.peer.requests == before and net.known.digests[0][version] == owner.digest_of(
            version
        )
    assert net.stats.versions_replica == 2 and net.stats.base_mismatches == 0 and owner.version == 2
    # handed over by a peer that is not the owner this learner's view names: not taken
    await rig.merge()
    held = rig.store.states[0]
    rig.store.states[0] = dataclasses.replace(held, sender=rig.keys[1].peer_id)
    got = await rig.fetch()
    assert got[0] == 3 and torch.equal(got[1], owner.theta) and rig.peer.requests > before
    assert net.stats.versions_replica == 2
    # a state in the store that is not what its digest says: downloaded from the owner instead
    rig.store.states[0] = held
    await rig.merge()
    rig.store.states[0] = dataclasses.replace(
        rig.store.states[0], theta=rig.store.states[0].theta + 1.0
    )
    got = await rig.fetch()
    assert got[0] == 4 and torch.equal(got[1], owner.theta) and net.stats.versions_replica == 2


async def test_a_resync_never_takes_a_replica_state_older_than_the_version_received() -> None:
    """A resync asks for each fragment's latest version (``after`` -1): a state in the replica
    store below the version this learner already received (handed in the owner's earlier tenure)
    is not it, so the learner downloads the owner's latest instead of going back."""
    rig = Rig()
    net = IslandNet(
        rig.nets[0].island,
        LearnerNetConfig(swarm=SWARM, shapes=rig.shapes, codec="int8"),
        OwnerLinks(
            rig.keys[0],
            Reach(rig.transport, owner_of=lambda p: (rig.owner_key.peer_id, OWNER_URL)),
            ReplicaOnly(rig.store),
        ),
    )
    rig.nets[0] = net
    await rig.merge()
    await rig.fetch()
    stale = rig.store.states[0]
    await rig.merge()
    assert (await rig.fetch())[0] == 2 and net.stats.versions_replica == 2
    rig.store.states[0] = stale
    assert rig.store.version_from(0, rig.owner_key.peer_id) is None  # fenced past it
    rig.store.version_from = lambda p, sender: stale  # type: ignore[method-assign]  # a store that offers it anyway
    before = rig.peer.requests
    got = await net.fetch(0, after=-1, wait_s=0.0)
    assert got is not None and got[0] == 2 and torch.equal(got[1], rig.owners[0].theta)
    assert rig.peer.requests > before and net.stats.versions_replica == 2


async def test_a_replica_state_known_to_hash_to_its_digest_is_not_hashed_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A state the store took as hashed (its handoff's verified blobs digest was its digest) is
    taken by the replica's learner with no second pass over its bytes; one not known so is hashed."""
    rig = Rig()
    net = IslandNet(
        rig.nets[0].island,
        LearnerNetConfig(swarm=SWARM, shapes=rig.shapes, codec="int8"),
        OwnerLinks(
            rig.keys[0],
            Reach(rig.transport, owner_of=lambda p: (rig.owner_key.peer_id, OWNER_URL)),
            ReplicaOnly(rig.store),
        ),
    )
    rig.nets[0] = net
    hashed: list[int] = []
    real = fetching.flat_digest
    monkeypatch.setattr(
        fetching, "flat_digest", lambda flat: hashed.append(flat.numel()) or real(flat)
    )
    await rig.merge()
    assert (
        await rig.fetch() and hashed and net.stats.versions_replica == 1
    )  # offered without ``hashed``
    await rig.merge()
    rig.store.states[0] = dataclasses.replace(rig.store.states[0], hashed=True)
    hashed.clear()
    got = await rig.fetch()
    assert (
        got[0] == 2 and torch.equal(got[1], rig.owners[0].theta) and net.stats.versions_replica == 2
    )
    assert hashed == []
