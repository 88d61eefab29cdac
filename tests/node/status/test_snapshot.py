"""The status board's parts read one frozen ``PeerStatus``: the page's JSON and the metrics are
made from a snapshot built by hand (no node), only ``node.status.snapshot`` reads a node's
insides, and ``Cached`` computes at most once per ``max_age_s``, at once again if the clock goes
back."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.status.board import board_of
from node.status.cache import Cached
from node.status.history import Point
from node.status.metrics import MetricsText
from node.status.snapshot import FragmentStatus, MemberStatus, PeerStatus
from node.status.totals import IslandTotals, OwnerTotals, Totals
from tests.node.fakes import FakeClock

pytestmark = pytest.mark.timeout(30)

STATUS = Path(__file__).resolve().parents[3] / "node" / "status"


def _status(**changes: object) -> PeerStatus:
    me = MemberStatus(
        peer_id="aa" * 32,
        lab="lab-a",
        url="https://127.0.0.1:7000",
        roles=("learner", "owner"),
        reachable=True,
        learning=True,
        step=40,
        is_self=True,
        suspect=False,
    )
    status = PeerStatus(
        swarm="s",
        peer_id=me.peer_id,
        url=me.url,
        reachable=True,
        learning=True,
        step=40,
        members=(me,),
        members_total=3,
        versions=(4, 2),
        fragments=(
            FragmentStatus(
                fragment=0,
                owner_id=me.peer_id,
                owner_url=me.url,
                version=4,
                owned=4,
                epoch=1,
                standing={"refused": 0},
            ),
            FragmentStatus(
                fragment=1,
                owner_id=None,
                owner_url=None,
                version=2,
                owned=None,
                epoch=None,
                standing=None,
            ),
        ),
        totals=Totals(
            bytes_sent=10,
            members=3,
            island=IslandTotals(inner_steps=40, goodput=float("nan")),
            owners=OwnerTotals(merged=5, versions_published=4),
        ),
    )
    return dataclasses.replace(status, **changes)  # type: ignore[arg-type]


def test_a_snapshot_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _status().step = 41  # type: ignore[misc]


def test_the_page_json_is_made_from_a_snapshot_alone() -> None:
    board = board_of(_status(), [Point(1.0, 40, 2.5, 10, 20)], loss=2.5)
    assert board["peer_id"] == "aa" * 32 and board["members_total"] == 3
    assert board["members"][0]["self"] and board["members"][0]["roles"] == ["learner", "owner"]
    assert [f["owned"] for f in board["fragments"]] == [4, None]
    assert board["history"] == [[1.0, 40, 2.5, 10, 20]]
    assert board["totals"]["island"]["goodput"] is None  # NaN: JSON has none
    assert board["validation"] == []  # no evaluation yet


def test_the_page_json_carries_each_evaluations_held_out_loss_by_step() -> None:
    held = [
        Point(1.0, 0, 5.5, 0, 0),
        Point(9.0, 100, float("nan"), 5, 5),
        Point(20.0, 200, 4.25, 9, 9),
    ]
    board = board_of(_status(), [], loss=None, validation=held)
    assert board["validation"] == [[0, 5.5], [200, 4.25]]  # a non-finite loss is left out
    json.dumps(board, allow_nan=False)  # what the page reads is valid JSON


def test_the_metrics_are_made_from_a_snapshot_alone() -> None:
    status = _status()
    text = MetricsText(lambda: (status, 2.5)).text().decode()
    samples = {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples["atoll_bytes_sent_total[]"] == 10
    assert samples["atoll_contributions_accepted_total[]"] == 5
    assert samples["atoll_loss[]"] == 2.5
    assert samples["atoll_fragment_version[('fragment', '1')]"] == 2


def test_no_status_module_reads_a_node() -> None:
    """No module of node/status/ reads an attribute of a ``node`` (the peer) or imports the peer:
    the peer builds the snapshot (``node.peer.status``)."""
    readers = {}
    for path in sorted(STATUS.glob("*.py")):
        tree = ast.parse(path.read_text())
        reads = {
            ast.unparse(n)
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "node"
        }
        if reads:
            readers[path.name] = reads
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        if any(m == "node.peer" or m.startswith("node.peer.") for m in imported):
            readers.setdefault(path.name, set()).add("imports node.peer")
    assert not readers, readers


def test_cached_computes_at_most_once_per_max_age() -> None:
    clock, calls = FakeClock(), []
    cached = Cached(lambda: calls.append(clock()) or len(calls), max_age_s=1.0, clock=clock)
    assert cached.get() == 1 and cached.get() == 1
    clock.advance(0.999)
    assert cached.get() == 1
    clock.advance(0.001)
    assert cached.get() == 2 and cached.computed == 2
    cached.clear()
    assert cached.get() == 3


def test_cached_computes_again_when_the_clock_goes_back() -> None:
    clock = FakeClock(1000.0)
    n = iter(range(10))
    cached = Cached(lambda: next(n), max_age_s=60.0, clock=clock)
    assert cached.get() == 0
    clock.now = 10.0  # back by 990 s: not kept until the clock catches up
    assert cached.get() == 1
    assert cached.get() == 1


def test_cached_with_no_max_age_computes_every_time_and_refuses_a_bad_one() -> None:
    n = iter(range(10))
    cached = Cached(lambda: next(n), max_age_s=0.0, clock=FakeClock())
    assert [cached.get() for _ in range(3)] == [0, 1, 2]
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_age_s"):
            Cached(lambda: 0, max_age_s=bad)
