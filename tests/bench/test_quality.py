"""bench.quality: its parsing, the gap arithmetic, and a quick real run whose gaps come from its reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.quality import ABLATIONS, gap, main, parse_ablations, parse_set
from bench.quality_runs import Runner, Setting, baseline_key, local_flags
from node.config import RunConfig


def test_gap_is_relative_to_the_second_argument() -> None:
    assert gap(2.2, 2.0) == pytest.approx(0.1)
    assert gap(1.8, 2.0) == pytest.approx(-0.1)


def test_parse_set_reads_numbers_and_strings() -> None:
    assert parse_set(["outer_lr=0.7", "inner-steps=60", "codec=int4"]) == {
        "outer_lr": 0.7,
        "inner_steps": 60,
        "codec": "int4",
    }
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_set(["outer_lr"])


def test_parse_ablations_selects_groups_and_items() -> None:
    assert parse_ablations("") == []
    assert parse_ablations("codec") == [("codec", name) for name in ABLATIONS["codec"]]
    assert parse_ablations("H:H60,codec:int4") == [("H", "H60"), ("codec", "int4")]
    with pytest.raises(ValueError, match="unknown ablation group"):
        parse_ablations("nonsense")
    with pytest.raises(ValueError, match="unknown codec ablation"):
        parse_ablations("codec:int3")


def test_every_ablation_is_a_valid_run_config() -> None:
    for group, items in ABLATIONS.items():
        for name, fields in items.items():
            cfg = Setting(f"{group}:{name}", tuple(fields.items())).config()
            assert all(getattr(cfg, k) == v for k, v in fields.items())


def test_flags_name_only_what_differs_from_the_defaults() -> None:
    cfg = RunConfig(peers=4, outer_momentum=0.5, codec="int8")
    assert local_flags(cfg) == ["--peers", "4", "--codec", "int8", "--outer-momentum", "0.5"]
    assert local_flags(RunConfig()) == []
    with pytest.raises(ValueError, match="unknown RunConfig fields"):
        Setting("bad", (("outer_lrr", 1.0),)).config()


def test_the_baseline_key_ignores_what_data_parallel_does_not_use() -> None:
    a, b = RunConfig(codec="int4", outer_lr=0.7), RunConfig()
    assert baseline_key(a, 3e-3) == baseline_key(b, 3e-3)
    assert baseline_key(a, 3e-3) != baseline_key(b, 6e-3)
    assert baseline_key(RunConfig(seed=1), 3e-3) != baseline_key(b, 3e-3)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_quick_run_reports_gaps_computed_from_its_reports(tmp_path: Path, capsys) -> None:
    journal = tmp_path / "results.jsonl"
    out = main(
        [
            "--quick",
            "--seeds",
            "0",
            "--ablations",
            "codec:int8",
            "--dp-lrs",
            "3e-3,6e-3",
            "--dp-jobs",
            "2",
            "--out",
            str(tmp_path / "reports"),
            "--journal",
            str(journal),
            "--plot",
            str(tmp_path / "q.png"),
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(
        json.dumps(out)
    )

    run = out["main"]["per_seed"][0]
    ends = {
        m: json.loads(Path(run[m]["report"]).read_text())["eval_loss"]["end"]
        for m in ("decoupled", "sync")
    }
    tried = [
        json.loads(Path(out_dir).read_text())["eval_loss_end"]
        for out_dir in sorted((tmp_path / "reports").glob("dp-s0-*.json"))
    ]
    assert len(tried) == 2 and run["dp"]["eval_loss_end"] == min(tried)  # the better-tuned baseline
    assert run["gap_decoupled_vs_dp"] == pytest.approx(gap(ends["decoupled"], min(tried)))
    assert run["gap_sync_vs_dp"] == pytest.approx(gap(ends["sync"], min(tried)))
    assert run["gap_decoupled_vs_sync"] == pytest.approx(gap(ends["decoupled"], ends["sync"]))
    assert out["main"]["mean"]["gap_decoupled_vs_dp"]["mean"] == pytest.approx(
        run["gap_decoupled_vs_dp"]
    )

    for method in ("decoupled", "sync"):
        report = json.loads(Path(run[method]["report"]).read_text())
        assert report["config"]["mode"] == method and report["config"]["model"] == "tiny"
        assert report["tokens_trained"] == run["dp"]["tokens_trained"]  # equal tokens
        assert run[method]["bandwidth_reduction_vs_ddp"] == pytest.approx(
            report["bytes_sent_ddp_equivalent"] / report["bytes_sent"]
        )

    (ablation,) = out["ablations"]
    ab_run = ablation["per_seed"][0]
    ab_report = json.loads(Path(ab_run["decoupled"]["report"]).read_text())
    assert ab_report["config"]["codec"] == "int8" and "sync" not in ab_run  # int4 is the default
    assert ab_run["dp"]["report"] == run["dp"]["report"]  # same baseline, trained once
    assert ab_run["gap_decoupled_vs_dp"] == pytest.approx(
        gap(ab_report["eval_loss"]["end"], min(tried))
    )

    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    assert sorted((r["kind"], r.get("method")) for r in lines) == sorted(
        [
            ("local", "decoupled"),
            ("local", "sync"),
            ("local", "decoupled"),
            ("baseline", None),
            ("baseline", None),
        ]
    )
    assert (tmp_path / "q.png").stat().st_size > 0


def test_a_failed_run_is_tried_again_then_reported(tmp_path: Path) -> None:
    journal = tmp_path / "j.jsonl"
    runner = Runner(tmp_path, resume=False, journal=journal, timeout_s=60, retries=1)
    marker = tmp_path / "ran-once"
    flaky = [
        "-c",
        f"import pathlib, sys; m = pathlib.Path({str(marker)!r}); ok = m.exists(); m.touch(); "
        "print('second try' if ok else 'first try failed'); sys.exit(0 if ok else 3)",
    ]
    runner._call([sys.executable, *flaky], tmp_path / "flaky.log", "flaky")
    assert (tmp_path / "flaky.log").read_text().strip() == "second try"
    assert "first try failed" in (tmp_path / "flaky.failed0.log").read_text()
    (failure,) = [json.loads(x) for x in journal.read_text().splitlines()]
    assert failure["kind"] == "failure" and failure["exit_code"] == 3

    with pytest.raises(RuntimeError, match=r"always failed \(exit code 4"):
        runner._call(
            [sys.executable, "-c", "import sys; sys.exit(4)"], tmp_path / "bad.log", "always"
        )


def test_dp_jobs_below_one_is_refused_with_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dp_jobs must be at least 1, got 0"):
        Runner(tmp_path, resume=False, journal=None, timeout_s=60, dp_jobs=0)


def test_a_baseline_claimed_by_another_live_process_is_waited_for(tmp_path: Path) -> None:
    from bench.quality_runs import _wait_for_other_writer

    target = tmp_path / "dp-s0-x.json"
    script = (
        "import pathlib, os, sys, time; t = pathlib.Path(sys.argv[1]); l = t.with_suffix('.lock'); "
        "l.write_text(str(os.getpid())); print('claimed', flush=True); time.sleep(1); "
        "t.write_text('{\"done\": true}'); l.unlink()"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", script, str(target)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None and writer.stdout.readline().strip() == "claimed"
    _wait_for_other_writer(target, poll_s=0.1)
    assert json.loads(target.read_text()) == {"done": True}  # read only once its writer finished
    writer.wait(timeout=30)

    target.with_suffix(".lock").write_text(
        "999999999"
    )  # a writer that is gone: nothing to wait for
    _wait_for_other_writer(target, poll_s=0.1)
