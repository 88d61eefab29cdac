"""The status page's progress history: bounded, evenly thinned, newest record always shown."""

from __future__ import annotations

import math

import pytest

from node.status.history import History, Point


def _point(i: int) -> Point:
    return Point(t=float(i), step=i, loss=1.0 / (i + 1), sent=10 * i, received=20 * i)


def test_a_short_run_keeps_every_point() -> None:
    h = History(max_points=8)
    for i in range(5):
        h.record(_point(i))
    assert [p.step for p in h.points()] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("records", [8, 9, 17, 100, 1000, 12345])
def test_a_long_run_stays_bounded_evenly_spaced_and_ends_at_the_newest(records: int) -> None:
    h = History(max_points=8)
    for i in range(records):
        h.record(_point(i))
    steps = [p.step for p in h.points()]
    assert len(steps) <= 8 + 1 and steps[0] == 0 and steps[-1] == records - 1
    kept = (
        steps[:-1] if steps[-1] - steps[-2] < steps[1] - steps[0] else steps
    )  # the newest, unkept
    gaps = {b - a for a, b in zip(kept, kept[1:], strict=False)}
    assert len(gaps) == 1, steps  # every kept point one stride from the next


def test_a_missing_loss_is_null_in_json() -> None:
    row = Point(t=1.23456, step=3, loss=math.nan, sent=1, received=2).row()
    assert row == [1.235, 3, None, 1, 2]


def test_too_small_a_history_is_our_own_misuse() -> None:
    with pytest.raises(ValueError, match="max_points"):
        History(max_points=1)
