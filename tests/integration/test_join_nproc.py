"""`atoll join --nproc 2`: an island of two processes (torchrun, gloo, DDP) joins a swarm beside a
one-process island; both ranks train, follow rank 0's adoptions and end on the same parameters,
and the island exits 0 (every rank leaves without the interpreter's teardown: docs/islands.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.swarms import Proc, make_swarm, start_bootstrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RECIPE = ["--model", "tiny", "--fragments", "2", "--inner-steps", "10"]
TRAIN = [
    "--steps",
    "80",
    "--corpus-max-bytes",
    "300000",
    "--eval-every",
    "1000000",
    "--threads",
    "1",
    "--serve-after-s",
    "0",
    "--listen",
    "127.0.0.1:0",
]


def test_an_island_of_two_processes_joins_and_its_ranks_agree(tmp_path: Path) -> None:
    files = make_swarm(
        tmp_path / "swarm", name="nproc-swarm", admission="open", labs=("lab",), recipe=RECIPE
    )
    for peer in ("solo", "pair"):
        files.certify(peer, lab="lab")
    procs: list[Proc] = []
    try:
        boot_url = start_bootstrap(tmp_path, procs)
        solo = Proc(
            ["join", "--initial-peers", boot_url, *files.args("solo"), *TRAIN],
            tmp_path / "solo.log",
        )
        pair = Proc(
            ["join", "--nproc", "2", "--initial-peers", boot_url, *files.args("pair"), *TRAIN],
            tmp_path / "pair.log",
        )
        procs += [solo, pair]
        done = pair.wait_event("done", 200)["result"]
        assert pair.proc.wait(timeout=60) == 0
        assert solo.proc.wait(timeout=120) == 0
    finally:
        for p in procs:
            p.stop()
    log = (tmp_path / "pair.log").read_text(errors="replace")
    ranks = {
        rank: (int(steps), params)
        for rank, steps, params in re.findall(
            r"rank (\d) of 2: (\d+) steps, final parameters ([0-9a-f]{16})", log
        )
    }
    assert set(ranks) == {"0", "1"}, log[-3000:]
    assert "terminate called" not in log and "ChildFailedError" not in log, log[-3000:]
    assert (
        ranks["0"] == ranks["1"]
    )  # both processes of the island took the same steps and hold the same model
    # it enters the swarm's schedule where the solo island is when it joins (0 if it had not trained yet)
    start = next((e["step"] for e in pair.events if e.get("event") == "schedule"), 0)
    assert (
        done["steps"] == 80 - start and min(done["global_versions"]) > 0
    )  # it trained with the swarm
    assert (
        done["tokens_trained"] == 2 * done["steps"] * 16 * 64
    )  # both ranks' tokens (batch 16 x 64)
