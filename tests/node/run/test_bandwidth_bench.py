"""bench.bandwidth's accounting, on a hand-made report and owner event log (no swarm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.bandwidth import measure, parse_args, rates, sealed_size, table, uploads, version_sizes
from node.diloco.eventlog import payload_dir
from protocol.diloco.compression import compress
from protocol.wire.codec import encode
from protocol.wire.messages import Contribution


def contribution_bytes(n: int) -> bytes:
    enc, _ = compress(torch.randn(n, generator=torch.Generator().manual_seed(n)), "topk2")
    msg = Contribution(
        swarm="s",
        fragment=0,
        base_version=0,
        base_digest=bytes(32),
        tokens=1,
        steps=1,
        step_time=0.1,
        sender_step=0,
        tensors=(enc,),
    )
    return encode(msg).tobytes()


def fake_report(tmp_path: Path) -> dict[str, object]:
    log = tmp_path / "peer0-events" / "fragment0.jsonl"
    payloads = payload_dir(log)
    payloads.mkdir(parents=True)
    small, big = contribution_bytes(100), contribution_bytes(5000)
    (payloads / "a.msg").write_bytes(small)
    (payloads / "b.msg").write_bytes(big)
    content = {"shapes": [[10, 30], [30]], "codec": "none"}
    lines = [
        {"kind": "start", "fragment": 0, "content": content},
        {"kind": "tick", "now": 1.0},
        {"kind": "contribution", "peer": "aa", "payload": "a.msg"},
        {"kind": "contribution", "peer": "aa", "payload": "b.msg"},
        {"kind": "contribution", "peer": "bb", "payload": "a.msg"},
    ]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return {
        "event_logs": [str(log)],
        "tokens_trained": 2000,
        "bytes_sent": 100_000,
        "n_params": 1000,
        "steps": 10,
        "peers": 2,
        "config": {"swarm": "atoll-local"},
        "eval_loss": {"end": 2.5},
        "hashes_agree": True,
        "wall_s": 3.0,
        "per_peer": [
            {"peer_id": "aa", "bytes_sent": 60_000, "median_step_s": 0.1},
            {"peer_id": "bb", "bytes_sent": 40_000, "median_step_s": 0.3},
        ],
    }


def test_uploads_count_every_logged_contribution_sealed(tmp_path: Path) -> None:
    report = fake_report(tmp_path)
    a = sealed_size(contribution_bytes(100))
    b = sealed_size(contribution_bytes(5000))
    assert 0 < a - len(contribution_bytes(100)) < 300  # the envelope: key, signature, digest, ...
    assert uploads(report) == {"aa": (a + b, 2), "bb": (a, 1)}


def test_measure_and_table(tmp_path: Path) -> None:
    report = fake_report(tmp_path)
    up = sum(b for b, _ in uploads(report).values())
    row = measure(30, "topk2", report)
    row.update(rates(row, tau=2, t_step=0.2))
    ddp = 2 * (2 - 1) / 2 * 1000 * 4 * 2 * 10  # 2 workers, 10 steps, fp32
    assert row["up_bytes"] == up and row["down_bytes"] == 100_000 - up
    assert row["ddp_fp32_per_token"] == pytest.approx(ddp / 2000)
    assert row["vs_ddp_bf16"] == pytest.approx(ddp / 2 / 100_000)
    assert row["t_step_run_s"] == pytest.approx(0.2)  # median over peers
    # the mean contribution up, one version down, each within tau = 2 steps of 0.2 s
    assert row["rate_up_mbit"] == pytest.approx(up / 3 * 8 / 0.4 / 1e6)
    assert row["rate_down_mbit"] == pytest.approx(version_sizes(report)[0] * 8 / 0.4 / 1e6)
    assert row["rate_ddp_fp32_mbit"] == pytest.approx(1000 * 4 * 8 / 0.2 / 1e6)
    assert "| 30 | topk2 |" in table([row])


def test_a_contribution_without_its_payload_is_an_error(tmp_path: Path) -> None:
    report = fake_report(tmp_path)
    log = Path(report["event_logs"][0])  # type: ignore[index]
    log.write_text(
        log.read_text() + json.dumps({"kind": "contribution", "peer": "aa", "payload": None}) + "\n"
    )
    with pytest.raises(RuntimeError, match="payload"):
        uploads(report)


def test_version_size_is_the_sealed_fp32_fragment(tmp_path: Path) -> None:
    size = version_sizes(fake_report(tmp_path))[0]
    assert 4 * 330 < size < 4 * 330 + 600  # 330 fp32 values, headers, envelope


def test_grids() -> None:
    assert (parse_args([]).h, parse_args([]).steps) == ((10, 100), 300)
    assert (parse_args(["--full"]).h, parse_args(["--full"]).steps) == ((10, 30, 100, 300), 600)
    assert parse_args(["--full", "--h", "30", "--steps", "50"]).h == (30,)
    with pytest.raises(SystemExit):
        parse_args(["--reuse"])
