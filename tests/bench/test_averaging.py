"""bench.averaging: its inputs and checks, and a tiny real run of its Atoll and raw sides."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import bench.averaging
from bench.averaging import main, memory_needed_mb, memory_shortfall, parse_case
from bench.averaging_inputs import (
    CHUNK,
    Layout,
    classify,
    delta,
    initial,
    mean_of,
    relative_error,
    tolerance,
)
from protocol.diloco.compression import compress, decompress


def test_parse_case() -> None:
    assert parse_case("4x50M") == (4, 50_000_000)
    assert parse_case("8x10k") == (8, 10_000)
    assert parse_case("2x1.5M") == (2, 1_500_000)
    assert parse_case("3x1000") == (3, 1000)


def test_a_case_is_skipped_per_codec_by_the_memory_its_largest_group_needs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # 8 x 50M: Atoll and raw in fp32 fit in 23 GiB (measured: 19.4 GiB of peak RSS together), bf16
    # does not; hivemind alone fits; all three in the same processes do not
    atoll, hivemind = ["atoll", "raw"], ["hivemind"]
    assert memory_needed_mb(8, 50_000_000, atoll) < memory_needed_mb(8, 50_000_000, atoll, "fp16")
    assert memory_needed_mb(8, 50_000_000, atoll, "fp16") < memory_needed_mb(
        8, 50_000_000, atoll, "int8"
    )
    monkeypatch.setattr(bench.averaging, "available_mb", lambda: 23 * 1024)
    systems = atoll + hivemind
    assert memory_shortfall(8, 50_000_000, systems, True, "none") is None
    reason = memory_shortfall(8, 50_000_000, systems, True, "fp16")
    assert reason is not None and reason.startswith(
        "not run: 8 peers x 50,000,000 parameters with codec fp16"
    )
    assert memory_shortfall(8, 50_000_000, systems, False, "none") is not None  # --no-isolate
    assert memory_shortfall(4, 10_000_000, systems, False, "fp16") is None


def test_inputs_are_seeded_and_chunks_stand_alone() -> None:
    layout = Layout(3 * CHUNK + 5, 2)
    assert layout.sizes() == [(3 * CHUNK + 5) // 2, 3 * CHUNK + 5 - (3 * CHUNK + 5) // 2]
    whole = delta(7, layout, 2, 1, 1)
    assert torch.equal(whole, delta(7, layout, 2, 1, 1))
    assert not torch.equal(whole, delta(7, layout, 2, 0, 1))  # another peer
    assert not torch.equal(whole, delta(7, layout, 3, 1, 1))  # another round
    assert torch.equal(delta(7, layout, 2, 1, 1, range(1, 2)), whole[CHUNK : 2 * CHUNK])
    assert torch.equal(initial(7, layout, 0), initial(7, layout, 0))


def _rounded(
    full: torch.Tensor, base: torch.Tensor, deltas: list[torch.Tensor], codec: str
) -> torch.Tensor:
    """``full`` as a codec leaves it; int8: every input and the update quantised, the update
    with an owner residual as large as one int8 rounding carried in (as in later rounds)."""
    if codec == "fp16":
        return full.half().float()
    if codec == "int8":
        q = [decompress(compress(d, "int8")[0]) for d in deltas]
        update = -mean_of(q)
        residual = compress(update, "int8")[1]  # a previous round's leftover, about as large
        return base + decompress(compress(update + residual, "int8")[0])
    return full


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_a_merge_missing_one_input_is_told_from_codec_rounding(codec: str) -> None:
    layout = Layout(CHUNK, 1)
    base = initial(0, layout, 0)
    deltas = [delta(0, layout, 0, i, 0) for i in range(8)]
    full, partial = base - mean_of(deltas), base - mean_of(deltas[:-1])
    rounded = _rounded(full, base, deltas, codec)
    assert relative_error(rounded, full, base) < tolerance(codec)
    assert relative_error(partial, full, base) > 5 * tolerance(codec)
    errors = {
        "all": relative_error(partial, full, base),
        "survivors": relative_error(partial, partial, base),
    }
    assert classify(errors, codec) == "survivors"
    assert classify({"all": 0.5}, codec) == "neither"


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> tuple[str, dict, dict]:  # type: ignore[no-untyped-def,type-arg]
    """One tiny run of Atoll and raw (2 peers x 40k values, 2 fragments), with the memory guard
    off where the estimate says no memory is left, and the guarded try that skipped it before:
    the merge checks and the guard are both read from them, so the suite runs the swarm once
    (each run costs ~14 s of CPU here)."""
    systems = "atoll,raw,hivemind" if importlib.util.find_spec("hivemind") else "atoll,raw"
    args = ["--cases", "2x40k", "--codecs", "none", "--systems", systems, "--repeats", "1"]
    args += ["--warmup", "0", "--fragments", "2", "--no-kill", "--timeout", "120"]
    args += ["--log-dir", str(tmp_path_factory.mktemp("averaging"))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench.averaging, "available_mb", lambda: 0)
        skipped = main(args)
        ran = main([*args, "--no-memory-guard"])
    return systems, skipped, ran


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_tiny_run_of_atoll_and_raw_checks_every_merge(tiny_runs) -> None:  # type: ignore[no-untyped-def]
    systems, _, out = tiny_runs
    case = out["cases"][0]
    assert (case["peers"], case["params"]) == (2, 40_000)
    assert case["atoll_s"] > 0 and case["raw_s"] > 0
    run = case["atoll_runs"][0]
    assert (
        run["ok"] and run["check"]["matches"] == ["all"] and run["check"]["identical_on_every_peer"]
    )
    assert {f["matches"] for f in run["check"]["fragments"]} == {"all"}
    # where the round went: the node's loop and the trainer did work, and each peer sent its
    # contribution for the fragment the other owns (2 peers x 2 fragments, one owned by each)
    assert {"loop", "trainer"} <= set(run["cpu_by_thread"])
    assert run["messages"]["/v1/rpc:Contribution"] == 2
    assert "raw" in case["raw_runs"][0]["cpu_by_thread"]
    if "hivemind" in systems:
        assert case["hivemind_runs"][0]["check"]["matches"] == ["all"]
    else:
        assert case["hivemind_s"] is None and case["hivemind_error"]


def _two_rounds_of_atoll_and_raw(tmp_path, codec: str) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """The case of a tiny run (2 peers x 40k values, 2 fragments) timing two rounds of Atoll and
    raw after one untimed round (not the default three: one is enough for the first timed round
    to carry an owner residual from a round before it)."""
    out = main(
        [
            "--cases",
            "2x40k",
            "--codecs",
            codec,
            "--systems",
            "atoll,raw",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--fragments",
            "2",
            "--no-kill",
            "--timeout",
            "120",
            "--log-dir",
            str(tmp_path),
        ]
    )
    return out["cases"][0]  # type: ignore[no-any-return]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_tiny_bf16_run_checks_every_merge_against_the_owners_own_fp32_state(tmp_path) -> None:
    # the owner merges into its fp32 state and publishes it in bf16, while learners measure
    # against their bf16 copy: a reference merged into that copy matched no round after the first
    case = _two_rounds_of_atoll_and_raw(tmp_path, "fp16")
    assert (case["codec"], case["atoll_codec"]) == ("fp16", "bf16 up / bf16 down")
    for run in case["atoll_runs"]:
        assert (
            run["ok"]
            and run["check"]["matches"] == ["all"]
            and run["check"]["identical_on_every_peer"]
        )
        assert max(f["errors"]["all"] for f in run["check"]["fragments"]) < tolerance("none")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_tiny_int8_run_ships_updates_and_checks_every_merge(tmp_path) -> None:
    case = _two_rounds_of_atoll_and_raw(tmp_path, "int8")
    assert (case["codec"], case["atoll_codec"], case["raw_codec"]) == (
        "int8",
        "int8 up / int8 update down",
        "fp32",
    )
    assert case["atoll_s"] > 0 and case["raw_s"] > 0
    for run in case["atoll_runs"]:  # each carries an owner residual from the rounds before it
        assert (
            run["ok"]
            and run["check"]["matches"] == ["all"]
            and run["check"]["identical_on_every_peer"]
        )
        assert run["versions_received"] == 2 * 2 and run["update_mismatches"] == 0
        # every version of a fragment it does not own comes to a peer as an int8 update: its
        # learner downloads and applies it, or (a signed swarm) it is the fragment's replica and
        # its learner takes the state the owner's update handoff gave (its own fragments'
        # versions its learner may take locally)
        for i, (applied, replica) in enumerate(
            zip(run["updates_applied_per_peer"], run["versions_replica_per_peer"], strict=True)
        ):
            assert applied + replica >= 2 - case["owners"].count(i)
        assert sum(run["versions_replica_per_peer"]) == 2  # 2 peers: the non-owner is the replica
        # the check replays the owner's residual: the reference is the owners' own result
        assert max(f["errors"]["all"] for f in run["check"]["fragments"]) < tolerance("none")


def test_hivemind_is_never_imported_by_node_or_protocol() -> None:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in [*root.glob("node/**/*.py"), *root.glob("protocol/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "hivemind"
            ]
    assert offenders == []


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_peer_killed_mid_round_leaves_the_survivors_a_checked_merge_within_seconds(
    tmp_path,
) -> None:
    """The kill test on Atoll (elastic: a death lowers the rounds' quorum): the survivors hold
    a version of every fragment above the one they had, the same on each, every fragment a merge
    of whole contributions (all, the survivors, or a named subset; never "neither"), well before
    the 60 s timeout."""
    out = main(
        [
            "--cases",
            "3x40k",
            "--codecs",
            "none",
            "--systems",
            "atoll",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--fragments",
            "3",
            "--kill-at",
            "0.1",
            "--timeout",
            "60",
            "--log-dir",
            str(tmp_path),
        ]
    )
    kill = out["cases"][0]["kill"]["atoll"]
    assert kill["killed_peer"] == 2 and kill["recovered"], kill.get("errors")
    assert kill["seconds_to_merged"] < 30 and not kill["silently_partial"]
    assert kill["check"]["identical_on_every_peer"]
    assert all(f["matches"] != "neither" and f["version"] >= 2 for f in kill["check"]["fragments"])


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_no_memory_guard_runs_a_case_the_estimate_would_skip(tiny_runs) -> None:  # type: ignore[no-untyped-def]
    # a new size (4 x 124M) is run once unguarded to measure its peak; the guard skips it otherwise
    _, skipped, ran = tiny_runs
    assert skipped["cases"][0]["atoll_s"] is None
    assert skipped["cases"][0]["error"].startswith("not run: 2 peers")
    case = ran["cases"][0]
    assert ran["config"]["memory_guard"] is False and "error" not in case
    assert case["atoll_s"] > 0 and case["raw_s"] > 0 and case["peak_rss_mb"][0] > 0
    assert "4x124M" in bench.averaging.DEFAULT_CASES.split(",")


def test_4x124m_fits_the_box_with_its_measured_peak(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # 4 x 124M, Atoll and raw: 6132 + 4243 + 4005 + 3985 MiB of peak RSS measured (2026-12-06)
    need = memory_needed_mb(4, 124_000_000, ["atoll", "raw"])
    assert 18_365 <= need <= 19_500
    monkeypatch.setattr(bench.averaging, "available_mb", lambda: 21 * 1024)
    systems = ["atoll", "raw", "hivemind"]
    assert memory_shortfall(4, 124_000_000, systems, True, "none") is None
    assert memory_shortfall(4, 124_000_000, systems, True, "fp16") is not None


def test_perf_samples_are_counted_by_category_inside_the_timed_rounds_only() -> None:
    """``bench.averaging_perf`` keeps the samples whose time falls in a timed round of the
    system asked (a case's first rounds left out with ``skip``) and counts each by its innermost
    native function: BLAKE3, torch's kernels, the kernel's copies, the interpreter. A head whose
    pid perf padded with spaces is a head, not a frame (read as a frame, every sample of a
    process with a short pid was lost: 0 samples a round)."""
    from bench.averaging_perf import categorize, classify, windows

    result = {
        "cases": [
            {
                "atoll_runs": [{"wall": [10.0, 12.0]}, {"wall": [20.0, 22.0]}],
                "raw_runs": [{"wall": [15.0, 16.0]}],
            }
        ]
    }
    assert windows(result, "atoll") == [(10.0, 12.0), (20.0, 22.0)]
    assert windows(result, "atoll", skip=1) == [(20.0, 22.0)]
    script = [
        "101 11.000000000: ",
        "\t7f01 _blake3_hash_many_avx2+0x10 (/venv/blake3.cpython-311-x86_64-linux-gnu.so)",
        "\t7f02 blake3::hash (/venv/blake3.cpython-311-x86_64-linux-gnu.so)",
        "",
        "101 21.000000000: ",
        "\tffff81 _copy_to_iter+0x3 ([kernel.kallsyms])",
        "\tffff82 tcp_recvmsg ([kernel.kallsyms])",
        "",
        " 5902 21.500000000: ",  # perf pads a short pid with spaces
        "\t7f03 _PyEval_EvalFrameDefault+0x99 (/usr/lib/libpython3.11.so.1.0)",
        "",
        "102 15.500000000: ",  # a raw round: not counted for atoll
        "\t7f04 __memmove_avx_unaligned_erms (/usr/lib/libc.so.6)",
    ]
    counts, total = categorize(script, windows(result, "atoll"))
    assert total == 3
    assert counts == {
        "BLAKE3": 1,
        "kernel copies (TCP send and receive)": 1,
        "Python interpreter": 1,
    }
    counts, total = categorize(script, windows(result, "atoll", skip=1))
    assert total == 2 and "BLAKE3" not in counts
    assert classify("at::native::add_kernel(...)", "libtorch_cpu.so") == "torch add_kernel"
    assert classify("clear_page_erms", "[kernel.kallsyms]") == "kernel page faults (fresh pages)"


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_tiny_run_with_every_version_sent_by_its_owner_checks_every_merge(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--owner-fanout 2`` at 3 peers: each owner uploads every version to both other
    learners itself (raw's owners answer every peer); the swarm's manifest and every peer
    carry it, and every merge still checks out."""
    out = main(
        ["--cases", "3x40k", "--codecs", "none", "--systems", "atoll", "--warmup", "0"]
        + ["--repeats", "1", "--fragments", "3", "--no-kill", "--timeout", "120"]
        + ["--owner-fanout", "2", "--log-dir", str(tmp_path)]
    )
    assert out["config"]["owner_fanout"] == 2
    run = out["cases"][0]["atoll_runs"][0]
    assert run["ok"] and run["check"]["matches"] == ["all"]
    assert run["check"]["identical_on_every_peer"]
