"""A node's status board: what its JSON shows (and cuts), what its owners' counters sum to, the
routes a real server answers, and what it never shows."""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass, field

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from node.config import RunConfig
from node.dht.membership import Member, MemberRecord
from node.peer import PeerNode
from node.status.board import MAX_MEMBERS, MAX_TEXT
from tests.node.fakes import (
    FakeClock,
    contribution,
    flat_of,
    make_owner,
    shapes_of,
    signer,
    tiny_model,
    tiny_plan,
)

pytestmark = pytest.mark.timeout(60)

HOSTILE_URL = 'http://x/"><img src=x onerror=alert(1)>' + "A" * 400
HOSTILE_LAB = "<script>alert('lab')</script>"


@dataclass
class FakeMembership:
    members: dict[bytes, Member] = field(default_factory=dict)
    ttl_s: float = 20.0

    def owner_of(
        self, _swarm: str, fragment: int, *, exclude: object = ()
    ) -> tuple[bytes, str] | None:
        ranked = sorted(self.members)
        return (
            ranked[fragment % len(ranked)],
            self.members[ranked[fragment % len(ranked)]].record.url,
        )


def _member(n: int, *, url: str = "", lab: str = "", learning: bool = True) -> Member:
    record = MemberRecord(
        url=url or f"http://127.0.0.1:{9000 + n}",
        roles=("learner", "owner"),
        reachable=True,
        manifest="m",
        learning=learning,
        step=10 * n,
    )
    cert = (
        types.SimpleNamespace(lab=lab) if lab else None
    )  # a lab name as another peer's certificate says
    return Member(signer(n).peer_id, record, expires_at=2e9, cert=cert)  # type: ignore[arg-type]


def _node(clock: FakeClock | None = None) -> PeerNode:
    model = tiny_model()
    node = PeerNode(RunConfig(max_tokens_per_step=64), signer(1), model, tiny_plan(model))
    node.membership = FakeMembership(
        {
            m.peer_id: m
            for m in (  # type: ignore[assignment]
                _member(1),
                _member(2, url=HOSTILE_URL, lab=HOSTILE_LAB),
                _member(3, learning=False),
            )
        }
    )
    if clock is not None:
        node.board.clock = node.board.metrics.clock = clock
    return node


def test_the_board_lists_members_this_node_first_and_cuts_what_peers_chose() -> None:
    node = _node()
    board = node.board.board()
    assert [m["peer_id"] for m in board["members"]][0] == signer(1).peer_id.hex()
    assert {m["peer_id"] for m in board["members"]} == {signer(n).peer_id.hex() for n in (1, 2, 3)}
    assert board["members_total"] == 3 and board["members"][0]["self"]
    hostile = next(m for m in board["members"] if m["lab"])
    assert (
        hostile["url"] == HOSTILE_URL[:MAX_TEXT] and hostile["lab"] == HOSTILE_LAB
    )  # data: escaped by the page
    learning = {m["peer_id"]: m["learning"] for m in board["members"]}
    assert not learning[signer(3).peer_id.hex()] and learning[signer(2).peer_id.hex()]
    assert [f["fragment"] for f in board["fragments"]] == [0, 1]
    assert all(f["owner_id"] and f["owned"] is None for f in board["fragments"])
    assert json.loads(node.board.board_json()) == json.loads(json.dumps(board))


def test_the_member_list_is_bounded() -> None:
    node = _node()
    many = [
        dataclasses.replace(_member(2), peer_id=i.to_bytes(32, "big"))
        for i in range(MAX_MEMBERS + 40)
    ]
    node.membership.members = {m.peer_id: m for m in many}  # type: ignore[union-attr]
    board = node.board.board()
    assert len(board["members"]) == MAX_MEMBERS and board["members_total"] == MAX_MEMBERS + 40


def test_the_loss_curve_records_the_trainer_points() -> None:
    node = _node()
    node.transport.bytes_sent = 500
    for step, loss in ((1, 3.0), (2, float("nan")), (3, 2.5)):
        node.board.record(step, loss)
    rows = node.board.board()["history"]
    assert [r[1] for r in rows] == [1, 2, 3] and [r[2] for r in rows] == [3.0, None, 2.5]
    assert rows[0][3] == 500 and node.board.loss == 2.5


def test_each_evaluation_is_drawn_on_the_validation_curve_and_the_training_loss_is_untouched() -> (
    None
):
    node = _node()
    node.board.record(10, 3.0)
    for step, loss in ((0, 5.0), (50, 4.0), (100, 3.5)):
        node.board.record_validation(step, loss)
    board = node.board.board()
    assert board["validation"] == [[0, 5.0], [50, 4.0], [100, 3.5]]
    assert node.board.loss == 3.0 and [r[1] for r in board["history"]] == [10]


async def test_owner_counters_sum_into_totals_and_metrics() -> None:
    clock = FakeClock()
    node = _node(clock)
    model = tiny_model()
    plan = tiny_plan(model)
    shapes = shapes_of(model, plan)
    owner_clock = FakeClock()
    owner = make_owner(
        plan,
        shapes,
        0,
        flat_of(model, plan, 0),
        owner_clock,
        quorum=1,
        staleness_bound=3,
        late_policy="carry",
    )
    node.owners[0] = owner
    await owner.set_expected(1)
    a, b, c = (signer(n).peer_id for n in (2, 3, 4))
    delta = torch.full_like(flat_of(model, plan, 0), 0.01)
    assert (await owner.contribute(a, contribution(delta, shapes[0], owner=owner))).accepted
    late = contribution(delta, shapes[0], base_version=0, owner=owner)  # its round has closed
    assert (await owner.contribute(b, late)).accepted
    wrong = contribution(delta, shapes[0], base_version=owner.version, base_digest=bytes(32))
    assert not (await owner.contribute(c, wrong)).accepted  # measured against another state
    assert owner.version == 2
    totals = node.board.totals()
    assert (totals.owners.merged, totals.owners.late, totals.owners.versions_published) == (2, 1, 2)
    assert totals.owners.refused == {"base": 1} and totals.owners.fragments_owned == 1
    assert totals.members == 3 and totals.island.inner_steps == 0  # not serving: no island yet
    metrics = {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for f in text_string_to_metric_families(node.board.metrics.text().decode())
        for s in f.samples
    }
    assert metrics["atoll_contributions_accepted_total{}"] == 2
    assert metrics["atoll_contributions_late_total{}"] == 1
    assert metrics['atoll_contributions_refused_total{"reason": "base"}'] == 1
    assert metrics["atoll_versions_published_total{}"] == 2
    assert metrics["atoll_merge_seconds_count{}"] == 2
    assert metrics["atoll_members{}"] == 3
    assert all(name.startswith("atoll_") for name in metrics)
    # a retired owner keeps its counts: the totals never go down
    node.owners.pop(0)
    node.ownership.retired[0] = [owner.counts]
    clock.advance(1.0)
    assert node.board.totals().owners.versions_published == 2
    assert node.board.totals().owners.fragments_owned == 0


def test_metrics_are_rendered_at_most_once_per_max_age() -> None:
    clock = FakeClock()
    node = _node(clock)
    first = node.board.metrics.text()
    node.transport.bytes_sent = 12345
    assert node.board.metrics.text() is first and node.board.metrics.renders == 1
    clock.advance(1.0)
    assert b"atoll_bytes_sent_total 12345.0" in node.board.metrics.text()
    assert node.board.metrics.renders == 2


def test_two_nodes_in_one_process_keep_their_own_registries() -> None:
    one, two = _node(), _node()
    one.transport.bytes_received, two.transport.bytes_received = 7, 9
    one.transport.direct_bodies = 3
    assert b"atoll_bytes_received_total 7.0" in one.board.metrics.text()
    assert b"atoll_bytes_received_total 9.0" in two.board.metrics.text()
    assert b"atoll_direct_bodies_total 3.0" in one.board.metrics.text()
    assert b"atoll_direct_bodies_total 0.0" in two.board.metrics.text()


async def test_a_serving_node_answers_the_page_its_script_json_and_metrics() -> None:
    node = _node()
    await node.transport.start()
    try:
        async with aiohttp.ClientSession() as s:
            bodies = {}
            for path in ("/", "/status.js", "/v1/status/board", "/metrics"):
                async with s.get(node.transport.url + path) as resp:
                    assert resp.status == 200, path
                    bodies[path] = (resp.headers, await resp.read())
    finally:
        await node.transport.close()
    headers, page = bodies["/"]
    assert headers["Content-Type"].startswith("text/html") and b'<script src="/status.js">' in page
    csp = headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    script = bodies["/status.js"][1]  # no markup made from strings, nothing fetched from elsewhere
    assert not any(
        sink in script
        for sink in (b".innerHTML", b".outerHTML", b"insertAdjacentHTML", b"document.write")
    )
    assert b"http" not in script.replace(b"http://www.w3.org/2000/svg", b"")
    assert json.loads(bodies["/v1/status/board"][1])["peer_id"] == signer(1).peer_id.hex()
    assert bodies["/metrics"][0]["Content-Type"].startswith("text/plain")
    assert b"atoll_bytes_sent_total" in bodies["/metrics"][1]
    secret = bytes([1]).hex() * 32  # signer(1)'s seed
    assert all(secret.encode() not in body for _, body in bodies.values())


async def test_standing_shows_in_status_board_metrics_and_the_final_results() -> None:
    """A sender whose work is clipped round after round falls below the standing threshold: the
    owner refuses it with the reason, and /v1/status, the board, /metrics and the per-peer
    results the report folds all show it (issue 47)."""
    from protocol.diloco.standing import Event

    node = _node(FakeClock())
    model = tiny_model()
    plan = tiny_plan(model)
    shapes = shapes_of(model, plan)
    owner = make_owner(plan, shapes, 0, flat_of(model, plan, 0), FakeClock())
    node.owners[0] = owner
    bad, good = signer(5).peer_id, signer(6).peer_id
    for v in range(6):
        owner.standing.record(bad, Event.CLIPPED, version=v)
        owner.standing.record(good, Event.MERGED, version=v)
    delta = torch.full_like(flat_of(model, plan, 0), 0.01)
    ack = await owner.contribute(bad, contribution(delta, shapes[0], owner=owner))
    assert not ack.accepted and "standing" in ack.reason
    members, node.membership = (
        node.membership,
        None,
    )  # status() wants certified members, not these fakes
    status = node.status()["standing"]["0"]
    node.membership = members
    assert status["refused"] == 1 and status["lowest"][0]["peer"] == bad.hex()[:16]
    assert node.board.board()["fragments"][0]["standing"]["refused"] == 1
    totals = node.board.totals()
    assert totals.owners.refused["standing"] == 1 and totals.owners.senders_refused == {"0": 1}
    metrics = {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for f in text_string_to_metric_families(node.board.metrics.text().decode())
        for s in f.samples
    }
    assert metrics['atoll_senders_refused_for_standing{"fragment": "0"}'] == 1
    assert (
        metrics['atoll_sender_standing_lowest{"fragment": "0"}'] < owner.standing.config.threshold
    )
    assert metrics['atoll_contributions_refused_total{"reason": "standing"}'] == 1
    scores = node.standings()
    assert scores[bad.hex()] < 0 < scores[good.hex()]
