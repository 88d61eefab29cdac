"""CLI argument handling: config errors are clear and exit 2, never a traceback."""

from __future__ import annotations

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


def test_topk2_codec_and_its_block_size() -> None:
    assert RunConfig(codec="topk2", block_size=50).codec == "topk2"
    with pytest.raises(ValueError, match="--block-size must be 1..4096 with topk2"):
        RunConfig(codec="topk2", block_size=5000)
