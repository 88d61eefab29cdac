"""Close calls confirmed on more windows (validation rule 3): a contribution blamed just past the
noise on the first windows is judged again on twice as many before it is dropped, and the check
replays from its log record as it was made."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from node.diloco.validation import Check, OwnerValidation, recheck
from protocol.diloco.validation import ValidationConfig

A, B, C = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3))


class _Scripted:
    """Per-window losses by which version is evaluated (``theta[0]`` names it): the current
    version, a flat candidate and two flat contributions sit on one baseline; contribution A rises
    0.0035 (1.7 noise margins: the 0.2 % floor) on the first windows a check draws and not on any
    other: a false positive of those windows."""

    pool = 4096
    digest = "scripted"

    def __init__(self) -> None:
        self.first: set[int] | None = None
        self.evaluated = 0

    def losses(self, fragment: int, theta: torch.Tensor, windows: Sequence[int]) -> list[float]:
        if self.first is None:
            self.first = set(windows)
        self.evaluated += len(windows)
        rise = 0.0035 if int(theta[0]) == 2 else 0.0
        return [1.0 + 0.01 * (w % 4) + (rise if w in self.first else 0.0) for w in windows]


def _check(rule: int) -> tuple[Check, _Scripted]:
    evaluator = _Scripted()
    validation = OwnerValidation(
        evaluator, ValidationConfig(windows=16, rule=rule), rng=random.Random(4)
    )
    versions = {p: torch.full((4,), float(i)) for i, p in ((2, A), (3, B), (4, C))}
    check = validation.check(0, 1, torch.zeros(4), torch.ones(4), lambda: versions)
    assert check is not None
    return check, evaluator


def test_a_close_call_is_confirmed_on_more_windows_before_anyone_is_blamed() -> None:
    old, old_eval = _check(rule=2)
    assert not old.verdict.publish and old.verdict.drop == {A}
    assert 1.0 < old.verdict.severity[A] < 2.0
    new, new_eval = _check(rule=3)
    verdict, record = new.verdict, new.record
    assert verdict.publish and verdict.drop == frozenset(), verdict.reason
    assert len(record["windows"]) == 32 and record["first"] == 16 and len(record["before"]) == 32
    assert record["windows"][:16] == sorted(new_eval.first or (), key=record["windows"].index)
    assert new_eval.evaluated == 2 * old_eval.evaluated  # the close call cost twice the windows
    assert recheck(record) == [] and recheck(old.record) == []
    assert recheck({**record, "first": 32})  # judged on all at once, A is not close: 16 drawn
    assert recheck({**record, "seed": record["seed"] + 1})  # other windows than those evaluated
