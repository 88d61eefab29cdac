"""A running local swarm seen from outside: every peer's ``/metrics`` counters move while it
trains, and peer 0's status page, rendered in headless Chromium, lists every member and draws its
loss curve. One swarm (``atoll local``'s launcher, real peer processes) serves both tests; it
trains without end and is stopped when they are done."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.config import RunConfig
from node.run.local import ENDLESS_STEPS, LocalSwarm
from node.run.train import resolved
from tests.node.status.chromium import need_chromium, render

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SWARM = dict(
    model="tiny", peers=3, fragments=2, inner_steps=10, eval_every=10**6, corpus_max_bytes=200_000
)
WAIT_S = 150.0


def _until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.5)


async def _started(swarm: LocalSwarm) -> asyncio.Task[list[dict[str, Any]]]:
    return asyncio.create_task(swarm.run())


async def _stopped(task: asyncio.Task[list[dict[str, Any]]]) -> None:
    """Cancel the launcher and wait until it has stopped every peer (a failure is raised here)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    cfg = resolved(RunConfig(**SWARM, steps=ENDLESS_STEPS))  # type: ignore[arg-type]
    running = LocalSwarm(cfg, Path(tmp_path_factory.mktemp("status-swarm")), quiet=True)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="swarm-launcher", daemon=True)
    thread.start()
    task = asyncio.run_coroutine_threadsafe(_started(running), loop).result(10)
    try:
        _until(
            "every peer trains",
            lambda: (
                task.done()
                or (
                    len(running.peers) == cfg.peers
                    and all(p.progress.get("step", 0) >= 3 for p in running.peers)
                )
            ),
        )
        assert not task.done(), "the launcher stopped before training"
        yield running
    finally:
        asyncio.run_coroutine_threadsafe(_stopped(task), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


MOVING = ("atoll_inner_steps_total", "atoll_bytes_sent_total", "atoll_bytes_received_total")


def test_metrics_counters_move_while_the_swarm_trains(swarm: LocalSwarm) -> None:
    urls = [p.url for p in swarm.peers]
    first = [_scrape(u) for u in urls]
    for before in first:
        assert all(name in before for name in MOVING) and "atoll_loss" in before

    def moved() -> bool:
        now = [_scrape(u) for u in urls]
        each = all(n[name] > b[name] for n, b in zip(now, first, strict=True) for name in MOVING)
        published = sum(n["atoll_versions_published_total"] for n in now)
        merged = sum(n["atoll_contributions_accepted_total"] for n in now)
        sent = sum(n["atoll_learner_contributions_total{outcome=accepted}"] for n in now)
        return (
            each
            and published > sum(b["atoll_versions_published_total"] for b in first)
            and merged > 0
            and sent > 0
        )

    _until("every peer's steps and bytes grow and the owners publish versions", moved)
    last = [_scrape(u) for u in urls]
    assert sum(m["atoll_merge_seconds_count"] for m in last) >= 1
    assert all(m["atoll_members"] == len(urls) for m in last)


def test_the_status_page_lists_every_member_and_draws_the_loss_curve(swarm: LocalSwarm) -> None:
    need_chromium()
    _until(
        "peer 0 sees every member",
        lambda: all(
            p.peer_id
            in urllib.request.urlopen(f"{swarm.peers[0].url}/v1/status/board", timeout=10)
            .read()
            .decode()
            for p in swarm.peers
        ),
    )
    shown = render(swarm.peers[0].url + "/", budget_ms=4000)
    listed = re.findall(r'<tr class="member[^"]*" data-peer="([0-9a-f]+)"', shown.dom)
    assert sorted(listed) == sorted(p.peer_id for p in swarm.peers)
    assert len(re.findall(r'<tr class="fragment"', shown.dom)) == SWARM["fragments"]
    points = re.search(r'data-series="loss" data-points="(\d+)"', shown.dom)
    assert points is not None and int(points.group(1)) >= 2, "the loss curve has no line"
    problems = [
        line for line in shown.console if "Content Security Policy" in line or "Uncaught" in line
    ]
    assert not problems, problems
