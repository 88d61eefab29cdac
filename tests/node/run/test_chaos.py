"""The chaos spec and schedule (pure: a fake clock and a seeded rng), and the run accounting."""

from __future__ import annotations

import random

import pytest

from node.cli import main
from node.run.chaos import (
    MIN_LIVE,
    ChaosSchedule,
    ChaosSpecError,
    Kill,
    KillRule,
    Restart,
    Skip,
    goodput,
    longest_gaps,
    median_step_s,
    parse_chaos,
    uptime,
)

# --- the spec ----------------------------------------------------------------------------------


def test_default_is_a_learner_every_60s_and_an_owner_every_90s_restarted_after_20s() -> None:
    spec = parse_chaos("default", peers=4)
    assert [(k.target, k.at_s, k.every_s, k.restart_s) for k in spec.kills] == [
        ("learner", 60.0, 60.0, 20.0),
        ("owner", 90.0, 90.0, 20.0),
    ]
    assert spec.calm_for(300) == 60.0 and spec.calm_for(120) == 60.0
    assert spec.text == "default"


def test_items_of_every_kind() -> None:
    spec = parse_chaos(
        "kill=2@30s+restart10s,kill=any@every1.5m,slow=3x2.5,"
        "link=1:latency=50ms,bandwidth=10mbit,drop=0.01,calm=500ms",
        peers=4,
    )
    assert spec.kills == (
        KillRule(item="kill=2@30s+restart10s", target="2", at_s=30.0, every_s=0.0, restart_s=10.0),
        KillRule(item="kill=any@every1.5m", target="any", at_s=90.0, every_s=90.0, restart_s=None),
    )
    assert spec.slow == ((3, 2.5),)
    assert spec.links == ((1, "latency=50ms,bandwidth=10mbit,drop=0.01"),)
    assert spec.calm_s == 0.5


def test_default_combines_with_other_items_and_the_last_calm_wins() -> None:
    spec = parse_chaos("default,slow=0x3,calm=30s", peers=4)
    assert len(spec.kills) == 2 and spec.slow == ((0, 3.0),) and spec.calm_for(300) == 30.0


def test_calm_defaults_to_a_minute_or_a_quarter_of_a_short_run() -> None:
    spec = parse_chaos("kill=1@10s", peers=3)
    assert spec.calm_for(300) == 60.0 and spec.calm_for(60) == 15.0


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty item"),
        ("kill=1@15s,,slow=2x2", "empty item"),
        ("explode", "expected default or items kill=..."),
        ("kill=1", "kill=TARGET@WHEN"),
        ("kill=leader@every60s", "TARGET learner, owner, any or a peer index"),
        ("kill=learner@sometimes", "WHEN 30s (once) or every60s"),
        ("kill=learner@0s", "after 0 s"),
        ("kill=9@30s", "PEER one of 0..3"),
        ("kill=1@30s+restart", "kill=TARGET@WHEN[+restartDELAY]"),
        ("slow=3", "slow=PEERxFACTOR"),
        ("slow=3x0.5", "FACTOR >= 1"),
        ("slow=4x3", "PEER one of 0..3"),
        ("link=1", "link=PEER:PROFILE"),
        ("link=1:speed=fast", "bad link spec"),
        ("latency=50ms", "expected default or items"),
        ("calm=soon", "calm=DURATION"),
        ("calm=10s", "nothing to do"),
    ],
)
def test_bad_specs_say_what_is_expected_in_one_line_with_an_example(text: str, says: str) -> None:
    with pytest.raises(ChaosSpecError, match="e\\.g\\.") as info:
        parse_chaos(text, peers=4)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_command_line_refuses_a_bad_spec_or_duration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["local", "--peers", "4", "--chaos", "kill=7@10s"]) == 2
    assert "PEER one of 0..3" in capsys.readouterr().err
    assert main(["local", "--duration", "-5"]) == 2
    assert "expected SECONDS > 0" in capsys.readouterr().err


# --- the schedule ------------------------------------------------------------------------------


def _run(
    spec: str,
    *,
    peers: int = 4,
    duration: float = 300.0,
    owners: set[int] | None = None,
    seed: int = 0,
    dt: float = 0.5,
) -> list[tuple[float, Kill | Restart | Skip]]:
    """Drive a schedule with a fake clock; killed peers are dead until their restart."""
    schedule = ChaosSchedule(parse_chaos(spec, peers), duration, random.Random(seed))
    live, out, now = set(range(peers)), [], 0.0
    while now <= duration:
        for d in schedule.tick(now, live, (owners or set()) & live):
            out.append((now, d))
            if isinstance(d, Kill):
                assert d.peer in live and len(live) > MIN_LIVE, d
                live.discard(d.peer)
            elif isinstance(d, Restart):
                live.add(d.peer)
        now += dt
    return out


def test_default_kills_learners_and_owners_and_stops_a_minute_before_the_end() -> None:
    events = _run("default", owners={0, 1})
    kills = [(t, d) for t, d in events if isinstance(d, Kill)]
    assert [t for t, _ in kills] == [60.0, 90.0, 120.0, 180.0, 180.0, 240.0]
    assert all(t <= 300 - 60 for t, _ in kills)
    learners = [d.peer for t, d in kills if "learner" in d.reason]
    owners = [d.peer for t, d in kills if "owner" in d.reason]
    assert set(learners) <= {2, 3} and set(owners) <= {0, 1}
    restarts = [(t, d.peer) for t, d in events if isinstance(d, Restart)]
    assert [t for t, _ in restarts] == [80.0, 110.0, 140.0, 200.0, 200.0, 260.0]
    assert sorted(p for _, p in restarts) == sorted(d.peer for _, d in kills)
    assert (
        "(1 of 2 live peers owning nothing; 4 were live), restart at 80.0 s" in kills[0][1].reason
    )


def test_never_the_last_two_live_peers() -> None:
    events = _run("kill=any@every5s+restart60s", peers=4, duration=200.0)
    kills = [d for _, d in events if isinstance(d, Kill)]
    skips = [d for _, d in events if isinstance(d, Skip)]
    assert kills and skips
    assert any("only 2 live peers (never the last 2)" in s.reason for s in skips)
    # and with no restarts the swarm goes down to two peers and stays there
    events = _run("kill=any@every5s", peers=5, duration=100.0)
    assert sum(isinstance(d, Kill) for _, d in events) == 3


def test_a_kill_whose_restart_would_fall_after_the_end_is_skipped() -> None:
    events = _run("kill=1@50s+restart20s,calm=0s", duration=60.0)
    assert [type(d) for _, d in events] == [Skip]
    assert "would come after the end" in events[0][1].reason


def test_no_owner_to_kill_is_a_skip_with_counts() -> None:
    events = _run("kill=owner@10s", owners=set(), duration=100.0)
    assert [d.reason for _, d in events] == [
        "kill=owner@10s at 10.0 s: skipped, no live owners (4 live, 0 owners)"
    ]


def test_a_dead_fixed_target_is_skipped_and_a_seed_fixes_the_choice() -> None:
    events = _run("kill=1@10s+restart30s,kill=1@20s", duration=100.0)
    assert "no live peer 1" in events[1][1].reason
    a = [d.peer for _, d in _run("kill=any@every10s+restart5s", seed=7) if isinstance(d, Kill)]
    b = [d.peer for _, d in _run("kill=any@every10s+restart5s", seed=7) if isinstance(d, Kill)]
    assert a == b and len(set(a)) > 1


def test_owners_are_asked_for_only_when_a_kill_by_role_is_due() -> None:
    schedule = ChaosSchedule(parse_chaos("kill=owner@30s,kill=2@10s", 4), 100.0, random.Random(0))
    assert not schedule.owners_needed(29.0) and schedule.owners_needed(30.0)
    assert not schedule.finished()
    schedule.tick(35.0, {0, 1, 2, 3}, {0})
    assert schedule.finished() and not schedule.owners_needed(50.0)


def test_a_late_tick_catches_up_in_time_order() -> None:
    schedule = ChaosSchedule(parse_chaos("kill=any@every10s+restart1s", 6), 100.0, random.Random(0))
    out = schedule.tick(35.0, set(range(6)), set())
    assert [type(d) for d in out] == [Kill, Kill, Kill]  # at 10, 20, 30 s
    assert [type(d) for d in schedule.tick(36.0, set(range(6)), set())] == [Restart] * 3


# --- the accounting ----------------------------------------------------------------------------


def test_uptime_counts_time_when_a_fragment_went_more_than_the_window_without_a_version() -> None:
    # fragment 0 every 10 s; fragment 1 silent between 20 and 60 s; window 20 s
    published = [(float(t), 0) for t in range(10, 101, 10)] + [
        (10.0, 1),
        (20.0, 1),
        (60.0, 1),
        (80.0, 1),
    ]
    assert uptime(published, 2, 0.0, 100.0, 20.0) == pytest.approx(1 - 20 / 100)  # down 40..60
    assert uptime(published, 2, 0.0, 100.0, 50.0) == 1.0
    assert uptime([], 1, 0.0, 100.0, 30.0) == pytest.approx(0.3)  # up only for the first window
    assert uptime(published, 3, 0.0, 100.0, 20.0) == pytest.approx(0.2)  # fragment 2 never advanced
    # overlapping down time of two fragments counts once
    assert uptime(
        [(0.0, 0), (0.0, 1), (50.0, 0), (40.0, 1), (100.0, 0), (100.0, 1)], 2, 0.0, 100.0, 20.0
    ) == pytest.approx(1 - (30 + 40) / 100)


def test_uptime_with_a_window_that_grows_with_h_judges_each_wait_by_when_it_began() -> None:
    # H grows late in the run: a wait that began at 50 s or later may last 40 s, earlier ones 20 s
    published = [(10.0, 0), (45.0, 0), (55.0, 0), (90.0, 0)]
    grows = lambda t: 20.0 if t < 50 else 40.0  # noqa: E731
    assert uptime(published, 1, 0.0, 100.0, grows) == pytest.approx(
        1 - 15 / 100
    )  # down 30..45 only
    assert uptime(published, 1, 0.0, 100.0, 20.0) == pytest.approx(
        1 - (15 + 15) / 100
    )  # and 75..90


def test_longest_gap_per_fragment_counts_from_the_start_and_to_the_end() -> None:
    published = [(5.0, 0), (30.0, 0), (90.0, 0), (50.0, 1)]
    assert longest_gaps(published, 3, 0.0, 100.0) == [60.0, 50.0, 100.0]


def test_median_step_time_from_progress_events_per_incarnation() -> None:
    progress = [(0.0, 1, 0), (1.0, 1, 10), (2.0, 1, 20), (0.5, 2, 100), (1.5, 2, 105), (3.0, 3, 50)]
    assert median_step_s(progress) == pytest.approx(0.1)  # rates 0.1, 0.1, 0.2


def test_goodput_is_accepted_work_over_provisioned_time() -> None:
    results = [
        {
            "contributions_accepted": 40,
            "contributions_sent": 40,
            "steps": 200,
            "median_step_s": 0.1,
        },
        {
            "contributions_accepted": 10,
            "contributions_sent": 40,
            "steps": 200,
            "median_step_s": 0.1,
        },
    ]
    assert goodput(results, peers=2, span_s=25.0) == pytest.approx((20 + 5) / 50)
    # a killed peer's slot counts as provisioned with no goodput
    assert goodput(results, peers=4, span_s=25.0) == pytest.approx((20 + 5) / 100)
    # work lost to a kill is not in the island's steps: a resumed island counts from its checkpoint
    resumed = [{**results[0], "steps": 150}]
    assert goodput(resumed, peers=1, span_s=25.0) == pytest.approx(15 / 25)
    assert (
        goodput([{"steps": 10, "median_step_s": 1.0}], peers=1, span_s=10.0) == 0.0
    )  # nothing sent


def test_a_learner_kill_takes_any_peer_when_every_peer_owns_a_fragment() -> None:
    """Every peer learns; with as many fragments as peers each may own one, and a learner kill
    must not be skipped then (a decoupled run got fewer kills than the sync run beside it)."""
    from node.run.chaos import Kill

    schedule = ChaosSchedule(parse_chaos("kill=learner@10s+restart5s", 4), 100.0, random.Random(0))
    decisions = schedule.tick(10.0, [0, 1, 2, 3], [0, 1, 2, 3])
    assert len(decisions) == 1 and isinstance(decisions[0], Kill)
    assert "learners (all own fragments)" in decisions[0].reason


# --- the driver and the accounting, on a fake launcher --------------------------------------------


class _FakeLauncher:
    """The ``Launcher`` the chaos driver drives: peers that train until the first kill."""

    def __init__(self, peers: int) -> None:
        import types
        from pathlib import Path

        from node.config import RunConfig

        self.cfg, self.run_dir, self.startup_timeout_s = RunConfig(peers=peers), Path("."), 1.0
        self.killed: list[int] = []
        self.peers = [
            types.SimpleNamespace(
                index=i,
                started=True,
                killed=False,
                result=None,
                incarnation=0,
                proc=types.SimpleNamespace(returncode=None),
                url="",
            )
            for i in range(peers)
        ]

    def kill(self, peer) -> None:  # type: ignore[no-untyped-def]
        peer.killed = True
        for other in self.peers:  # then the others finish: the driver has nothing left to do
            if other is not peer:
                other.result = {}

    async def spawn(self, *a: object, **kw: object) -> None:
        raise AssertionError("no restart in this schedule")

    async def read(self, peer: object) -> None:
        pass

    async def send(self, peer: object, msg: object) -> None:
        pass


async def test_the_chaos_driver_kills_on_its_launcher_and_the_accounting_reports_it() -> None:
    import asyncio
    import time

    from node.run.local_chaos import ChaosDriver, run_accounting
    from node.run.local_peers import Timeline

    launcher = _FakeLauncher(4)
    timeline = Timeline(t0_mono=time.monotonic(), duration_s=None)
    timeline.train_started = timeline.t0_mono - 1.0  # the kill is due at once
    driver = ChaosDriver(parse_chaos("kill=2@1s", peers=4), launcher, timeline)  # type: ignore[arg-type]
    async with asyncio.timeout(10.0), asyncio.TaskGroup() as tg:
        await driver.run(launcher.run_dir, tg, [])
    assert [p.killed for p in launcher.peers] == [False, False, True, False]
    assert launcher.killed == [2] and driver.restarts[0]["peer"] == 2 and driver.events
    timeline.progress_log += [(timeline.train_started + s, 1, s) for s in range(10)]
    timeline.done_times.append(timeline.train_started + 10.0)
    report = run_accounting(launcher.cfg, timeline, driver, [])
    assert report["chaos"] == "kill=2@1s" and report["chaos_events"] == driver.events
    assert report["median_step_s"] == pytest.approx(1.0) and report["training_s"] == pytest.approx(
        10.0
    )
    assert run_accounting(launcher.cfg, timeline, None, [])["chaos_events"] == []
