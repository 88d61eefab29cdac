"""The inner learning-rate schedule: where a joiner enters it, and its second warm-up."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from node.diloco.inner import joining_step, lr_at
from node.workload.baseline import TrainConfig

CFG = TrainConfig(steps=1000, lr=1e-2, warmup_steps=50, min_lr_ratio=0.1)


def test_a_joiner_enters_at_the_median_of_the_learners_steps_within_the_run() -> None:
    assert joining_step([], 1000) == 0  # nobody training yet: the start
    assert joining_step([400], 1000) == 400
    assert joining_step([300, 500, 410], 1000) == 410
    assert joining_step([300, 500], 1000) == 300  # the lower of the two middle ones
    assert (
        joining_step([5000, 4000, 4500], 1000) == 1000
    )  # the swarm is past this run's end: nothing left


@given(
    honest=st.lists(st.integers(0, 1000), min_size=3, max_size=30),
    liars=st.lists(st.integers(0, 2**63 - 1), max_size=30),
)
def test_a_minority_of_claims_cannot_move_the_joiner_outside_what_the_others_claim(
    honest: list[int], liars: list[int]
) -> None:
    liars = liars[: (len(honest) - 1) // 2]  # fewer than half of all claims
    start = joining_step(honest + liars, 1000)
    assert min(honest) <= start <= max(honest)


def test_a_joiner_warms_its_fresh_optimizer_up_again_to_the_schedules_rate() -> None:
    start = 600
    ramp = [lr_at(start + i, CFG, rewarm_from=start) for i in range(CFG.warmup_steps + 5)]
    assert ramp[0] == lr_at(start, CFG) / CFG.warmup_steps
    assert all(
        a < b for a, b in zip(ramp[: CFG.warmup_steps - 1], ramp[1 : CFG.warmup_steps], strict=True)
    )
    assert ramp[CFG.warmup_steps - 1] == lr_at(
        start + CFG.warmup_steps - 1, CFG
    )  # the ramp ends on the schedule
    assert ramp[CFG.warmup_steps :] == [
        lr_at(start + i, CFG) for i in range(CFG.warmup_steps, CFG.warmup_steps + 5)
    ]
    assert max(ramp) < CFG.lr * 0.7  # never the peak rate: the swarm is late in its cosine
    assert [lr_at(s, CFG, rewarm_from=0) for s in range(0, 1000, 37)] == [
        lr_at(s, CFG) for s in range(0, 1000, 37)
    ]
