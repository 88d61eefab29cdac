"""Addresses, TLS pins and manifest claims: what one member's record can make every other peer do.

A member's address, and the manifest version it claims, are its own say-so. These tests show that
a record naming another member's address neither re-pins it nor cuts that member off, that a TLS
key that does not match its pin routes around the member dialled, that a liar's manifest claim
neither lures every peer nor hides the founder's revocation, and that a joiner's state sync runs
pinned. Real HTTPS on 127.0.0.1 where the property is about a connection; a fake DHT feeds the
records.
"""

from __future__ import annotations

import asyncio
import os
import time
import types
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import pytest
from aiohttp import web

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord, Membership, members_key
from node.dht.swarm import MANIFEST_PATH, SwarmCredentials
from node.peer import PeerNode
from node.wire.tls import PinMismatch, origin, server_context
from node.wire.transport import Transport
from protocol.dht.records import SignedRecord, sign_record
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer
from tests.node.fakes import tiny_model, tiny_plan

pytestmark = pytest.mark.timeout(60)


def key() -> Signer:
    return Signer.from_seed(os.urandom(32))


class FakeDHT:
    """``get`` answers with the records the test sets."""

    def __init__(self) -> None:
        self.answer: list[SignedRecord] = []

    async def get(
        self, key: bytes, *, quorum: int = 1, held: object = (), renew_before: float = 0.0
    ) -> list[SignedRecord]:
        return list(self.answer)

    def held_near(self, key: bytes, replicas: int | None = None) -> None:
        return None


class Swarm:
    """A certified swarm: its founder, one lab, the manifest every peer starts from."""

    def __init__(self) -> None:
        self.founder, self.lab = key(), key()
        m = SwarmManifest(
            name="pins", founder=self.founder.public_key, admission="certified", created=time.time()
        )
        self.manifest = m.with_authority("lab", self.lab.public_key).signed(self.founder)

    def cert(self, who: Signer, roles: Sequence[str] = ("learner", "owner")) -> Certificate:
        now = time.time()
        return Certificate.issue(
            self.lab,
            manifest=self.manifest,
            subject=who.public_key,
            roles=list(roles),
            not_before=now - 60,
            not_after=now + 3600,
        )

    def record(
        self,
        who: Signer,
        url: str,
        *,
        roles: Sequence[str] = ("learner", "owner"),
        version: int = 1,
        ttl_s: float = 20.0,
    ) -> SignedRecord:
        member_roles = tuple(r for r in ("learner", "owner") if r in roles)
        value = MemberRecord(
            url=url,
            roles=member_roles,
            reachable=bool(url),
            manifest="m",
            learning=True,
            cert=self.cert(who, roles).encode(),
            manifest_version=version,
        ).encode()
        return sign_record(who, members_key("s"), value, time.time() + ttl_s)

    def membership(self, dht: FakeDHT) -> Membership:
        return Membership(dht, "s", "m", swarm_manifest=lambda: self.manifest)  # type: ignore[arg-type]


# --- addresses and pins, one membership ----------------------------------------------------------
async def test_a_record_naming_a_held_address_never_repins_it() -> None:
    """Today's main pinned each origin to the last record read that named it: a learner-only
    member naming an owner's host:port re-pinned it to its own key."""
    swarm, dht = Swarm(), FakeDHT()
    owner, liar = key(), key()
    ms = swarm.membership(dht)
    url = "https://127.0.0.1:9000"
    dht.answer = [swarm.record(owner, url)]
    await ms.refresh()
    dht.answer = [swarm.record(owner, url), swarm.record(liar, url, roles=("learner",))]
    members = await ms.refresh()
    assert ms.pins == {origin(url): swarm.cert(owner).tls_pin}
    assert (
        members[owner.peer_id].record.url == url and members[liar.peer_id].record.url == ""
    )  # the liar may learn, not be dialled
    assert "is held by member" in ms.refused[liar.peer_id] and ms.address_disputes == 1
    # the liar republishes as a would-be owner, and is read first: still no re-pin
    dht.answer = [swarm.record(liar, url), swarm.record(owner, url)]
    members = await ms.refresh()
    assert ms.pins == {origin(url): swarm.cert(owner).tls_pin} and ms.owner_candidates() == [
        owner.peer_id
    ]


async def test_two_claims_seen_at_once_go_to_the_candidate_owner_and_pins_leave_with_their_member() -> (
    None
):
    swarm, dht = Swarm(), FakeDHT()
    owner, liar, other = key(), key(), key()
    ms = swarm.membership(dht)
    url = "https://127.0.0.1:9000"
    dht.answer = [
        swarm.record(liar, url, roles=("learner",)),
        swarm.record(owner, url),
        swarm.record(other, "https://127.0.0.1:9001", ttl_s=0.2),
    ]
    await ms.refresh()
    assert ms.holders["127.0.0.1:9000"] == owner.peer_id
    assert set(ms.pins) == {origin(url), "https://127.0.0.1:9001"}
    time.sleep(0.25)  # the other member's record expires
    dht.answer = []
    await ms.refresh()
    assert set(ms.pins) == {origin(url)} and other.peer_id not in ms.members


async def test_a_tls_key_moves_an_address_to_the_claimant_it_belongs_to() -> None:
    """A liar that held an address first keeps it against records, not against the handshake:
    the key presented there is the real claimant's, so the address becomes the real one's."""
    swarm, dht = Swarm(), FakeDHT()
    owner, liar = key(), key()
    ms = swarm.membership(dht)
    url = "https://127.0.0.1:9000"
    dht.answer = [swarm.record(liar, url)]
    await ms.refresh()
    dht.answer = [swarm.record(liar, url), swarm.record(owner, url)]
    await ms.refresh()
    assert ms.pins[origin(url)] == swarm.cert(liar).tls_pin  # first come
    stranger_pin = swarm.cert(key()).tls_pin
    assert (
        ms.pin_mismatch(swarm.cert(liar).tls_pin, stranger_pin) == liar.peer_id
    )  # no claimant's key: no move
    assert ms.pins[origin(url)] == swarm.cert(liar).tls_pin
    assert ms.pin_mismatch(swarm.cert(liar).tls_pin, swarm.cert(owner).tls_pin) == liar.peer_id
    assert ms.pins[origin(url)] == swarm.cert(owner).tls_pin and ms.addresses_moved == 1
    assert ms.members[liar.peer_id].record.url == "" and ms.owner_candidates() == [owner.peer_id]
    await ms.refresh()  # and it stays moved
    assert ms.pins[origin(url)] == swarm.cert(owner).tls_pin


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1:9000/v1/anything",
        "https://127.0.0.1:9000/",
        "https://127.0.0.1:9000?x=1",
        "https://127.0.0.1:9000#f",
        "https://user@127.0.0.1:9000",
        "https://127.0.0.1",
        "https://127.0.0.1:0",
        "https://127.0.0.1:70000",
        "https://127.0.0.1:9000?",
        "ftp://127.0.0.1:9000",
        "https://a b:1",
        "https://evil.example:443/?u=http://10.0.0.1:80",
    ],
)
def test_member_addresses_are_bare_origins(url: str) -> None:
    """Today's main took any http(s) URL: every peer sent its signed GETs to whatever path it named."""
    from protocol.errors import DecodeError

    raw = MemberRecord(
        url=url, roles=("learner",), reachable=True, manifest="m", learning=True
    ).encode()
    with pytest.raises(
        DecodeError, match="bad member record: address .* (is not a bare origin|port)"
    ):
        MemberRecord.decode(raw)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9000", "https://peer-3.example.org:7000", "https://[::1]:7000", ""]
)
def test_bare_origins_decode(url: str) -> None:
    rec = MemberRecord(url=url, roles=("learner",), reachable=True, manifest="m", learning=True)
    assert MemberRecord.decode(rec.encode()) == rec


# --- claims of a newer manifest, bookkeeping -----------------------------------------------------
def _claimant(n: int, version: int, expires_at: float = 100.0) -> Member:
    record = MemberRecord(
        url=f"https://127.0.0.1:{9000 + n}",
        roles=("learner",),
        reachable=True,
        manifest="m",
        learning=True,
        manifest_version=version,
    )
    return Member(bytes([n]) * 32, record, expires_at)


def test_claims_far_above_ours_are_ignored_and_the_rest_tried_highest_first() -> None:
    # imported here: the rest of the file runs on trees without it
    from node.dht.manifest_claims import ManifestClaims

    claims = ManifestClaims(step=16, per_pass=3)
    members = [
        _claimant(1, 2**63 - 1),
        _claimant(2, 3),
        _claimant(3, 9),
        _claimant(4, 1),
        _claimant(5, 18),
    ]
    assert [m.record.manifest_version for m in claims.candidates(members, 2, now=0.0)] == [18, 9, 3]
    assert claims.ignored == 1


def test_a_failed_claim_waits_for_a_new_record_and_its_backoff() -> None:
    from node.dht.manifest_claims import ManifestClaims

    claims = ManifestClaims(backoff_s=30.0, backoff_max_s=600.0)
    liar = _claimant(1, 5, expires_at=100.0)
    assert claims.candidates([liar], 1, now=0.0) == [liar]
    assert claims.failed(liar, now=0.0) == 30.0
    assert (
        claims.candidates([_claimant(1, 5, expires_at=200.0)], 1, now=10.0) == []
    )  # republished, in the window
    assert claims.candidates([liar], 1, now=40.0) == []  # the window passed, the same record
    again = _claimant(1, 6, expires_at=200.0)
    assert claims.candidates([again], 1, now=40.0) == [again]  # both
    assert claims.failed(again, now=40.0) == 100.0  # doubled
    assert (
        claims.candidates([], 1, now=41.0) == [] and claims.status()["members_backed_off"] == 0
    )  # left: forgotten


# --- over HTTPS on 127.0.0.1 ---------------------------------------------------------------------
@dataclass
class Server:
    signer: Signer
    transport: Transport
    hits: list[str]

    @property
    def url(self) -> str:
        return self.transport.url


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., object]]:
    started: list[Transport] = []

    async def start(
        signer: Signer,
        *,
        credentials: SwarmCredentials | None = None,
        body: bytes = b"junk",
        stall_s: float = 0.0,
    ) -> Server:
        transport = Transport(tls=server_context(signer))
        hits: list[str] = []
        if credentials is not None:
            credentials.install(transport)
        else:  # a liar's server: answers every manifest fetch with junk

            async def junk(request: web.Request) -> web.Response:
                hits.append(request.path)
                await asyncio.sleep(stall_s)
                return web.Response(body=body)

            transport.app.router.add_get(MANIFEST_PATH, junk)
        await transport.start()
        started.append(transport)
        return Server(signer, transport, hits)

    yield start
    for t in started:
        await t.close()


def _client(swarm: Swarm) -> tuple[PeerNode, FakeDHT]:
    me = key()
    cred = SwarmCredentials(swarm.manifest, me, swarm.cert(me))
    model = tiny_model()
    node = PeerNode(
        RunConfig(max_tokens_per_step=64, swarm=swarm.manifest.swarm_id),
        me,
        model,
        tiny_plan(model),
        credentials=cred,
    )
    dht = FakeDHT()
    node.membership = Membership(
        dht,
        "s",
        "m",
        swarm_manifest=lambda: cred.manifest,  # type: ignore[arg-type]
        n_fragments=2,
    )
    return node, dht


async def test_a_learner_claiming_an_owners_address_does_not_cut_it_off(servers) -> None:  # type: ignore[no-untyped-def]
    """The issue's pin hijack over real TLS: today's main pinned the owner's origin to the liar's
    key and every request to the owner failed with ``PinMismatch``."""
    swarm = Swarm()
    owner = await servers(key(), credentials=None)
    node, dht = _client(swarm)
    await node.transport.start()
    try:
        liar = key()
        dht.answer = [
            swarm.record(owner.signer, owner.url),
            swarm.record(liar, owner.url, roles=("learner",)),
        ]
        await node.membership.refresh()
        await node.presence.follow_manifest()  # a membership pass (today's main pinned here)
        status, buf, used, _ = await node.transport.request("GET", owner.url + MANIFEST_PATH)
        node.transport.pool.give(buf)
        assert status == 200 and owner.hits == [MANIFEST_PATH]
        assert node.owner_of(0) == (owner.signer.peer_id, owner.url)
        assert (
            node.presence.address_status()["address_disputes"] == 1
            and liar.peer_id.hex() in node.status()["refused_members"]
        )
    finally:
        await node.transport.close()


async def test_a_key_that_does_not_match_its_pin_routes_around_the_member(servers) -> None:  # type: ignore[no-untyped-def]
    """A member whose address answers with another key is treated as unreachable (its fragments
    move at once); today's main raised ``PinMismatch`` and kept routing to it."""
    swarm = Swarm()
    there = await servers(key())  # whoever really listens at the address
    node, dht = _client(swarm)
    await node.transport.start()
    try:
        claimant, backup = key(), key()
        dht.answer = [
            swarm.record(claimant, there.url),
            swarm.record(backup, "https://127.0.0.1:1"),
        ]
        await node.membership.refresh()
        await node.presence.follow_manifest()
        node.started.tg = None  # no task group: the reconcile runs at the next pass
        with pytest.raises(PinMismatch):
            await node.transport.request("GET", there.url + MANIFEST_PATH)
        assert claimant.peer_id in node.suspects() and there.hits == []
        assert node.presence.address_status()["pin_mismatches"] == 1
        assert all(node.owner_of(p) == (backup.peer_id, "https://127.0.0.1:1") for p in range(2))
    finally:
        await node.transport.close()


async def test_a_liars_claim_neither_lures_every_pass_nor_hides_the_founders_revocation(
    servers,
) -> None:  # type: ignore[no-untyped-def]
    """Today's main fetched only the highest claim, every pass: a record claiming 2^63-1 was
    fetched and parsed each pass and the revocation honest members held was never adopted."""
    swarm = Swarm()
    honest, liar, near_liar = key(), key(), key()
    revoked = swarm.manifest.with_revoked(liar.public_key).signed(swarm.founder)  # one version up
    v = revoked.version
    honest_server = await servers(
        honest, credentials=SwarmCredentials(revoked, honest, swarm.cert(honest))
    )
    lure, near = await servers(liar), await servers(near_liar)
    node, dht = _client(swarm)
    await node.transport.start()
    try:
        dht.answer = [
            swarm.record(honest, honest_server.url, version=v),
            swarm.record(liar, lure.url, version=2**63 - 1),
            swarm.record(near_liar, near.url, version=v + 3),
        ]  # within reach: tried first, fails
        await node.membership.refresh()
        assert liar.peer_id in node.membership.members
        for _ in range(5):  # five membership passes, records republished in between
            await node.presence.follow_manifest()
            dht.answer = [
                swarm.record(honest, honest_server.url, version=v),
                swarm.record(liar, lure.url, version=2**63 - 1),
                swarm.record(near_liar, near.url, version=v + 3),
            ]
        assert node.credentials is not None and node.credentials.manifest.version == v
        assert liar.peer_id not in node.membership.members  # revoked: dropped at once
        assert lure.hits == [] and near.hits == [
            MANIFEST_PATH
        ]  # the near liar once, then backed off
        counts = node.presence.address_status()
        assert counts["manifest_claim_failures"] == 1 and counts["manifest_claims_adopted"] == 1
        assert counts["manifest_claims_ignored"] >= 1
    finally:
        await node.transport.close()


async def test_a_joiner_syncs_state_pinned(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Join-time state sync used to run before any pin was set: a man in the middle could
    answer (and replay) a certified joiner's fragment requests over unpinned TLS."""
    swarm = Swarm()
    node, dht = _client(swarm)
    owner = key()
    dht.answer = [swarm.record(owner, "https://127.0.0.1:9000")]
    node.started.dht, node.started.net = types.SimpleNamespace(), types.SimpleNamespace()  # type: ignore[assignment]
    pins_at_sync: list[dict[str, bytes]] = []

    async def sync() -> None:
        pins_at_sync.append(dict(node.transport.pins))

    async def nothing(*_: object) -> bool:
        return True

    monkeypatch.setattr(node.presence, "sync", sync)
    monkeypatch.setattr(node.presence, "publish_record", nothing)
    monkeypatch.setattr(node.ownership, "reconcile", nothing)
    await node._join([])
    assert pins_at_sync == [{"https://127.0.0.1:9000": swarm.cert(owner).tls_pin}]


async def test_a_claimant_that_never_answers_holds_a_pass_up_for_the_budget_only(
    servers, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A member that claims a newer manifest and never answers cost a membership pass a 10 s
    timeout each pass; now the pass spends at most ``CLAIMS_BUDGET_S`` on claims, the silent
    member is backed off, and the honest claim is adopted on the next pass."""
    from node.peer import presence

    monkeypatch.setattr(presence, "CLAIMS_BUDGET_S", 0.5, raising=False)
    swarm = Swarm()
    honest, silent = key(), key()
    newer = swarm.manifest.with_revoked(key().public_key).signed(swarm.founder)
    honest_server = await servers(
        honest, credentials=SwarmCredentials(newer, honest, swarm.cert(honest))
    )
    quiet = await servers(silent, stall_s=30.0)
    node, dht = _client(swarm)
    await node.transport.start()
    try:
        dht.answer = [
            swarm.record(honest, honest_server.url, version=newer.version),
            swarm.record(silent, quiet.url, version=newer.version + 1),
        ]
        await node.membership.refresh()
        started = time.monotonic()
        await node.presence.follow_manifest()
        assert time.monotonic() - started < 2.0 and quiet.hits == [MANIFEST_PATH]
        assert node.credentials is not None and node.credentials.manifest.version < newer.version
        await node.presence.follow_manifest()
        assert node.credentials.manifest.version == newer.version and quiet.hits == [MANIFEST_PATH]
    finally:
        await node.transport.close()


async def test_an_address_taken_while_its_owner_was_away_goes_back_at_the_first_probe(
    servers,
) -> None:  # type: ignore[no-untyped-def]
    """A member that names an owner's address while the owner's record has lapsed (a restart)
    holds it by records alone; one dial of the disputed address shows the owner's key there, and
    the address, its pin and the ownership go back to the owner."""
    swarm = Swarm()
    owner = await servers(key(), credentials=None)
    node, dht = _client(swarm)
    await node.transport.start()
    try:
        liar = key()
        dht.answer = [swarm.record(liar, owner.url)]  # the owner's record lapsed: only the liar's
        await node.membership.refresh()
        await node.presence.follow_manifest()
        dht.answer = [
            swarm.record(liar, owner.url),
            swarm.record(owner.signer, owner.url),
        ]  # the owner is back
        await node.membership.refresh()
        assert node.transport.pins[origin(owner.url)] == swarm.cert(liar).tls_pin  # held by records
        node.started.tg = None
        await node.presence.probe_disputes()
        assert node.transport.pins[origin(owner.url)] == swarm.cert(owner.signer).tls_pin
        assert (
            node.owner_of(0) == (owner.signer.peer_id, owner.url)
            and liar.peer_id in node.suspects()
        )
        assert node.membership.disputed() == [
            owner.url
        ]  # the liar still names it: probed again later only
        await node.presence.probe_disputes()
        assert owner.hits == [] and node.presence.address_status()["addresses_moved"] == 1
        status, buf, _, _ = await node.transport.request("GET", owner.url + MANIFEST_PATH)
        node.transport.pool.give(buf)
        assert status == 200
    finally:
        await node.transport.close()
