"""An owner's merger log replays to the same decisions, reasons and merged entries, and to the
same version contents (recomputed from the kept payloads); a log or payload edited after the
fact shows where it differs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from node.diloco.eventlog import payload_dir, replay
from tests.node.fakes import (
    FakeClock,
    contribution,
    flat_of,
    make_owner,
    shapes_of,
    tiny_model,
    tiny_plan,
)

A, B, C = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3))


async def _run(tmp_path: Path) -> Path:
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    log = tmp_path / "owner-0.jsonl"
    owner = make_owner(plan, shapes, 0, theta0, clock, quorum=2, late_policy="carry", event_log=log)
    await owner.set_expected(3)
    delta = torch.linspace(-0.02, 0.02, theta0.numel())
    for round_ in range(4):
        for i, peer in enumerate((A, B, C)):
            clock.advance(0.1 + 0.05 * i)
            base = (
                owner.version if peer != C else max(0, owner.version - 1)
            )  # C lags a version behind
            await owner.contribute(
                peer,
                contribution(
                    delta * (round_ + 1),
                    shapes[0],
                    base_version=base,
                    owner=owner,
                    steps=4,
                    tokens=64,
                ),
            )
        clock.advance(5.0)
        await owner.tick()
    await owner.contribute(
        A, contribution(delta, shapes[0], base_version=0, owner=owner)
    )  # refused: merged
    assert owner.version >= 3
    owner.log.close()
    return log


async def test_a_log_replays_to_every_decision_and_version(tmp_path: Path) -> None:
    log = await _run(tmp_path)
    result = replay(log)
    assert result.mismatches == []
    assert result.decisions >= 12
    versions = [v["version"] for v in result.versions]
    assert versions == sorted(versions) and versions[0] == 0 and len(versions) >= 4
    assert all(v["merged"] for v in result.versions[1:])  # each version names what it merged


async def test_a_replay_recomputes_every_version_digest_from_the_kept_contents(
    tmp_path: Path,
) -> None:
    log = await _run(tmp_path)
    result = replay(log)
    assert result.unchecked is None
    assert result.contents_checked == len(result.versions) >= 4
    assert all(v["replayed"] == v["digest"] for v in result.versions)


async def test_a_changed_payload_changes_the_replayed_version(tmp_path: Path) -> None:
    log = await _run(tmp_path)
    states = sorted(payload_dir(log).glob("*.safetensors"))
    assert len(states) == 1  # the state the owner started from
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(states[0]))
    tensors["theta"][0] += 1e-3  # a different starting state: every version's bits differ
    save_file(tensors, str(states[0]))
    result = replay(log)
    assert [m["event"] for m in result.mismatches] == ["version"] * len(result.versions)


async def test_missing_payloads_are_said_not_guessed(tmp_path: Path) -> None:
    log = await _run(tmp_path)
    next(payload_dir(log).glob("*.msg")).unlink()
    result = replay(log)
    assert result.mismatches == []  # the decisions still replay
    assert result.unchecked is not None and "missing" in result.unchecked
    assert result.contents_checked < len(result.versions)


async def test_an_edited_log_shows_the_decision_that_differs(tmp_path: Path) -> None:
    log = await _run(tmp_path)
    lines = log.read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if '"kind":"contribution"' in line)
    rec = json.loads(lines[n])
    rec["tokens"] = 1  # a learner that claimed fewer tokens would have weighed less
    lines[n] = json.dumps(rec)
    log.write_text("\n".join(lines) + "\n")
    assert replay(log).mismatches


def test_a_file_that_is_not_a_log_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not a JSON line"):
        replay(bad)


async def test_a_straggler_after_the_others_finished_merges_its_share_and_replays(
    tmp_path: Path,
) -> None:
    """Three learners, every one waited for; two finish. The straggler's lone contributions
    merge a third of a step each (the owner told of the two finished), and the log, which
    records them, replays to the same decisions and version contents."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    log = tmp_path / "owner-0.jsonl"
    owner = make_owner(plan, shapes, 0, theta0, clock, quorum_fraction=1.0, event_log=log)
    await owner.set_expected(3)
    delta = torch.full((theta0.numel(),), 0.03)
    for peer in (A, B, C):
        clock.advance(0.1)
        await owner.contribute(peer, contribution(delta, shapes[0], owner=owner))
    await owner.settled()
    assert owner.version == 1
    await owner.set_expected(1, finished=2)
    before = owner.theta.clone()
    for v in (1, 2):
        clock.advance(0.5)
        await owner.contribute(A, contribution(delta, shapes[0], base_version=v, owner=owner))
        await owner.settled()
    assert owner.version == 3
    torch.testing.assert_close(before - owner.theta, 2 * delta / 3)  # two thirds of a step, not two
    owner.log.close()
    result = replay(log)
    assert result.mismatches == [] and result.unchecked is None
    assert all(v["replayed"] == v["digest"] for v in result.versions)
    assert sum('"finished":2' in line for line in log.read_text().splitlines()) == 1


async def test_a_held_first_merge_and_a_dropped_round_replay(tmp_path: Path) -> None:
    """A new owner's hold (``hold_first_merge``), a round dropped when its predecessor's handoff
    says the version is final, and a learner's last contribution are merger events too: the log
    replays through them."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    log = tmp_path / "owner-0.jsonl"
    owner = make_owner(plan, shapes, 0, theta0, clock, event_log=log)
    owner.hold_first_merge(6.0)
    delta = torch.full((theta0.numel(),), 0.03)
    await owner.set_expected(1)
    await owner.contribute(A, contribution(delta, shapes[0], owner=owner))
    assert owner.version == 0 and owner.merger.count == 1  # held
    owner.merger.drop_round("test: the version went final", now=clock.now)
    clock.advance(7.0)
    await owner.tick()
    last = dataclasses.replace(contribution(delta, shapes[0], owner=owner), last=True)  # a flush
    await owner.contribute(B, last)  # the hold has ended
    await owner.settled()
    assert owner.version == 1
    owner.log.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"hold", "drop"} <= {r["kind"] for r in records} and any(r.get("last") for r in records)
    result = replay(log)
    assert result.mismatches == [] and all(v["replayed"] == v["digest"] for v in result.versions)


async def test_the_learners_an_owner_waits_for_are_logged_when_they_change_and_replay(
    tmp_path: Path,
) -> None:
    """A round holding last contributions waits for each learner the node names: the names are
    merger input, logged when they change, and the replay, given them, makes the same decisions
    (without them it would merge on the count when B's flush comes)."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    log = tmp_path / "owner-0.jsonl"
    owner = make_owner(plan, shapes, 0, theta0, clock, quorum_fraction=0.5, event_log=log)
    delta = torch.full((theta0.numel(),), 0.03)
    last = dataclasses.replace(contribution(delta, shapes[0], owner=owner), last=True)
    await owner.set_expected(3, 0, frozenset({A, B, C}))
    await owner.set_expected(3, 0, frozenset({A, B, C}))
    await owner.contribute(A, last)
    clock.advance(0.5)
    await owner.set_expected(2, 1, frozenset({B, C}))  # A's record says it stopped
    clock.advance(0.5)
    await owner.contribute(B, last)
    await owner.settled()
    assert owner.version == 0 and owner.merger.count == 2  # C is still training
    clock.advance(2.5)
    await owner.contribute(C, last)
    await owner.settled()
    assert owner.version == 1
    owner.log.close()
    expects = [
        json.loads(line) for line in log.read_text().splitlines() if '"kind":"expect"' in line
    ]
    assert [len(r["learners"]) if "learners" in r else None for r in expects] == [3, None, 2]
    result = replay(log)
    assert result.mismatches == [] and all(v["replayed"] == v["digest"] for v in result.versions)
    edited = tmp_path / "edited.jsonl"
    edited.write_text(log.read_text().replace('"learners":', '"named":'))
    assert replay(edited).mismatches  # the count alone closes the round on B's flush


async def test_a_reference_handed_to_a_new_owner_is_logged_and_replays(tmp_path: Path) -> None:
    """A successor seeded with its predecessor's clip reference clips a lone oversized
    contribution in its first round; the log holds the seeded reference, so replay makes the
    same decisions (issue 47: the reference survives owner changes, and stays replayable)."""
    model = tiny_model()
    plan, clock = tiny_plan(model), FakeClock()
    shapes, theta0 = shapes_of(model, plan), flat_of(model, plan, 0)
    log = tmp_path / "owner-0.jsonl"
    owner = make_owner(plan, shapes, 0, theta0, clock, event_log=log)
    delta = torch.linspace(-0.02, 0.02, theta0.numel())
    owner.start_reference((float(delta.norm()),) * 3)
    await owner.contribute(A, contribution(50 * delta, shapes[0], owner=owner))
    await owner.set_expected(1)
    clock.advance(30.0)
    await owner.tick()
    assert owner.version == 1 and owner.penalties[A]["clipped"] == 1
    owner.log.close()
    assert any(json.loads(line)["kind"] == "reference" for line in log.read_text().splitlines())
    result = replay(log)
    assert result.mismatches == [] and result.decisions >= 3
