"""``Started.spawn``: work a callback schedules while the peer stops is closed, not left as a
coroutine nobody awaits (a 128-peer harness run's shutdown printed "coroutine
'Ownership.reconcile' was never awaited": a reconcile scheduled into a closing task group)."""

from __future__ import annotations

import asyncio
import warnings

from node.peer.started import Started


async def _work(ran: list[int]) -> int:
    ran.append(1)
    return 7


async def test_a_serving_peer_runs_what_it_spawns() -> None:
    ran: list[int] = []
    async with asyncio.TaskGroup() as tg:
        task = Started(tg=tg).spawn(_work(ran))
    assert task is not None and task.result() == 7 and ran == [1]


async def test_work_spawned_after_the_group_closed_is_closed_not_left_unawaited() -> None:
    ran: list[int] = []
    async with asyncio.TaskGroup() as tg:
        pass
    for started in (Started(tg=tg), Started()):  # a finished group; a peer not serving
        coro = _work(ran)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "never awaited" would be a RuntimeWarning
            assert started.spawn(coro) is None
            assert coro.cr_frame is None  # closed: it can never run, and warns of nothing
    assert ran == []
