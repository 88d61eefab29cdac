"""bench.gpu_check: its refusal without CUDA, its summary, and a short dry run of the script on
the CPU (the check itself needs a GPU: docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench.gpu_check import NO_CUDA_EXIT, summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_exits_at_once_with_a_clear_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == NO_CUDA_EXIT and out.stdout == ""
    assert "no CUDA device" in out.stderr and "--device cpu" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def _result(index: int, step_s: float, alone_s: float, digest: str) -> dict[str, object]:
    return {
        "index": index,
        "steps": 100,
        "median_step_s": step_s,
        "median_step_s_detached": alone_s,
        "stalled_steps": index,
        "device_peak_mb": 1024.0,
        "contributions_accepted": 3,
        "global_versions": [2, 2],
        "final_param_hash": digest,
        "n_params": 10,
    }


def test_the_summary_says_overlap_steps_per_second_and_hash_agreement() -> None:
    cfg = SimpleNamespace(
        device="cuda",
        model="medium",
        batch_size=32,
        inner_steps=40,
        fragments=4,
        codec="int8",
        overlap_block=20,
        peers=2,
    )
    out = summary(
        cfg, 120.0, [_result(1, 0.2, 0.1, "b" * 64), _result(0, 0.1, 0.09, "b" * 64)], 130
    )
    assert [p["index"] for p in out["per_peer"]] == [0, 1]
    assert out["per_peer"][0]["steps_per_s"] == 10.0 and out["per_peer"][1]["overlap"] == 0.5
    assert out["stalled_steps"] == 1 and out["overlap_min"] == 0.5 and out["hashes_agree"]
    split = summary(cfg, 120.0, [_result(0, 0.1, 0.1, "a" * 64), _result(1, 0.1, 0.1, "b" * 64)], 1)
    assert not split["hashes_agree"]


@pytest.mark.timeout(240)
def test_a_dry_run_on_the_cpu_ends_on_one_model() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            *("--device", "cpu", "--seconds", "4", "--model", "tiny", "--block", "5"),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["hashes_agree"] and len(result["per_peer"]) == 2
    assert all(p["steps"] > 0 and p["device_peak_mb"] == 0.0 for p in result["per_peer"])
