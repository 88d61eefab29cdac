"""``atoll simulate``: durations, a user's swarm, and the paper table's JSON and plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from node.cli import main
from node.run.simulate import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1.2s", 1.2),
        ("20m", 1200.0),
        ("6h", 21600.0),
        ("2d", 172800.0),
        ("500ms", 0.5),
        ("30", 30.0),
        ("1y", 365 * 86400.0),
        ("1e3s", 1000.0),
        ("5min", 300.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "6 hours", "-1s", "1.2.3s", "6w"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="bad duration"):
        parse_duration(text)


def _last_json(out: str) -> dict:  # type: ignore[type-arg]
    return json.loads(out.strip().splitlines()[-1])


def test_simulate_a_swarm(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "simulate",
            "--peers",
            "12",
            "--mtbf",
            "3h",
            "--repair",
            "20m",
            "--step-time",
            "1.2s",
            "--sync-time",
            "5s",
            "--horizon",
            "1d",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "Decoupled DiLoCo" in out and "synchronous DiLoCo" in out and "data-parallel" in out
    result = _last_json(out)
    g = {k: v["goodput"] for k, v in result["methods"].items()}
    assert set(g) == {"decoupled", "sync-diloco", "elastic", "data-parallel"}
    assert g["data-parallel"] < g["elastic"] < g["sync-diloco"] < g["decoupled"] < 1.0
    # a peer is down 20 m in every 3 h 20 m: decoupled cannot beat the peers' availability
    assert g["decoupled"] < 180 / 200 + 0.01
    assert result["horizon_s"] == 86400.0 and 0 < result["methods"]["decoupled"]["uptime"] <= 1


def test_simulate_needs_a_swarm_or_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--peers", "4"]) == 2
    assert "--mtbf" in capsys.readouterr().err
    assert main(["simulate", "--peers", "0", "--mtbf", "1h"]) == 2  # refused by the config's checks
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_paper_table_prints_cells_json_last_and_writes_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "grid.png"
    assert (
        main(["simulate", "--paper-table", "--json", "--png", str(png), "--failures", "300"]) == 0
    )
    out = capsys.readouterr().out
    result = _last_json(out)
    cells = result["cells"]
    assert len(cells) == 30
    assert all(set(c) == {"chips", "M", "method", "paper", "sim"} for c in cells)
    assert {c["method"] for c in cells} == {"data-parallel", "elastic", "decoupled"}
    assert sorted({c["M"] for c in cells}) == [1, 2, 4, 8, 16]
    assert {c["chips"] for c in cells} == {150_000, 300_000, 600_000, 1_200_000, 2_400_000}
    assert result["max_abs_deviation"] == pytest.approx(
        max(abs(c["sim"] - c["paper"]) for c in cells), abs=0.01
    )
    assert "constants: slice 256 chips" in out and "decoupled M=16" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
