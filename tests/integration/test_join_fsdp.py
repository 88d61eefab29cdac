"""`atoll join --nproc 2 --shard fsdp`: an island of two processes that shard the built-in GPT
(FSDP2, gloo) joins a swarm beside a one-process island. Both islands end on one final model,
the two ranks gather the same whole parameters from their shards, rank 0 never holds two
fragments whole at once, and each rank holds half the parameters and AdamW state that a whole
replica (the one-process island's, a DDP rank's) holds.

Memory per rank is asserted on those bytes held, which is what sharding changes; each rank's peak
RSS is reported beside them (the "done" event's ``ranks``) and printed, not asserted: rank 0's
peak also holds the island's node and its versions in flight, which vary by ±50 MB from run to
run at this size (the "medium" preset, 4.9M parameters, 19.5 MB fp32, on windows of 32 bytes, two
per step, so that steps stay cheap on a busy CPU). ``bench.shard_memory`` compares the inner
steps' peak RSS per rank against DDP's, ``bench.island_memory`` whole islands (docs/islands.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.swarms import Proc, atoll, make_swarm, start_bootstrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # hang guards sized for a busy box

STEPS = 20
RECIPE = ["--model", "medium", "--block-size", "32", "--batch-size", "2"]
RECIPE += ["--fragments", "2", "--inner-steps", "5"]
TRAIN = ["--steps", str(STEPS), "--corpus-max-bytes", "300000", "--eval-every", "1000000"]
TRAIN += ["--eval-batches", "2", "--threads", "1", "--validate-windows", "0", "--final-sync"]
TRAIN += ["--listen", "127.0.0.1:0", "--wait-members", "2"]  # train together, end together
MB = 1 << 20


def test_an_fsdp_island_and_a_one_process_island_end_on_one_model(tmp_path: Path) -> None:
    files = make_swarm(
        tmp_path / "swarm", name="fsdp-swarm", admission="open", labs=("lab",), recipe=RECIPE
    )
    for peer in ("solo", "pair"):
        files.certify(peer, lab="lab")
    procs: list[Proc] = []
    try:
        boot_url = start_bootstrap(tmp_path, procs)
        solo = Proc(
            ["join", "--initial-peers", boot_url, *files.args("solo"), *TRAIN]
            + ["--serve-after-s", "60"],  # serves the pair's final sync; stopped below
            tmp_path / "solo.log",
        )
        pair = Proc(
            ["join", "--nproc", "2", "--shard", "fsdp", "--initial-peers", boot_url]
            + [*files.args("pair"), *TRAIN, "--serve-after-s", "5"],
            tmp_path / "pair.log",
        )
        procs += [solo, pair]
        sharded = pair.wait_event("done", 480)["result"]
        whole = solo.wait_event("done", 60)["result"]
        assert pair.proc.wait(timeout=60) == 0
    finally:
        for p in procs:
            p.stop()
    log = (tmp_path / "pair.log").read_text(errors="replace")
    assert "terminate called" not in log and "ChildFailedError" not in log, log[-3000:]
    # one model: the owners' finals on both islands, and the same whole parameters on both ranks
    assert sharded["final_param_hash"] == whole["final_param_hash"]
    assert sharded["global_versions"] == whole["global_versions"]
    assert min(sharded["global_versions"]) > 0  # it trained with the swarm
    ranks = dict(re.findall(r"rank (\d) of 2: \d+ steps, final parameters ([0-9a-f]{16})", log))
    assert ranks.keys() == {"0", "1"} and ranks["0"] == ranks["1"], log[-3000:]
    assert sharded["shard"] == "fsdp" and whole["shard"] == "none"
    assert sharded["most_fragments_gathered"] == 1  # rank 0 held one fragment whole at a time
    # memory per rank: half the parameter and AdamW bytes of a whole replica (+ uneven rows)
    assert [r["rank"] for r in sharded["ranks"]] == [0, 1]
    (alone,) = whole["ranks"]
    for r in sharded["ranks"]:
        assert r["held_bytes"] < 0.55 * alone["held_bytes"], (r, alone)
        assert r["max_rss_bytes"] > r["held_bytes"] > 0, r  # reported; compared in the docs
    print(
        {
            "fsdp_ranks": [
                {"held_mb": r["held_bytes"] / MB, "peak_rss_mb": r["max_rss_bytes"] / MB}
                for r in sharded["ranks"]
            ],
            "one_process": {
                "held_mb": alone["held_bytes"] / MB,
                "peak_rss_mb": alone["max_rss_bytes"] / MB,
            },
        }
    )


def test_fsdp_refusals_are_one_line_before_training(tmp_path: Path) -> None:
    files = make_swarm(
        tmp_path / "swarm", name="fsdp-refusals", admission="open", labs=("lab",), recipe=RECIPE
    )
    base = ["join", "--initial-peers", "http://127.0.0.1:9", *files.args("lab")]
    cases = {
        (): "add --nproc 2 or more",
        ("--nproc", "2"): "add --validate-windows 0",
        ("--nproc", "2", "--validate-windows", "0", "--compute", "standin=0.1"): "--compute real",
    }
    for extra, why in cases.items():
        out = atoll(*base, "--shard", "fsdp", *extra, check=False)
        assert out.returncode == 1 and why in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
