"""bench.swarm_scale: its accounting (pure, on made-up reports) and one small real run."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.swarm_scale import (
    Config,
    Schedule,
    bootstrap_peers,
    dissent_causes,
    is_control,
    join_order,
    long_gaps,
    owner_agreement,
    owner_gaps,
    roster_deep_starts,
    roster_sizes,
    settled_agreement,
    spread_times,
    summarize,
    two_contents,
)
from bench.swarm_scale_cpu import StackSampler, activity_of, module_of, request_cost

ROOT = Path(__file__).resolve().parents[2]


def test_control_routes_are_everything_but_fragment_payloads() -> None:
    for route in (
        "/v1/dht:FindValue",
        "reply /v1/dht:Store",
        "/v1/fragments/*/held",
        "reply /v1/fragments/*/held",
        "reply /v1/fragments/*/latest/manifest",
        "/v1/status",
        "reply /v1/dialback",
    ):
        assert is_control(route), route
    for route in (
        "/v1/rpc:Contribution",
        "reply /v1/rpc:Contribution",
        "/v1/rpc:ReplicaState",
        "reply /v1/fragments/*/latest",
        "reply /v1/fragments/*/next",
        "reply /v1/fragments/*/final",
    ):
        assert not is_control(route), route


def test_owner_agreement_counts_pairs_that_name_the_same_owner() -> None:
    # 3 peers agree on fragment 0; on fragment 1 two of three agree (1 pair of 3), one names none
    sample = {"a": ["x", "y"], "b": ["x", "y"], "c": ["x", ""]}
    assert owner_agreement([sample], 2) == pytest.approx((1.0 + 2 / 6) / 2)
    assert owner_agreement([{"a": ["x"]}], 1) is None  # one peer: no pair to compare
    assert owner_agreement([{"a": [""], "b": [""]}], 1) == 0.0  # naming no owner is no agreement


def test_settled_agreement_leaves_out_a_moves_propagation_and_nothing_else() -> None:
    # fragment 0 moves from x to y: b learns of it at 10 s, a and c at 14 s (propagation)
    def at(t: float) -> dict[str, list[str]]:
        return {
            "a": ["y" if t >= 14 else "x"],
            "b": ["y" if t >= 10 else "x"],
            "c": ["y" if t >= 14 else "x"],
        }

    timed = [(float(t), at(t)) for t in range(0, 40, 2)]
    raw = settled_agreement(timed, 1, around_s=0.0)
    assert raw["owner_moves"] == 1 and raw["agreement"] < 1.0  # 10, 12: one pair of three
    assert raw["moves"] == [(14.0, 0, "x", "y")]  # when most peers name the new owner
    settled = settled_agreement(timed, 1, around_s=6.0)
    assert settled["agreement"] == 1.0 and settled["left_out"] == 7  # 8..20 around the move at 14
    # a peer that names another owner with no move around it is disagreement, settled or not
    timed = [(t, {**owners, "d": ["z"]}) for t, owners in timed]
    settled = settled_agreement(timed, 1, around_s=6.0)
    assert settled["agreement"] == pytest.approx(0.5)
    assert settled["dissent"][0] == (0.0, 0, "d", "z", "x") and len(settled["dissent"]) == 13


def test_dissent_causes_name_the_candidate_a_dissenter_lacks_or_holds_beside_the_majority() -> None:
    # a, b rank over {x, y}; c lacks y's record (it names x for fragment 1); d still holds
    # w's owner record, 3 s from expiry, which a and b hold as a learner's
    majority = {"c": {"x": 12.0, "y": 15.0}, "age": 1.0, "m": {"w": "learner"}}
    sample = {
        "owners": {"a": ["x", "y"], "b": ["x", "y"], "c": ["x", "x"], "d": ["w", "y"]},
        "rosters": {
            "a": majority,
            "b": majority,
            "c": {"c": {"x": 12.0}, "age": 5.0, "m": {"y": "absent"}},
            "d": {"c": {"x": 12.0, "y": 15.0, "w": 3.0}, "age": 2.0, "m": {}},
        },
    }
    dissent = settled_agreement([(4.0, sample["owners"])], 2, around_s=0.0)["dissent"]
    assert dissent == [(4.0, 0, "d", "w", "x"), (4.0, 1, "c", "x", "y")]
    got = dissent_causes(dissent, {4.0: sample}, lambda pid: {"w": "9"}.get(pid, pid))
    assert got["owner_dissent_causes"] == {"extra:learner": 1, "missing:absent": 1}
    assert got["owner_dissents_by_member"] == {"9": 1, "y": 1}
    assert got["owner_dissent_why_log"] == [
        [4.0, 0, "d", "9", "x", [], [["9", "learner", 3.0]], 2.0],
        [4.0, 1, "c", "x", "y", [["y", "absent"]], [], 5.0],
    ]


def test_roster_sizes_count_the_majoritys_candidates_the_offers_and_old_reads() -> None:
    three = {"c": {"x": 9.0, "y": 9.0, "z": 9.0}, "age": 2.0, "o": 1}
    samples = [
        {"rosters": {"a": three, "b": three, "c": {"c": {}, "age": 40.0, "o": 1}}},
        {"rosters": {"a": {**three, "o": 0}, "b": {"c": {"x": 9.0}, "age": 7.0, "o": 0}}},
    ]
    got = roster_sizes(samples)
    assert got["roster_candidates"] == {"median": 3, "max": 3}  # a tie goes one way everywhere
    assert got["roster_offering"] == {"median": 1.5, "max": 3}
    assert got["read_age_over_s"] == {"6": 0.4, "12": 0.2, "30": 0.2}


def test_places_taken_by_members_ranked_far_below_the_cap_are_counted() -> None:
    """A start is a record offering in a sample and not in the one before, by a peer ranked
    below 1.5 x cap among the run's peers; a peer offering from its first sample is no start."""
    from protocol.dht.member_reads import roster_score

    ids = {str(i): bytes([i]).hex() * 32 for i in range(8)}
    ranked = sorted(ids, key=lambda s: -roster_score("sw", bytes.fromhex(ids[s])))
    top, deep = ranked[0], ranked[-1]  # 1st and 8th of 8, with a cap of 2: below 3rd is deep

    def at(offering: set[str]) -> dict[str, object]:
        return {"rosters": {s: {"o": int(s in offering), "age": 3.0} for s in ids}}

    samples = [(0.0, at({deep})), (2.0, at(set())), (4.0, at({top, deep})), (6.0, at({deep}))]
    got = roster_deep_starts(samples, ids, "sw", cap=2)
    assert got == {"ranked_below": 3, "count": 1, "log": [[4.0, deep, 8, 3.0]]}


def test_spread_counts_only_peers_live_through_the_horizon_and_versions_judged() -> None:
    held = {
        "a": {"0:1": 10.0, "0:2": 95.0},
        "b": {"0:1": 11.0},
        "c": {"0:1": 13.5},
        "late": {"0:1": 50.0},  # joined after the version was first held: not counted
    }
    lives = {"a": (0.0, None), "b": (0.0, None), "c": (1.0, None), "late": (20.0, None)}
    times, judged = spread_times(held, lives, until=100.0, horizon_s=30.0)
    # 0:1 reaches 99 % of a, b, c (all three) at 13.5; 0:2 is too close to the end to judge
    assert times == [pytest.approx(3.5)] and judged == 1
    # a peer that leaves within the horizon is not waited for; one that never gets it fails it
    lives["c"] = (1.0, 20.0)
    held["b"] = {}
    times, judged = spread_times(held, lives, until=100.0, horizon_s=30.0)
    assert times == [] and judged == 1


def test_schedule_churns_the_share_asked_for_and_keeps_the_founder() -> None:
    cfg = Config(peers=20, duration_s=220.0, churn_at=90.0, churn=0.1)
    s = Schedule.of(cfg)
    joins = [e for e in s.events if e.kind == "join"]
    gone = [e for e in s.events if e.kind in ("leave", "kill")]
    assert len(gone) == 2 * 2  # 10 % of 20 a minute, for the two whole minutes that fit
    assert {e.kind for e in gone} == {"leave", "kill"}
    assert len(joins) == 20 + len(gone) and s.slots == 24
    assert all(e.slot != 0 for e in gone)
    assert s.steady == (cfg.join_s + cfg.settle_s, 90.0)
    assert Schedule.of(cfg) == s  # every worker derives the same one


def test_every_workers_seed_joins_first_then_the_workers_take_turns() -> None:
    order = join_order(10, per_process=4)  # workers of slots 0-3, 4-7, 8-9
    assert order[:3] == [0, 4, 8]  # the founder, then the other workers' seeds
    assert order == [0, 4, 8, 1, 5, 9, 2, 6, 3, 7]
    joins = [e for e in Schedule.of(Config(peers=10, per_process=4, join_s=9.0)).events]
    assert [e.slot for e in joins] == order and joins[-1].at == 9.0


def test_joiners_bootstrap_from_their_seed_and_the_founder_only_as_a_fallback() -> None:
    local = ["http://s", "http://a", "http://b", "http://c"]
    assert bootstrap_peers(0, seed=True, own_seed=None, local=[], founder="http://f") == []
    assert bootstrap_peers(8, seed=True, own_seed=None, local=local, founder="http://f") == [
        "http://f"
    ]
    first = bootstrap_peers(9, seed=False, own_seed="http://s", local=local, founder="http://f")
    assert first[0] == "http://s" and len(first) == 3 and "http://f" not in first
    assert len(set(first)) == 3 and set(first) <= set(local)
    # nobody of its worker joined yet: the founder; a retry names the founder last
    alone = bootstrap_peers(9, seed=False, own_seed=None, local=[], founder="http://f")
    assert alone == ["http://f"]
    retry = bootstrap_peers(
        9, seed=False, own_seed="http://s", local=local, founder="http://f", attempt=1
    )
    assert retry[0] == "http://s" and retry[-1] == "http://f"


def test_unowned_stretches_are_the_gaps_between_any_peers_owner_spans() -> None:
    spans = [(0, 0.0, 50.0), (0, 45.0, 60.0), (0, 85.0, 100.0), (1, 10.0, 100.0)]
    gaps = owner_gaps(spans, 3, start=0.0, end=100.0)
    assert gaps[0] == [25.0]  # 60 -> 85: nobody ran fragment 0's owner
    assert gaps[1] == [10.0]  # before its first owner (from start)
    assert gaps[2] == [100.0]  # never owned
    assert owner_gaps([(0, 0.0, 40.0)], 1, start=0.0, end=100.0) == {0: [60.0]}
    # the same spans by peer: who let fragment 0 go at 60 (gone at 61) and who took it at 85
    peers = {
        "a": {"owned": [[0, 0.0, 50.0]], "gone_at": None},
        "b": {"owned": [[0, 45.0, 60.0], [1, 10.0, 100.0]], "gone_at": 61.0},
        "c": {"owned": [[0, 85.0, 100.0]], "gone_at": None},
    }
    assert long_gaps(peers, 3, 0.0, 100.0, min_s=10.0) == [
        [0, 60.0, 85.0, "b", 61.0, "c"],
        [1, 0.0, 10.0, None, None, "b"],
        [2, 0.0, 100.0, None, None, None],
    ]


def test_a_version_with_two_digests_is_named() -> None:
    published = [(0, 1, "aa"), (0, 1, "aa"), (0, 2, "bb"), (0, 2, "cc"), (1, 2, "dd")]
    assert two_contents(published) == ["0:2"]
    assert two_contents([]) == []


def test_cpu_looks_are_named_by_the_task_they_ran_in() -> None:
    loop = [
        ("/x/bench/swarm_scale.py", "worker_main"),
        ("/usr/lib/python3.11/asyncio/base_events.py", "BaseEventLoop._run_once"),
        ("/usr/lib/python3.11/asyncio/events.py", "Handle._run"),
    ]
    idle = [*loop[:2], ("/usr/lib/python3.11/selectors.py", "EpollSelector.select")]
    assert activity_of(idle) == "idle"
    member = [
        *loop,
        ("/r/node/peer/node.py", "PeerNode._membership_loop"),
        ("/r/node/dht/membership.py", "Membership.refresh"),
        ("/r/protocol/wire/signing.py", "verify"),
    ]
    assert activity_of(member).startswith("membership loop")
    assert module_of(member) == "protocol/wire/signing.py"
    served = [
        *loop,
        ("/v/site-packages/aiohttp/web_protocol.py", "RequestHandler._handle_request"),
        ("/r/node/wire/transport.py", "Transport._guard"),
        ("/r/node/dht/route.py", "DHTRouter.handle"),
        ("/r/node/dht/kademlia.py", "DHTNode._on_find_node"),
        ("/v/site-packages/msgpack/fallback.py", "Packer.pack"),
    ]
    assert activity_of(served) == "serve DHT FindNode" and module_of(served) == "msgpack"
    wrapped = [*loop, ("/r/bench/swarm_scale.py", "Worker.serve"), *member[3:]]
    assert activity_of(wrapped) == activity_of(member)  # the harness's wrapper is not the task
    fetch = [
        *loop,
        ("/r/node/wire/admission.py", "Checked.middleware"),
        ("/r/node/wire/transport.py", "Transport._guard"),
        ("/r/node/peer/serving.py", "VersionServer.on_fetch"),
    ]
    assert activity_of(fetch) == "serve VersionServer.on_fetch"
    assert activity_of(fetch[:-1]) == "serve (admission, transport)"
    parsing = [*loop, ("/v/site-packages/aiohttp/web_protocol.py", "data_received")]
    assert activity_of(parsing) == "aiohttp/asyncio"


def _spin_in_bench(until: float) -> int:
    n = 0
    while time.monotonic() < until:
        n += 1
    return n


def test_the_sampler_looks_at_the_loop_thread_from_its_own_signal_handler() -> None:
    # it used to walk the loop thread's frames from another thread, racing their release
    sampler = StackSampler(period_s=0.005)
    sampler.start()
    try:
        sampler.counting.set()

        async def busy_then_idle() -> None:
            _spin_in_bench(time.monotonic() + 0.3)
            await asyncio.sleep(0.3)

        asyncio.run(busy_then_idle())
    finally:
        sampler.stop()
    report = sampler.report()
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timer is off again
    assert report["by_activity"].get("idle", 0) > 0  # the loop in select
    assert any(a.endswith("busy_then_idle") for a in report["by_activity"])  # the task named


def test_the_sampler_refuses_to_start_off_the_main_thread() -> None:
    errors: list[BaseException] = []

    def start() -> None:
        try:
            StackSampler().start()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=start)
    t.start()
    t.join(timeout=10)
    assert errors and "main thread" in str(errors[0])


def test_summarize_divides_control_bytes_by_each_peers_window() -> None:
    cfg = Config(peers=2, duration_s=100.0, join_s=1.0, settle_s=1.0, sample_s=2.0)
    peer = {
        "joined_at": 1.0,
        "gone_at": None,
        "failure": None,
        "first_held": {},
        "published": [[0, 1, "aa"]],
        "fences": {"view_reads": 1},
    }
    reports = [
        {
            "worker": 0,
            "peak_rss_mb": 300.0,
            "cpu_share": 0.05,
            "samples": [{"t": 10.0, "owners": {"0": ["x"] * 4}, "views": {"0": 2}}],
            "peers": {
                "0": {
                    **peer,
                    "owned": [[p, 1.0, 100.0] for p in range(4)],
                    "window": {
                        "s": 10.0,
                        "bytes": {"/v1/dht:Store": 500, "/v1/rpc:Contribution": 90},
                    },
                }
            },
        },
        {
            "worker": 1,
            "peak_rss_mb": 200.0,
            "samples": [{"t": 10.5, "owners": {"1": ["x"] * 4}, "views": {"1": 1}}],
            "peers": {
                "1": {
                    **peer,
                    "published": [[0, 1, "bb"], [3, 5, "cc"]],
                    "fences": {"claimant_fences": 1, "stale_view_fences": 2, "view_reads": 3},
                    "owned": [[0, 30.0, 50.0]],
                    "window": {
                        "s": 20.0,
                        "bytes": {"reply /v1/dht:FindValue": 2000},
                        "rpcs": {
                            "FindValue": 40,
                            "http /v1/dht:FindValue": 40,
                            "http /v1/fragments/*/held": 20,
                            "signatures verified": 60,
                            "signatures skipped": 20,
                        },
                    },
                }
            },
        },
    ]
    case = summarize(cfg, reports)
    assert case["control_bytes_per_peer_s"] == pytest.approx((50.0 + 100.0) / 2)
    assert case["control_by_route"] == {"reply /v1/dht:FindValue": 50.0, "/v1/dht:Store": 25.0}
    assert case["data_bytes_per_peer_s"] == pytest.approx(4.5)
    assert case["member_view"] == 1.5 and case["owner_agreement"] == 1.0
    assert case["peak_rss_mb"] == 300.0 and case["rss_mb_per_peer"] == 250.0
    assert case["dht_requests_per_peer_s"] == {"FindValue": 1.0}  # 2 a second, of 2 peers
    assert case["http_requests_per_peer_s"] == 1.5
    assert case["http_requests_by_route"] == {"/v1/dht:FindValue": 1.0, "/v1/fragments/*/held": 0.5}
    assert case["record_signatures_per_peer_s"] == {"verified": 1.5, "skipped": 0.5}
    assert case["cpu_ms_per_peer_s"] == 25.0  # 0.05 of a core for 2 peers
    assert case["unowned_max_s"] == 0.0 and case["unowned_gaps_over_lease"] == 0
    assert case["versions_published"] == 2 and case["versions_two_contents"] == ["0:1"]
    assert case["two_contents_by"] == {"0:1": ["0:aa", "1:bb"]}  # slot:digest, each publisher
    assert case["publication_fences"] == {
        "claimant_fences": 1,
        "stale_view_fences": 2,
        "view_reads": 4,
    }


def test_agreement_in_churn_is_scored_apart_from_the_calm_samples() -> None:
    cfg = Config(peers=2, duration_s=100.0, join_s=1.0, settle_s=1.0, churn_at=10.0, churn=0.5)
    assert Schedule.of(cfg).churn_windows == ((10.0, 100.0),)
    peer = {"joined_at": 1.0, "gone_at": None, "failure": None, "first_held": {}, "window": None}
    samples = [
        {"t": 4.0, "owners": {"0": ["x"], "1": ["x"]}, "views": {}},  # calm: they agree
        {"t": 20.0, "owners": {"0": ["x"], "1": ["y"]}, "views": {}},  # in churn: they do not
    ]
    reports = [
        {"worker": 0, "peak_rss_mb": 1.0, "samples": samples, "peers": {"0": peer, "1": peer}}
    ]
    case = summarize(dataclasses.replace(cfg, fragments=1), reports)
    assert case["owner_agreement"] == 1.0 and case["owner_agreement_churn"] == 0.0
    assert case["owner_dissents"] == 0  # the churn sample's dissent is not counted as calm


@pytest.mark.integration
@pytest.mark.timeout(440)  # a hang guard: 36 s quiet (49 s quiet, 86 s at load 6 at 40 s)
def test_a_small_real_swarm_is_measured(tmp_path: Path) -> None:
    # four real peers in two processes: every one joins, sees the others, names the same owners.
    # The figures are read in the steady window from join + settle (10 s) to 5 s before the end:
    # 10 s, five samples on the workers' 2 s grid (40 s gave 25 and showed nothing more)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.swarm_scale",
            "--json",
            "--peers",
            "4",
            "--per-process",
            "2",
            "--duration",
            "25",
            "--join-s",
            "4",
            "--settle-s",
            "6",
            "--step-s",
            "0.2",
            "--inner-steps",
            "10",
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (case,) = json.loads(proc.stdout.strip().splitlines()[-1])["cases"]
    assert case["peers"] == 4 and case["processes"] == 2
    assert case["joined"] == 4 and case["failed"] == 0
    assert case["member_view"] >= 3.5
    assert case["owner_agreement"] >= 0.9
    assert case["control_bytes_per_peer_s"] > 0
    assert any(route.startswith("/v1/dht") for route in case["control_by_route"])
    assert case["versions"] > 0 and case["peak_rss_mb"] > 0
    assert case["cpu_ms_per_peer_s"] > 0 and case["http_requests_per_peer_s"] > 0
    assert case["record_signatures_per_peer_s"]["verified"] > 0


@pytest.mark.timeout(60)
def test_request_cost_measures_a_real_round_trip() -> None:
    # two bare DHT nodes over the real loopback transport: every figure is a positive CPU time
    cost = asyncio.run(request_cost(requests=10, members=4))
    assert set(cost) == {"Ping", "FindValue same", "ed25519_us"}
    assert all(v > 0 for v in cost.values())
