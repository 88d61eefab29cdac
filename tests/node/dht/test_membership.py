"""Member records: strict decoding, manifest agreement, owner choice over reachable members."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Sequence

import msgpack
import pytest

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord, Membership, manifest_hash, members_key
from protocol.dht.records import sign_record
from protocol.errors import DecodeError
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer


def _record(**kw: object) -> MemberRecord:
    fields: dict[str, object] = dict(
        url="http://127.0.0.1:9000",
        roles=("learner", "owner"),
        reachable=True,
        manifest="m",
        learning=True,
        step=3,
    )
    fields.update(kw)
    return MemberRecord(**fields)  # type: ignore[arg-type]


def test_record_round_trip_fits_a_dht_value() -> None:
    rec = _record()
    raw = rec.encode()
    assert MemberRecord.decode(raw) == rec and len(raw) < 1024


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb(["http://x", ["admin"], True, "m", True, 0]),
        msgpack.packb(["ftp://x", ["learner"], True, "m", True, 0]),
        msgpack.packb(["http://x", ["learner"], "yes", "m", True, 0]),
        msgpack.packb({"url": "http://x"}),
    ],
)
def test_bad_records_are_refused_with_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError, match="bad member record"):
        MemberRecord.decode(raw)


def test_manifest_covers_swarm_wide_fields_only() -> None:
    base = RunConfig()
    assert manifest_hash(base) == manifest_hash(
        dataclasses.replace(base, steps=5, threads=2, corpus="x")
    )
    assert manifest_hash(base) != manifest_hash(dataclasses.replace(base, fragments=8))
    assert manifest_hash(base) != manifest_hash(dataclasses.replace(base, model="small"))
    assert members_key("a") != members_key("b")


def test_owners_only_among_reachable_owner_role_members() -> None:
    ms = Membership(None, "s", "m", n_fragments=16)  # type: ignore[arg-type]  # members only: no DHT needed
    far = time.time() + 60
    ms.members = {
        b"a" * 32: Member(b"a" * 32, _record(url="http://a"), far, certified_owner=True),
        b"b" * 32: Member(b"b" * 32, _record(url="", reachable=False, roles=("learner",)), far),
        b"c" * 32: Member(
            b"c" * 32, _record(url="http://c", reachable=False), far, certified_owner=True
        ),
        b"d" * 32: Member(
            b"d" * 32, _record(url="http://d", learning=False), far, certified_owner=True
        ),
        b"e" * 32: Member(b"e" * 32, _record(url="http://e"), far),  # asks to own, not certified to
    }
    assert sorted(ms.owner_candidates()) == [b"a" * 32, b"d" * 32]
    owners = [ms.owner_of("s", p)[0] for p in range(16)]  # type: ignore[index]
    assert owners.count(b"a" * 32) == owners.count(b"d" * 32) == 8  # balanced: 8 fragments each
    assert ms.owner_of("s", 0, exclude={b"a" * 32}) == (b"d" * 32, "http://d")
    assert ms.learners() == 4


def test_owners_are_ranked_again_when_a_read_replaces_the_members() -> None:
    """``ranked`` remembers its answers for one members dict: a new dict (every read makes one)
    is ranked afresh, an exclude set is its own question, and a caller's edit of an answer is
    not remembered."""
    ms = Membership(None, "s", "m", n_fragments=4)  # type: ignore[arg-type]  # members only
    far = time.time() + 60

    def owner(c: bytes) -> Member:
        return Member(c * 32, _record(url=f"http://{c.decode()}"), far, certified_owner=True)

    ms.members = {c * 32: owner(c) for c in (b"a", b"b")}
    first = ms.ranked("s", 0, 2)
    assert {pid for pid, _ in first} == {b"a" * 32, b"b" * 32}
    first.clear()  # the caller's list, not the remembered one
    assert len(ms.ranked("s", 0, 2)) == 2
    primary = ms.ranked("s", 0, 1)[0][0]
    other = ({b"a" * 32, b"b" * 32} - {primary}).pop()
    assert ms.ranked("s", 0, 1, exclude={primary}) == [(other, f"http://{other[:1].decode()}")]
    ms.members = {c * 32: owner(c) for c in (b"a", b"b") if c * 32 != primary}  # it left
    assert ms.ranked("s", 0, 2) == [(other, f"http://{other[:1].decode()}")]
    ms.members = {c * 32: owner(c) for c in (b"a", b"b", b"c")}  # and a third joined
    assert {pid for pid, _ in ms.ranked("s", 0, 3)} == {c * 32 for c in (b"a", b"b", b"c")}


# --- certificates and merged reads, against a fake DHT ------------------------------------------


class FakeDHT:
    """``get`` answers with whatever records the test gives it (a responder may omit some)."""

    def __init__(self) -> None:
        self.answer: list = []
        self.quorums: list[int] = []
        self.held: list[list] = []
        self.renew_before: list[float] = []

    async def get(
        self, key: bytes, *, quorum: int = 1, held: Sequence = (), renew_before: float = 0.0
    ) -> list:
        if key != members_key("s"):  # the roster: these tests put every record under the other key
            return []
        self.quorums.append(quorum)
        self.held.append(list(held))
        self.renew_before.append(renew_before)
        return list(self.answer)

    def held_near(self, key: bytes, replicas: int | None = None) -> list | None:
        return None  # not among the nearest: every read asks responders


class Swarm:
    def __init__(self, admission: str) -> None:
        self.founder, self.lab = Signer.from_seed(os.urandom(32)), Signer.from_seed(os.urandom(32))
        m = SwarmManifest(
            name="m", founder=self.founder.public_key, admission=admission, created=time.time()
        )
        self.manifest = m.with_authority("lab", self.lab.public_key).signed(self.founder)
        self.dht = FakeDHT()
        self.membership = Membership(self.dht, "s", "m", swarm_manifest=lambda: self.manifest)  # type: ignore[arg-type]

    def record(
        self,
        who: Signer,
        *,
        roles: tuple[str, ...] | None = ("learner", "owner"),
        life_s: float = 3600,
        ttl_s: float = 20,
    ) -> object:
        cert = b""
        if roles is not None:
            now = time.time()
            cert = Certificate.issue(
                self.lab,
                manifest=self.manifest,
                subject=who.public_key,
                roles=roles,
                not_before=now - 60,
                not_after=now + life_s,
            ).encode()
        value = _record(cert=cert).encode()
        return sign_record(who, members_key("s"), value, time.time() + ttl_s)


async def test_owners_need_a_certificate_with_the_owner_role() -> None:
    swarm = Swarm("open")
    owner, learner, anonymous = (Signer.from_seed(os.urandom(32)) for _ in range(3))
    swarm.dht.answer = [
        swarm.record(owner),
        swarm.record(learner, roles=("learner",)),
        swarm.record(anonymous, roles=None),
    ]
    members = await swarm.membership.refresh()
    assert set(members) == {
        owner.peer_id,
        learner.peer_id,
        anonymous.peer_id,
    }  # open: all may learn
    assert swarm.membership.owner_candidates() == [owner.peer_id]
    assert members[owner.peer_id].lab == "lab" and members[anonymous.peer_id].cert is None


async def test_a_view_follows_a_record_whose_value_changed_and_forgets_one_gone() -> None:
    """Values are decoded once per change (``Membership._decode``): a member that stops
    learning is seen so at the next read, and one whose record is gone is forgotten."""
    ms = Membership(FakeDHT(), "s", "m")  # type: ignore[arg-type]
    a, b = (Signer.from_seed(os.urandom(32)) for _ in range(2))

    def rec(who: Signer, **kw: object) -> object:
        return sign_record(who, members_key("s"), _record(**kw).encode(), time.time() + 20)

    ms.dht.answer = [rec(a), rec(b)]  # type: ignore[attr-defined]
    assert all(m.record.learning for m in (await ms.refresh(full=True)).values())
    ms.dht.answer = [rec(a, learning=False, step=9)]  # type: ignore[attr-defined]
    members = await ms.refresh(full=True)
    assert not members[a.peer_id].record.learning and members[a.peer_id].record.step == 9
    ms._records.pop(b.peer_id)  # b's record expired
    ms._rebuild(time.time())
    assert set(ms.members) == {a.peer_id} and set(ms._decoded) == {a.peer_id}


async def test_certified_swarm_reads_only_valid_certificates_and_follows_revocations() -> None:
    swarm = Swarm("certified")
    good, anonymous, expired = (Signer.from_seed(os.urandom(32)) for _ in range(3))
    swarm.dht.answer = [
        swarm.record(good),
        swarm.record(anonymous, roles=None),
        swarm.record(expired, life_s=-10),
    ]
    members = await swarm.membership.refresh()
    assert set(members) == {good.peer_id}
    assert "certified peers only" in swarm.membership.refused[anonymous.peer_id]
    assert "expired" in swarm.membership.refused[expired.peer_id]
    swarm.manifest = swarm.manifest.with_revoked(good.public_key).signed(swarm.founder)
    assert await swarm.membership.refresh() == {}
    assert "revoked" in swarm.membership.refused[good.peer_id]


async def test_a_responder_that_leaves_members_out_does_not_shrink_the_view() -> None:
    swarm = Swarm("open")
    a, b = Signer.from_seed(os.urandom(32)), Signer.from_seed(os.urandom(32))
    swarm.dht.answer = [swarm.record(a), swarm.record(b)]
    assert len(await swarm.membership.refresh()) == 2
    swarm.dht.answer = [swarm.record(a)]  # b omitted: it stays until its own record expires
    assert set(await swarm.membership.refresh()) == {a.peer_id, b.peer_id}
    short = swarm.record(b, ttl_s=0.05)
    swarm.dht.answer = [short]  # an older copy (earlier expiry) does not replace the newer one
    assert b.peer_id in await swarm.membership.refresh()


async def test_reads_after_the_first_name_every_record_held_refused_ones_too() -> None:
    """Delta reads: the first read names nothing; later ones name the newest record held per
    member (refused ones too, so a refused record is not sent again), never an expired one, and
    ask for refreshes of those that expire within half their ttl."""
    swarm = Swarm("certified")
    a, stranger, brief = (Signer.from_seed(os.urandom(32)) for _ in range(3))
    rec_a, rec_stranger, rec_brief = (
        swarm.record(a),
        swarm.record(stranger, roles=None),
        swarm.record(brief, ttl_s=0.05),
    )
    swarm.dht.answer = [rec_a, rec_stranger, rec_brief]
    assert set(await swarm.membership.refresh()) == {a.peer_id, brief.peer_id}
    assert swarm.dht.held[0] == []
    await asyncio.sleep(0.1)
    swarm.dht.answer = []  # every responder: "nothing newer than what you named"
    assert set(await swarm.membership.refresh()) == {a.peer_id}  # the view keeps what it holds
    assert sorted(r.subkey for r in swarm.dht.held[1]) == sorted([a.peer_id, stranger.peer_id])
    ttl = swarm.membership.ttl_s
    assert swarm.dht.renew_before[1] == pytest.approx(time.time() + ttl / 2, abs=1.0)


async def test_the_first_read_and_every_fourth_merge_several_responders() -> None:
    from node.dht.membership import FULL_READ_EVERY, READ_QUORUM

    swarm = Swarm("open")
    for _ in range(2 * FULL_READ_EVERY + 1):
        await swarm.membership.refresh()
    full = [i for i, q in enumerate(swarm.dht.quorums) if q == READ_QUORUM]
    assert full == [0, FULL_READ_EVERY, 2 * FULL_READ_EVERY]
    assert set(swarm.dht.quorums) == {1, READ_QUORUM}


async def test_a_held_record_close_to_expiry_makes_the_next_read_ask_several_responders() -> None:
    """A record that was not renewed (the responder read lacks it, or its member is gone) and
    nears expiry makes the next read a quorum read, whatever the read count says."""
    from node.dht.membership import LAPSE_GUARD_S, READ_QUORUM

    swarm = Swarm("open")
    a, b = (Signer.from_seed(os.urandom(32)) for _ in range(2))
    swarm.dht.answer = [swarm.record(a), swarm.record(b, ttl_s=LAPSE_GUARD_S + 0.3)]
    await swarm.membership.refresh()  # the first read: a quorum read anyway
    swarm.dht.answer = []
    await swarm.membership.refresh()
    assert swarm.dht.quorums[1] == 1  # b still has more than LAPSE_GUARD_S to live
    await asyncio.sleep(0.4)
    await swarm.membership.refresh()
    assert swarm.dht.quorums[2] == READ_QUORUM


async def test_refusals_kept_are_bounded() -> None:
    swarm = Swarm("certified")
    swarm.dht.answer = [
        swarm.record(Signer.from_seed(os.urandom(32)), roles=None) for _ in range(1100)
    ]
    await swarm.membership.refresh()
    assert len(swarm.membership.refused) <= 1024


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("rda_max_gain", 0.5, "--rda-max-gain"),
        ("outer_momentum", 1.5, "--outer-momentum"),
        ("outer_lr", 0.0, "--outer-lr"),
    ],
)
def test_a_recipe_whose_outer_step_cannot_run_is_refused_when_read(
    field: str, value: float, says: str
) -> None:
    """A swarm's recipe sets the outer step for every peer: a value ``OuterConfig`` refuses must
    fail as the manifest is read, with the flag named, not when a peer starts owning a fragment."""
    import types

    from node.config import RunConfig
    from node.dht.membership import config_from_manifest

    manifest = types.SimpleNamespace(recipe_dict={field: value}, swarm_id="s" * 16)
    with pytest.raises(ValueError, match=says):
        config_from_manifest(manifest, RunConfig())  # type: ignore[arg-type]
    assert (
        config_from_manifest(
            types.SimpleNamespace(
                recipe_dict={"aggregate": "rda", "rda_max_gain": 1.5},  # type: ignore[arg-type]
                swarm_id="s" * 16,
            ),
            RunConfig(),
        ).rda_max_gain
        == 1.5
    )


def test_finished_learners_are_counted_in_decoupled_swarms_and_only_once_seen_learning() -> None:
    from protocol.diloco.expected import Claim, ExpectedLearners

    def view(**learning: bool) -> dict[bytes, Claim]:
        return {k.encode(): Claim(learning=v, expires_at=2e9) for k, v in learning.items()}

    def expected(cfg: RunConfig, seen: set[bytes]) -> ExpectedLearners:
        out = ExpectedLearners(mode=cfg.mode, provisioned=cfg.peers)
        out.seen_learning |= seen
        return out

    count = expected(RunConfig(outer_momentum=0.9), set()).finished_count
    assert count(view(a=True, b=True, c=False)) == 0  # c: joined, not yet training
    assert count(view(a=True, b=False, c=False)) == 1  # b stopped; c never trained
    assert count(view(a=False, c=False)) == 2  # a stopped, b's record expired: still finished
    assert count(view(a=True, c=False)) == 1  # a trains again (restarted)
    plain = expected(RunConfig(), {b"a"})
    assert (
        plain.finished_count(view(a=False)) == 1
    )  # plain averaging: a straggler's work is a share too
    for cfg in (
        RunConfig(mode="sync"),
        RunConfig(outer_momentum=0.9, mode="sync"),
    ):  # sync rounds wait for all
        rounds = expected(cfg, {b"a"})
        assert rounds.finished_count(view(a=False)) == 0


def test_a_joiner_reads_the_steps_other_learners_claim_not_its_own_nor_idle_members() -> None:
    from types import SimpleNamespace

    from node.peer.presence import Presence

    def member(learning: bool, step: int) -> SimpleNamespace:
        return SimpleNamespace(record=SimpleNamespace(learning=learning, step=step))

    me = b"m" * 32
    node = SimpleNamespace(
        signer=SimpleNamespace(peer_id=me),
        membership=SimpleNamespace(
            members={
                me: member(True, 0),
                b"a" * 32: member(True, 700),
                b"b" * 32: member(True, 650),
                b"c" * 32: member(False, 3000),
            }
        ),
    )  # c: finished, or an owner that does not learn
    assert sorted(Presence.learner_steps(node)) == [650, 700]  # type: ignore[arg-type]
    assert Presence.learner_steps(SimpleNamespace(signer=node.signer, membership=None)) == []  # type: ignore[arg-type]


class KeyedDHT:
    """Records per key; ``get`` honours ``only`` (subkey prefixes) as a responder does."""

    def __init__(self) -> None:
        self.by_key: dict[bytes, list] = {}
        self.reads: list[tuple[bytes, tuple[bytes, ...]]] = []
        self.stored: list[bytes] = []
        self.forgotten: list[bytes] = []

    async def get(
        self,
        key: bytes,
        *,
        quorum: int = 1,
        only: tuple[bytes, ...] = (),
        held: Sequence = (),
        renew_before: float = 0.0,
    ) -> list:
        self.reads.append((key, only))
        recs = self.by_key.get(key, [])
        return [r for r in recs if not only or r.subkey[:16] in only]

    def held_near(self, key: bytes, replicas: int | None = None) -> list | None:
        return None

    async def store(
        self,
        key: bytes,
        value: bytes,
        ttl_s: float,
        *,
        replicas: int | None = None,
        on_held: Callable[[], None] | None = None,
    ) -> int:
        self.stored.append(key)
        if on_held is not None:
            on_held()
        return 1

    def forget(self, key: bytes) -> None:
        self.forgotten.append(key)


async def test_a_bounded_view_reads_the_roster_and_looks_others_up_by_id() -> None:
    from node.dht.membership import LOOKUPS_PER_READ, roster_key

    dht = KeyedDHT()
    owners = [Signer.from_seed(os.urandom(32)) for _ in range(2)]
    learners = [Signer.from_seed(os.urandom(32)) for _ in range(LOOKUPS_PER_READ + 4)]
    expiry = time.time() + 20
    dht.by_key[roster_key("s")] = [
        sign_record(
            o, roster_key("s"), _record(url=f"http://127.0.0.1:{9000 + i}").encode(), expiry
        )
        for i, o in enumerate(owners)
    ]
    learner_value = _record(url="", roles=("learner",), reachable=False).encode()
    dht.by_key[members_key("s")] = [
        sign_record(s, members_key("s"), learner_value, expiry) for s in learners
    ]
    view = Membership(dht, "s", "m")  # type: ignore[arg-type]
    view.sees_all = False
    assert set(await view.refresh()) == {o.peer_id for o in owners}  # no learner read
    assert all(key == roster_key("s") for key, _ in dht.reads)
    for s in learners:
        view.want(s.peer_id)
    members = await view.refresh()
    # the most recently wanted, at most LOOKUPS_PER_READ a read, by id from the members key
    looked = [only for key, only in dht.reads if key == members_key("s")]
    assert len(looked) == 1 and len(looked[0]) == LOOKUPS_PER_READ
    assert set(members) - {o.peer_id for o in owners} == {
        s.peer_id for s in learners[-LOOKUPS_PER_READ:]
    }
    assert len(await view.refresh()) == len(owners) + len(learners)  # the rest next read
    assert sorted(view.owner_candidates()) == sorted(o.peer_id for o in owners)

    full = Membership(dht, "s", "m")  # type: ignore[arg-type]
    assert len(await full.refresh()) == len(owners) + len(learners)  # sees_all: both keys whole
    full.want(learners[0].peer_id)  # no-op: nothing to look up
    assert len(full.lookups) == 0


async def test_a_record_is_published_under_the_roster_when_it_offers_to_own() -> None:
    from node.dht.membership import roster_key

    dht = KeyedDHT()
    view = Membership(dht, "s", "m")  # type: ignore[arg-type]
    await view.publish(_record())
    await view.publish(_record(roles=("learner",)))
    # withdrawn: once more under the roster (so roster readers stop ranking it an owner), then
    # under the members key; not republished under the roster again: it expires there
    assert dht.stored == [roster_key("s"), roster_key("s"), members_key("s")]
    assert dht.forgotten == [roster_key("s")]
    await view.publish(_record(roles=("learner",)))
    assert dht.stored[3:] == [members_key("s")]


def _roster(dht: KeyedDHT, signers: list[Signer], expiry: float) -> None:
    from node.dht.membership import roster_key

    dht.by_key[roster_key("s")] = [
        sign_record(
            s, roster_key("s"), _record(url=f"http://127.0.0.1:{9000 + i}").encode(), expiry
        )
        for i, s in enumerate(signers)
    ]


async def test_an_open_swarm_roster_holds_the_cap_best_ranked_candidates() -> None:
    """Every member that reads the same roster agrees on who offers to own: the ROSTER_CAP
    best-ranked; one more candidate only offers if it outranks one of them."""
    from node.dht.membership import ROSTER_CAP
    from protocol.dht.member_reads import offers_to_own, roster_score

    dht = KeyedDHT()
    signers = [Signer.from_seed(os.urandom(32)) for _ in range(ROSTER_CAP + 4)]
    _roster(dht, signers, time.time() + 20)
    view = Membership(dht, "s", "m")  # type: ignore[arg-type]
    await view.refresh()
    ranked = sorted(signers, key=lambda s: roster_score("s", s.peer_id), reverse=True)
    candidates = view.owner_candidates()
    offering = [s for s in signers if offers_to_own("s", s.peer_id, candidates, ROSTER_CAP)]
    assert sorted(s.peer_id for s in offering) == sorted(s.peer_id for s in ranked[:ROSTER_CAP])
    # a suspect (it refuses connections) leaves its place to the next-ranked, once the place
    # stayed open ROSTER_GRACE_S (an owner's record that lapses for a moment keeps its place)
    nxt, gone = ranked[ROSTER_CAP].peer_id, {ranked[0].peer_id}
    assert not view.offers_to_own(nxt)
    assert not view.offers_to_own(nxt, exclude=gone)
    view.seat.grace_s = 0.0
    assert view.offers_to_own(nxt, exclude=gone)


async def test_a_member_waits_a_grace_for_each_member_standing_by_ahead_of_it_in_its_view() -> None:
    """A view that lacks one roster record shows a place open: a member ranked deep waits one
    ``ROSTER_GRACE_S`` for itself and one for each member in its view that stands by (it may own,
    publishes "standby") and outranks it; a learner that never stands by adds nothing. Before,
    it took the place after one grace, whatever its rank (at 128 peers, members ranked 73rd–118th
    did, and their offers moved fragments in the views that saw them)."""
    from node.dht.membership import ROSTER_CAP, ROSTER_FRESH_S, ROSTER_GRACE_S
    from protocol.dht.member_reads import roster_score

    dht = KeyedDHT()
    signers = [Signer.from_seed(os.urandom(32)) for _ in range(ROSTER_CAP + 4)]
    ranked = sorted(signers, key=lambda s: roster_score("s", s.peer_id), reverse=True)
    roster, line, me = ranked[:ROSTER_CAP], ranked[ROSTER_CAP:-1], ranked[-1]
    expiry = time.time() + 20
    _roster(dht, roster, expiry)
    roles = [("learner",), ("learner", "standby"), ("learner", "standby")]
    dht.by_key[members_key("s")] = [
        sign_record(
            s,
            members_key("s"),
            _record(url=f"http://127.0.0.1:{9100 + i}", roles=r).encode(),
            expiry,
        )
        for i, (s, r) in enumerate(zip(line, roles, strict=True))
    ]
    view = Membership(dht, "s", "m")  # type: ignore[arg-type]
    await view.refresh()
    assert [view.members[s.peer_id].stands_by for s in line] == [False, True, True]
    clock = FakeClock()
    view.seat_clock = clock.time
    gone = {roster[0].peer_id}  # its record lapsed from this view only
    assert not view.offers_to_own(me.peer_id, exclude=gone)
    clock.now += 3 * ROSTER_GRACE_S - 0.1  # its own grace and two standing by ahead
    assert not view.offers_to_own(me.peer_id, exclude=gone)
    clock.now += 0.1
    view.read_at = time.monotonic() - ROSTER_FRESH_S  # the view's last read is stale: no place
    assert not view.offers_to_own(me.peer_id, exclude=gone)
    view.read_at = time.monotonic()
    assert view.offers_to_own(me.peer_id, exclude=gone)
    # the best of the line (a learner that does not stand by) would wait one grace
    first = Membership(dht, "s", "m")  # type: ignore[arg-type]
    await first.refresh()
    first.seat_clock = clock.time
    assert not first.offers_to_own(line[0].peer_id, exclude=gone)
    clock.now += ROSTER_GRACE_S
    assert first.offers_to_own(line[0].peer_id, exclude=gone)


async def test_a_member_that_may_own_but_ranks_out_of_the_roster_publishes_that_it_stands_by() -> (
    None
):
    from node.dht.membership import ROSTER_CAP
    from protocol.dht.member_reads import roster_score

    dht = KeyedDHT()
    signers = [Signer.from_seed(os.urandom(32)) for _ in range(ROSTER_CAP + 1)]
    ranked = sorted(signers, key=lambda s: roster_score("s", s.peer_id), reverse=True)
    _roster(dht, ranked[:ROSTER_CAP], time.time() + 20)
    view = Membership(dht, "s", "m")  # type: ignore[arg-type]
    await view.refresh()
    out = _presence(view, ranked[ROSTER_CAP])
    out.reachable = True  # type: ignore[attr-defined]
    assert out.my_record().roles == ("learner", "standby")  # type: ignore[attr-defined]
    never = _presence(view, ranked[ROSTER_CAP], may_own=False)
    never.reachable = True  # type: ignore[attr-defined]
    assert never.my_record().roles == ("learner",)  # type: ignore[attr-defined]
    hidden = _presence(view, ranked[ROSTER_CAP])  # not dialled back: it cannot own
    assert hidden.my_record().roles == ("learner",)  # type: ignore[attr-defined]
    # a record that stands by is read back as one
    value = MemberRecord.decode(out.my_record().encode())  # type: ignore[attr-defined]
    assert value.roles == ("learner", "standby")


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:  # the age of the last read, as the module measures it
        return self.now


async def test_reads_back_off_while_the_view_is_unchanged_and_come_back_when_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The membership loop's passes read the DHT every READ_BASE_S while the view changes, then
    ever more rarely (at most READ_MAX_S apart); a new member, a wanted id, a lapsing record
    make the next pass read (a step's news alone does not)."""
    import node.dht.membership as membership_module
    from node.dht.membership import READ_BASE_S, READ_MAX_S, roster_key

    clock = FakeClock()
    monkeypatch.setattr(membership_module, "time", clock)
    dht = KeyedDHT()
    signers = [Signer.from_seed(os.urandom(32)) for _ in range(3)]
    _roster(dht, signers[:2], clock.now + 600)
    view = Membership(dht, "s", "m", ttl_s=600)  # type: ignore[arg-type]
    view.sees_all = False

    async def passes(n: int) -> list[float]:  # passes READ_BASE_S apart; when each read
        read_at = []
        for _ in range(n):
            before = len(dht.reads)
            await view.refresh_if_due()
            if len(dht.reads) > before:
                read_at.append(clock.now)
            clock.now += READ_BASE_S
        return read_at

    read_at = await passes(20)  # the first read finds the roster: a change; then nothing changes
    gaps = [b - a for a, b in zip(read_at, read_at[1:], strict=False)]
    assert gaps[:2] == [READ_BASE_S, 2 * READ_BASE_S]  # doubling while nothing changes
    assert set(gaps[2:]) == {READ_MAX_S} and len(read_at) == 8  # of 20 passes
    _roster(dht, signers, clock.now + 600)  # a member joins the roster: seen within READ_MAX_S
    seen_at = clock.now + READ_MAX_S
    while len(view.members) < 3:
        await passes(1)
        assert clock.now <= seen_at + READ_BASE_S
    n = len(dht.reads)
    assert await passes(2) == [clock.now - 2 * READ_BASE_S]  # the base gap again after a change
    view.want(os.urandom(32))  # a wanted id is looked up at the next pass, read due or not
    clock.now -= 1.0  # no read due: the lookup alone
    await view.refresh_if_due()
    assert len(dht.reads) == n + 2
    assert dht.reads[-1][0] != roster_key("s") and len(dht.reads[-1][1]) == 1


def test_a_new_step_alone_changes_the_record_only_every_step_news_period() -> None:
    """Republications between two pieces of step news keep the value (readers get refreshes);
    any other change is news at once, with the current step."""
    from node.peer.renewal import STEP_NEWS_S, next_record

    base = MemberRecord(url="http://a:1", roles=("learner",), reachable=True, manifest="m",
                        learning=True, step=10)  # fmt: skip
    assert next_record(base, None, 0.0) == (base, True)
    later = dataclasses.replace(base, step=19)
    assert next_record(later, base, 1.0) == (base, False)  # the old value, republished
    assert next_record(later, base, STEP_NEWS_S) == (later, False)
    stopped = dataclasses.replace(later, learning=False)
    assert next_record(stopped, base, 1.0) == (stopped, True)
    # a first step and a doubled step are news at once: O(log steps) of them in a run
    fresh = dataclasses.replace(base, step=0)
    assert next_record(dataclasses.replace(base, step=1), fresh, 0.1)[1] is True
    assert next_record(dataclasses.replace(base, step=20), base, 1.0) == (
        dataclasses.replace(base, step=20),
        True,
    )
    news, published = 0, fresh
    for step in range(1, 100_001):  # 100k steps, each 1 s after the last news: only doublings
        published, now = next_record(dataclasses.replace(base, step=step), published, 1.0)
        news += now
    assert published.step == 65536 and news == 17  # 1, 2, 4, ... 65536: log2, not one a step


def _presence(membership: Membership, signer: Signer, **kw: object) -> object:
    from node.config import RunConfig
    from node.peer.presence import Presence, ViewScope
    from node.peer.started import PeerShared, Started

    return Presence(
        RunConfig(swarm="s"),
        # no request leaves in these tests: no transport
        PeerShared(signer, None, Started(membership=membership)),  # type: ignore[arg-type]
        shapes=[],
        credentials=None,
        public_address="http://127.0.0.1:1",
        on_suspect=lambda: None,
        scope=ViewScope(**kw),  # type: ignore[arg-type]
    )


async def test_in_an_open_swarm_a_member_outside_the_capped_roster_learns_from_a_bounded_view() -> (
    None
):
    """A reachable member of an open swarm offers to own only while it ranks among the
    ROSTER_CAP best of the roster; otherwise it publishes as a learner and reads the bounded
    view, except while ``wait_for_members`` counts members (or with ``whole_view``)."""
    from node.dht.membership import ROSTER_CAP
    from protocol.dht.member_reads import roster_score

    dht = KeyedDHT()
    signers = [Signer.from_seed(os.urandom(32)) for _ in range(ROSTER_CAP + 3)]
    ranked = sorted(signers, key=lambda s: roster_score("s", s.peer_id), reverse=True)
    roster, me = ranked[:ROSTER_CAP], ranked[ROSTER_CAP]
    _roster(dht, roster, time.time() + 20)
    view = Membership(dht, "s", "m")  # type: ignore[arg-type]
    await view.refresh()
    presence = _presence(view, me)
    presence.reachable = True  # type: ignore[attr-defined]
    assert presence.my_record().roles == ("learner", "standby")  # type: ignore[attr-defined]
    presence.scope_view()  # type: ignore[attr-defined]
    assert view.sees_all is False
    presence.awaited_members = 40  # type: ignore[attr-defined]  # wait_for_members: count all
    presence.scope_view()  # type: ignore[attr-defined]
    assert view.sees_all is True and view.cadence.due(time.time())  # and read every pass
    presence.awaited_members = 0  # type: ignore[attr-defined]
    view.seat.grace_s = 0.0  # (the grace before taking an open place: test_member_reads)
    presence.unreachable(roster[0].peer_id)  # type: ignore[attr-defined]  # a suspect: its place
    assert presence.my_record().roles == ("learner", "owner")  # type: ignore[attr-defined]
    presence.scope_view()  # type: ignore[attr-defined]
    assert view.sees_all is True  # an owner reads every member
    best = _presence(view, ranked[0])
    best.reachable = True  # type: ignore[attr-defined]
    assert best.my_record().roles == ("learner", "owner")  # type: ignore[attr-defined]
    whole = _presence(view, me, whole_view=True)
    whole.scope_view()  # type: ignore[attr-defined]
    assert view.sees_all is True
    never = _presence(view, ranked[0], may_own=False)
    never.reachable = True  # type: ignore[attr-defined]
    assert never.my_record().roles == ("learner",)  # type: ignore[attr-defined]


async def test_a_bounded_view_renews_the_members_it_looked_up_in_its_reads_as_one_request() -> None:
    """Looked-up records are asked for again, naming the value held (refreshes, not whole
    records), in the read the cadence makes due when they would expire before the next one:
    all in one request, not one per record as each nears expiry."""
    from node.dht.membership import roster_key

    class RenewingDHT(KeyedDHT):
        def __init__(self) -> None:
            super().__init__()
            self.asks: list[tuple[bytes, tuple[bytes, ...], list, float]] = []

        async def get(self, key: bytes, *, quorum: int = 1, only: tuple[bytes, ...] = (),
                      held: Sequence = (), renew_before: float = 0.0) -> list:  # fmt: skip
            self.asks.append((key, only, list(held), renew_before))
            return await super().get(key, quorum=quorum, only=only)

    dht = RenewingDHT()
    owner = Signer.from_seed(os.urandom(32))
    _roster(dht, [owner], time.time() + 60)
    learners = [Signer.from_seed(os.urandom(32)) for _ in range(3)]
    value = _record(url="", roles=("learner",), reachable=False).encode()
    soon = time.time() + 5  # expires before any next read
    dht.by_key[members_key("s")] = [sign_record(s, members_key("s"), value, soon) for s in learners]
    view = Membership(dht, "s", "m")  # type: ignore[arg-type]
    view.sees_all = False
    await view.refresh()
    for s in learners:
        view.want(s.peer_id)
    await view.refresh_if_due()  # not a due read: the wanted ids are looked up, whole
    assert len(view.members) == 4 and dht.asks[-1][2] == []
    view.cadence.hurry()
    await view.refresh_if_due()  # a due read: one roster read, one lookup renewing all three
    lookups = [a for a in dht.asks[2:] if a[0] != roster_key("s")]
    assert len(lookups) == 1
    _, only, held, renew_before = lookups[0]
    assert sorted(only) == sorted(s.peer_id[:16] for s in learners)
    assert sorted(r.subkey for r in held) == sorted(s.peer_id for s in learners)
    assert all(r.expires_at < renew_before for r in held)  # named for renewal, not as same


class RepublishingDHT:
    """The roster's records as their responders hold them in a steady swarm: each member re-signs
    its record every ``every_s`` with a ``ttl_s`` expiry (``clock`` is the swarm's time); a read
    gets a record whole when it names none of its value, its newest expiry when it names the
    value for renewal, nothing when it names it as unchanged. ``lacking``: members whose newer
    copies the single responder a read asks does not hold (a quorum read finds them)."""

    def __init__(self, clock: FakeClock, signers: list[Signer], *, every_s: float, ttl_s: float):
        self.clock, self.signers, self.every_s, self.ttl_s = clock, signers, every_s, ttl_s
        self.phase = {s.peer_id: i * every_s / len(signers) for i, s in enumerate(signers)}
        self.value = _record().encode()
        self.lacking: set[bytes] = set()
        self.quorums: list[int] = []

    def _newest(self, s: Signer, quorum: int) -> object:
        from node.dht.membership import roster_key

        t = self.clock.now
        published = t - (t - self.phase[s.peer_id]) % self.every_s
        if s.peer_id in self.lacking and quorum == 1:
            published -= self.every_s * 3  # an old copy: the responder missed republications
        return sign_record(s, roster_key("s"), self.value, published + self.ttl_s)

    async def get(self, key: bytes, *, quorum: int = 1, only: tuple[bytes, ...] = (),
                  held: Sequence = (), renew_before: float = 0.0) -> list:  # fmt: skip
        from node.dht.membership import roster_key

        if key != roster_key("s"):
            return []
        self.quorums.append(quorum)
        mine = {r.subkey: r for r in held}
        out = []
        for s in self.signers:
            rec = self._newest(s, quorum)
            had = mine.get(s.peer_id)
            if had is None or (had.expires_at < renew_before and rec.expires_at > had.expires_at):
                out.append(rec)
        self.clock.now += 0.3  # a read takes a moment
        return out

    def held_near(self, key: bytes, replicas: int | None = None) -> list | None:
        return None


def _republished_view(
    monkeypatch: pytest.MonkeyPatch,
    members: int,
    *,
    every_s: float = 6.5,
    dht_type: type[RepublishingDHT] = RepublishingDHT,
) -> tuple[FakeClock, list[Signer], RepublishingDHT, Membership]:
    """A bounded view (``sees_all`` off) of ``members`` roster members republishing every
    ``every_s`` with a 20 s ttl over ``dht_type``, on a fake clock that membership reads too."""
    import node.dht.membership as membership_module

    clock = FakeClock()
    monkeypatch.setattr(membership_module, "time", clock)
    signers = [Signer.from_seed(os.urandom(32)) for _ in range(members)]
    dht = dht_type(clock, signers, every_s=every_s, ttl_s=20.0)
    view = Membership(dht, "s", "m", ttl_s=20.0)  # type: ignore[arg-type]
    view.sees_all = False
    return clock, signers, dht, view


@pytest.mark.parametrize("every_s", [6.5, 7.5])
async def test_a_steady_roster_read_asks_one_responder_but_every_fourth_read(
    monkeypatch: pytest.MonkeyPatch, every_s: float
) -> None:
    """Members republishing every 6.5 s with a 20 s ttl (or 7.5 s: a loaded publisher; the
    bound is ttl - READ_MAX_S - LAPSE_GUARD_S less a read's lag), read on 2 s passes: records
    that age into the lapse guard between reads are renewed by the next read from one responder;
    only every FULL_READ_EVERY-th read asks READ_QUORUM (it asked three on nearly every read
    while any record aging between two reads counted as one a responder failed to renew). And
    no member ever leaves the view."""
    from node.dht.membership import FULL_READ_EVERY, READ_QUORUM, ROSTER_CAP

    clock, _, dht, view = _republished_view(monkeypatch, ROSTER_CAP, every_s=every_s)
    for _ in range(150):  # 300 s of 2 s passes
        await view.refresh_if_due()
        assert len(view.members) == ROSTER_CAP
        clock.now += 2.0
    reads, full = len(dht.quorums), dht.quorums.count(READ_QUORUM)
    assert reads >= 40
    assert full <= reads // FULL_READ_EVERY + 1, (full, reads)


async def test_a_record_one_responder_does_not_renew_is_read_from_a_quorum_before_it_lapses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The safety net kept: a member whose newer copies the responder read lacks is asked of
    READ_QUORUM responders once its held record nears expiry (in the same pass as the read that
    missed it), and stays in the view, though the passes come as late as a loaded loop's."""
    from node.dht.membership import READ_QUORUM

    clock, signers, dht, view = _republished_view(monkeypatch, 4)
    dht.lacking = {signers[0].peer_id}
    for _ in range(120):
        await view.refresh_if_due()
        assert len(view.members) == 4
        clock.now += 5.5  # passes as far apart as a loaded loop's
    assert READ_QUORUM in dht.quorums[1:]


async def test_a_record_that_aged_into_the_guard_and_was_not_renewed_is_read_from_a_quorum_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record fresh at the last read (not asked to renew) that ages into the lapse guard makes
    the next pass read one responder; when that responder lacks its newer copy, the same pass
    asks READ_QUORUM (not the next: a loaded loop's next pass may come after the expiry)."""
    import node.dht.membership as membership_module
    from node.dht.membership import LAPSE_GUARD_S, READ_QUORUM

    clock = FakeClock()
    monkeypatch.setattr(membership_module, "time", clock)
    swarm = Swarm("open")
    a, b = (Signer.from_seed(os.urandom(32)) for _ in range(2))
    swarm.dht.answer = [swarm.record(a), swarm.record(b, ttl_s=13.0)]
    await swarm.membership.refresh()  # the first read: a quorum read; b not yet due to renew
    swarm.dht.answer = []  # the responder has nothing newer of b
    clock.now += 13.0 - LAPSE_GUARD_S + 0.5
    await swarm.membership.refresh_if_due()
    assert swarm.dht.quorums == [READ_QUORUM, 1, READ_QUORUM]
    assert b.peer_id in swarm.membership.members


class NeverStoredDHT(RepublishingDHT):
    """``RepublishingDHT`` whose single responder (or our own store, when we count ourselves
    among the key's holders) holds no copy at all of the ``lacking`` members: their publishers
    store at the nodes their lookups found nearest, and it is not one of them."""

    async def get(self, key: bytes, *, quorum: int = 1, only: tuple[bytes, ...] = (),
                  held: Sequence = (), renew_before: float = 0.0) -> list:  # fmt: skip
        out = await super().get(key, quorum=quorum, only=only, held=held, renew_before=renew_before)
        return out if quorum > 1 else [r for r in out if r.subkey not in self.lacking]


async def test_a_record_that_lapsed_from_the_view_between_passes_is_read_from_a_quorum_next_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live member's record that expired in our view unrenewed, dropped by a rebuild between
    passes (a requester's lookup, ``look_up``, as a starved loop's late passes let happen), is
    asked of READ_QUORUM responders at the next pass: the responder a single read asks (or our
    own store, when we count ourselves among the roster's holders) lacks its newer copies, and
    the lapse guard no longer sees a record gone. Before, it stayed out of the view until the
    every-FULL_READ_EVERY-th read, ~20 s at a loaded loop's pace: longer than ROSTER_GRACE_S, so
    a view lacking one of the roster's cap members had every member it held take a place."""
    from node.dht.membership import LAPSE_GUARD_S, READ_QUORUM

    clock, signers, dht, view = _republished_view(monkeypatch, 4, dht_type=NeverStoredDHT)
    lacking = signers[0].peer_id
    for _ in range(6):
        await view.refresh_if_due()  # a pass: the first read asks a quorum, then one responder
        dht.lacking = {lacking}  # from now on that responder misses its republications
        assert lacking in view.members
        clock.now = view.members[lacking].expires_at + 0.5  # the next pass comes late...
        await view.look_up()  # ...after a lookup for a requester rebuilt the view without it
        assert lacking not in view.members
        await view.refresh_if_due()
        assert lacking in view.members, "a live member left out of the view for a whole pass"
        assert view.members[lacking].expires_at - clock.now > LAPSE_GUARD_S
        assert dht.quorums[-1] == READ_QUORUM
        clock.now += 2.0


async def test_a_read_that_fails_is_counted_by_its_error_and_leaves_the_view_s_age_alone() -> None:
    """A view whose reads never complete is stale whatever its cadence: the membership loop
    logs each failed read, and the view counts them by error and shows the reads in flight
    (the harness samples both)."""

    class Unreachable(KeyedDHT):
        async def get(self, key: bytes, **kw: object) -> list:  # type: ignore[override]
            raise TimeoutError("no responder answered")

    view = Membership(Unreachable(), "s", "m")  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        await view.refresh()
    assert view.read_errors == {"TimeoutError": 1}
    assert not view.reads_in_flight and view.read_age() == float("inf")
