"""CLI argument handling: config errors are clear and exit 2, never a traceback."""

from __future__ import annotations

import math
import re

import pytest

from node.cli import _host_port, _parse_kills, _parse_slow, main
from node.config import RunConfig


def test_fault_injection_specs() -> None:
    assert _parse_kills(["1@100", "2@5"], 3) == {1: 100, 2: 5}
    assert _parse_slow(["2@3", "0@1.5"], 3) == {2: 3.0, 0: 1.5}
    for bad in (["0@10"], ["3@10"], ["1"], ["x@1"], ["1@-4"]):
        with pytest.raises(ValueError, match="PEER@STEP"):
            _parse_kills(bad, 3)
    for bad in (["2@0.5"], ["5@2"], ["2@fast"], ["2"]):
        with pytest.raises(ValueError, match="PEER@FACTOR"):
            _parse_slow(bad, 3)


def test_host_port() -> None:
    assert _host_port("127.0.0.1:7000") == ("127.0.0.1", 7000)
    assert _host_port(":0") == ("0.0.0.0", 0)
    with pytest.raises(SystemExit, match="HOST:PORT"):
        _host_port("localhost")


def test_config_mistakes_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--peers", "0", "--codec", "int3"]) == 2
    err = capsys.readouterr().err
    assert "--peers must be >= 1" in err and "--codec must be" in err
    assert main(["local", "--kill", "0@5"]) == 2
    assert "peer 0 founds the swarm" in capsys.readouterr().err


def test_run_config_json_round_trip_and_unknown_keys() -> None:
    cfg = RunConfig(peers=4, model="tiny")
    assert RunConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown config keys"):
        RunConfig.from_json('{"peers": 2, "pears": 3}')


def test_the_end_of_run_flush_follows_the_outer_step_unless_told() -> None:
    # auto: on with plain averaging, off with outer momentum (one more momentum step past the end)
    assert RunConfig().flushes and not RunConfig(outer_momentum=0.9).flushes
    assert RunConfig(outer_momentum=0.9, final_flush=1).flushes
    assert not RunConfig(final_flush=0).flushes
    with pytest.raises(ValueError, match=r"--final-flush must be -1 \(auto\), 0 or 1, got 2"):
        RunConfig(final_flush=2)


def test_a_merge_waits_for_every_learner_under_outer_momentum_unless_told() -> None:
    # auto: half the learners with plain averaging; all with momentum, whose partial merges diverged
    from types import SimpleNamespace

    from node.peer.ownership import Ownership

    assert RunConfig().merge_quorum_fraction == 0.5
    assert RunConfig(outer_momentum=0.9).merge_quorum_fraction == 1.0
    assert RunConfig(outer_momentum=0.9, quorum_fraction=0.25).merge_quorum_fraction == 0.25
    assert RunConfig(quorum_fraction=0.0).merge_quorum_fraction == 0.0
    owner_cfg = Ownership._merge_cfg(
        SimpleNamespace(cfg=RunConfig(outer_momentum=0.9, max_tokens_per_step=2048))
    )  # type: ignore[arg-type]
    assert owner_cfg.quorum_fraction == 1.0
    # and counts at most 2H steps of any contribution (a learner faster than the round's pace)
    assert owner_cfg.max_work_steps == 2 * RunConfig().inner_steps
    assert RunConfig().merge_max_work_steps is None
    assert RunConfig(outer_momentum=0.9, inner_steps=10).merge_max_work_steps == 20
    with pytest.raises(
        ValueError, match=r"--quorum-fraction must be -1 \(auto\) or between 0 and 1, got 1.5"
    ):
        RunConfig(quorum_fraction=1.5)


def test_topk2_codec_and_its_block_size() -> None:
    assert RunConfig(codec="topk2", block_size=50).codec == "topk2"
    with pytest.raises(ValueError, match="--block-size must be 1..4096 with topk2"):
        RunConfig(codec="topk2", block_size=5000)


@pytest.mark.parametrize("budget", [0.5, float("nan"), float("inf"), 2000.0])
def test_an_owner_upload_budget_below_the_fanout_or_not_finite_is_refused(budget: float) -> None:
    with pytest.raises(
        ValueError, match="--owner-max-uploads must be 0 .no budget. or between --owner-fanout"
    ):
        RunConfig(owner_max_uploads=budget)
    assert RunConfig(owner_max_uploads=0).owner_max_uploads == 0  # no budget
    with pytest.raises(ValueError, match="--owner-max-uploads"):
        RunConfig(owner_fanout=4, owner_max_uploads=3)


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_each_commands_help_lists_what_it_uses_with_each_default_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    join = _help(capsys, "join")
    assert "--peers" not in join and "--initial-peers" in join and "--json-logs" in join
    assert "--inner-steps" not in join  # the recipe is the manifest's
    local = _help(capsys, "local")
    assert "--peers PEERS" in local and "--initial-peers" not in local
    for argv in (
        ["local"],
        ["join"],
        ["bootstrap"],
        ["status"],
        ["replay"],
        ["swarm", "init"],
        ["swarm", "certify"],
        ["keygen"],
        ["peer"],
        [],
    ):
        text = " ".join(_help(capsys, *argv).split())
        assert not re.search(r"\(default: [^)]*\) \(default:", text), argv
        assert (
            "(default: None)" not in text
            and "(default: )" not in text
            and "(default: False)" not in text
        )
    local = " ".join(local.split())
    assert "--steps STEPS inner steps per island (default: 9000) --batch-size" in local
    assert (
        "--corpus CORPUS a text file or folder to train on (default: the Python standard library's .py files) "
        "--corpus-max-bytes CORPUS_MAX_BYTES read at most this many corpus bytes --sharding SHARDING"
        in local
    )
    assert "(default: contiguous) --steps" in local


def test_every_flag_the_tests_and_docs_pass_to_join_still_parses() -> None:
    from node.cli import _parser

    args = _parser().parse_args(
        [
            "join",
            "--initial-peers",
            "http://127.0.0.1:7000",
            "--manifest",
            "s.toml",
            "--key",
            "k",
            "--cert",
            "c",
            "--listen",
            "127.0.0.1:0",
            "--public-address",
            "h:1",
            "--serve-after-s",
            "0",
            "--checkpoint-dir",
            "d",
            "--steps",
            "10",
            "--corpus",
            "x",
            "--corpus-max-bytes",
            "2000000",
            "--eval-every",
            "1000000",
            "--eval-batches",
            "1",
            "--threads",
            "1",
            "--lr",
            "0.001",
            "--warmup-steps",
            "1",
            "--weight-decay",
            "0",
            "--device",
            "cpu",
            "--adopt-alpha",
            "0.5",
            "--overlap-block",
            "0",
            "--link",
            "latency=1ms",
            "--json-logs",
        ]
    )
    assert (args.steps, args.corpus_max_bytes, args.serve_after_s, args.json_logs) == (
        10,
        2000000,
        0.0,
        True,
    )


def test_a_usage_mistake_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["join", "--initial-peers", "http://h:1", "--key", "k", "--steps", "many"])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "atoll join: argument --steps: invalid int value: 'many' (see atoll join --help)\n"
    )


def test_a_flag_mistake_is_told_before_torch_is_imported() -> None:
    """``atoll local`` checks its flags first: a mistake costs a fraction of a second, not the
    seconds of importing torch (a fresh interpreter, so nothing imported it yet). ``atoll join``
    does the same after reaching the swarm (tests/node/test_cli_mistakes.py)."""
    import subprocess
    import sys

    probe = (
        "import sys; from node.cli import main; "
        "codes = [main(a) for a in (['local', '--peers', '0'], ['local', '--model', 'huge'], "
        "['local', '--threads', '0'], ['local', '--update-codec', 'int3'])]; "
        "print(*codes, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["2", "2", "2", "2", "False"], out


def test_the_launcher_makes_its_swarm_without_torch(tmp_path) -> None:
    """``atoll local``'s launcher only starts, watches and reports: it writes the swarm (keys,
    manifest with the resolved recipe, certificates) without importing torch, so its peers start
    seconds sooner (each peer imports torch itself)."""
    import subprocess
    import sys

    probe = (
        "import sys; from pathlib import Path; from node.config import RunConfig; "
        "from node.run.local import LocalSwarm; "
        f"cfg = LocalSwarm(RunConfig(peers=2, model='tiny'), Path({str(tmp_path)!r})).make_swarm(); "
        "print(cfg.max_tokens_per_step, sorted(p.name for p in Path("
        f"{str(tmp_path / 'swarm')!r}).iterdir()), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == (
        "1024 ['authority.key', 'founder.key', 'peer0.cert', 'peer0.key', 'peer1.cert', "
        "'peer1.key', 'swarm.toml'] False"
    ), out


def test_the_inner_learning_rate_floor_reaches_every_island_and_the_baseline() -> None:
    from node.diloco.inner import lr_at
    from node.workload.baseline import train_config_for

    tcfg = train_config_for(RunConfig(min_lr_ratio=0.0, steps=1000, lr=1e-3))
    assert tcfg.min_lr_ratio == 0.0 and lr_at(999, tcfg) < 1e-8 < lr_at(500, tcfg)
    assert train_config_for(RunConfig()).min_lr_ratio == 0.1
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="--min-lr-ratio must be in"):
            RunConfig(min_lr_ratio=bad)


def _manifest(recipe: dict[str, object]):  # type: ignore[no-untyped-def]
    from protocol.wire.membership import SwarmManifest

    return SwarmManifest(name="s", founder=b"\x01" * 32, recipe=tuple(sorted(recipe.items())))  # type: ignore[arg-type]


def _join_args(*flags: str):  # type: ignore[no-untyped-def]
    from node.cli import _parser

    return _parser().parse_args(
        ["join", "--initial-peers", "http://127.0.0.1:7000", "--key", "k", *flags]
    )


def test_a_joiner_follows_the_schedule_in_the_swarms_manifest_but_for_the_flags_it_gives() -> None:
    """A volunteer who joins a 100,000-step swarm with no --steps trains on that schedule (it
    used to run its own 3,000 steps, and joining on the swarm's step, past its end, trained
    nothing); a flag given on the command line still wins, field by field."""
    from node.run.join import join_config, schedule_source

    swarm = _manifest(
        {
            "steps": 100_000,
            "lr": 0.002,
            "warmup_steps": 500,
            "min_lr_ratio": 0.05,
            "inner_steps": 50,
        }
    )
    cfg = join_config(swarm, _join_args())
    assert (cfg.steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio, cfg.inner_steps) == (
        100_000,
        0.002,
        500,
        0.05,
        50,
    )
    assert schedule_source(swarm, _join_args()) == "the swarm's schedule"

    own = _join_args("--steps", "2000", "--lr", "0.001")
    cfg = join_config(swarm, own)
    assert (cfg.steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio) == (2000, 0.001, 500, 0.05)
    assert (
        schedule_source(swarm, own)
        == "the swarm's schedule, but --steps, --lr from the command line"
    )

    # a manifest of before the schedule travelled in it: the joiner's flags or their defaults
    old = _manifest({"inner_steps": 50})
    assert (join_config(old, _join_args()).steps, join_config(old, _join_args()).lr) == (
        RunConfig().steps,
        RunConfig().lr,
    )
    assert join_config(old, own).steps == 2000
    assert "has none" in schedule_source(old, _join_args())


def test_a_joiner_cannot_keep_its_own_value_of_a_swarm_wide_field() -> None:
    from node.dht.membership import config_from_manifest

    swarm = _manifest({"inner_steps": 50, "steps": 900})
    cfg = config_from_manifest(
        swarm, RunConfig(inner_steps=7, steps=10), keep={"inner_steps", "steps"}
    )
    assert (cfg.inner_steps, cfg.steps) == (50, 10)


def test_a_schedule_in_a_recipe_that_no_learner_could_follow_is_refused_when_read_or_written(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    from node.run.join import join_config

    for bad in ({"steps": 0}, {"min_lr_ratio": 2.0}, {"lr": "fast"}):
        with pytest.raises(ValueError, match="steps|min-lr-ratio|lr"):
            join_config(_manifest(bad), _join_args())
    assert main(["keygen", "--out", str(tmp_path / "f.key")]) == 0
    for flag, value in (("--lr", "0"), ("--warmup-steps", "-1"), ("--steps", "0")):
        code = main(
            [
                "swarm",
                "init",
                "--name",
                "s",
                "--founder",
                str(tmp_path / "f.key"),
                "--out",
                str(tmp_path / "s.toml"),
                "--model",
                "tiny",
                flag,
                value,
            ]
        )
        assert code != 0 and not (tmp_path / "s.toml").exists()


def test_peers_on_other_schedules_still_agree_on_the_swarm() -> None:
    """The schedule is not swarm-wide: a learner with another --steps or --lr is a member all the
    same (its steps weigh its contributions, which the merge bounds)."""
    from node.dht.membership import manifest_hash

    assert manifest_hash(
        RunConfig(steps=10, lr=0.1, warmup_steps=0, min_lr_ratio=0.5)
    ) == manifest_hash(RunConfig())
    assert manifest_hash(RunConfig(inner_steps=7)) != manifest_hash(RunConfig())
