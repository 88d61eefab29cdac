"""``RunConfig``'s typed values: ``Literal`` fields, checked with errors that name the flag."""

from __future__ import annotations

import argparse
import dataclasses
from typing import get_args

import pytest

from node.config import (
    Aggregate,
    Codec,
    Growth,
    RunConfig,
    UpdateCodec,
    add_run_arguments,
    config_from_args,
)
from protocol.diloco.aggregates import AGGREGATES
from protocol.diloco.interval import GROWTHS
from protocol.wire.tensors import CODECS, UPDATE_CODECS


def test_the_literal_types_list_what_protocol_implements() -> None:
    assert get_args(Codec) == CODECS
    assert get_args(UpdateCodec) == ("none", *UPDATE_CODECS)
    assert get_args(Growth) == GROWTHS
    assert get_args(Aggregate) == AGGREGATES


@pytest.mark.parametrize(
    "field, bad, message",
    [
        ("mode", "async", "--mode must be decoupled, sync or ddp, got 'async'"),
        ("codec", "zip", "--codec must be none, bf16, int8, int4, topk2 or sign1, got 'zip'"),
        ("download_codec", "int8", "--download-codec must be none or bf16, got 'int8'"),
        ("update_codec", "fp8", "--update-codec must be none, bf16, int8, int4, topk2 or sign1"),
        ("sync_growth", "cubic", "--sync-growth must be constant, inverse-lr, qsr or sqrt-lr"),
        ("sharding", "random", "--sharding must be one of contiguous, striped; got 'random'"),
        ("aggregate", "median", "--aggregate must be one of rda, normed, mean; got 'median'"),
        ("late_policy", "keep", "--late-policy must be carry or drop, got 'keep'"),
        ("final_flush", 2, "--final-flush must be -1 (auto), 0 or 1, got 2"),
        ("hold_versions", -1, "--hold-versions must be 0 or 1, got -1"),
        ("adopt_rebase", 2, "--adopt-rebase must be 0 or 1, got 2"),
    ],
)
def test_a_value_a_field_does_not_list_is_refused_with_the_ones_it_does(
    field: str, bad: object, message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        RunConfig(**{field: bad})  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_json_takes_the_same_values_as_before_and_names_the_type_of_a_wrong_one() -> None:
    cfg = RunConfig.from_json(
        '{"mode": "sync", "final_flush": -1, "hold_versions": 1, "adopt_rebase": 0, '
        '"codec": "int8", "corpus": null}'
    )
    assert (cfg.mode, cfg.final_flush, cfg.hold_versions, cfg.adopt_rebase) == ("sync", -1, 1, 0)
    assert RunConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(
        ValueError, match=r"final_flush = '1' should be int; mode = 3 should be str"
    ):
        RunConfig.from_json('{"final_flush": "1", "mode": 3}')
    with pytest.raises(ValueError, match=r"hold_versions = True should be int"):
        RunConfig.from_json('{"hold_versions": true}')
    with pytest.raises(ValueError, match=r"corpus = 1 should be str \| None"):
        RunConfig.from_json('{"corpus": 1}')


def test_the_flags_parse_a_literal_fields_values_as_its_type() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--final-flush", "-1", "--adopt-rebase", "0", "--mode", "ddp"])
    cfg = config_from_args(args)
    assert (cfg.final_flush, cfg.adopt_rebase, cfg.mode) == (-1, 0, "ddp")
    assert cfg == dataclasses.replace(RunConfig(), final_flush=-1, adopt_rebase=0, mode="ddp")
    with pytest.raises(ValueError, match="--final-flush must be -1 \\(auto\\), 0 or 1, got 3"):
        config_from_args(parser.parse_args(["--final-flush", "3"]))
