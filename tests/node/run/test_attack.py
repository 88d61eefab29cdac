"""Attack injection: each kind rewrites a contribution the way a malicious member would."""

from __future__ import annotations

import pytest
import torch

from node.diloco.island import Outgoing
from node.run.attack import Attack, parse_local_attack


def _out(delta: torch.Tensor, fragment: int = 0) -> Outgoing:
    return Outgoing(
        fragment=fragment,
        base_version=3,
        tokens=64,
        steps=4,
        step_time=0.1,
        sender_step=9,
        delta=delta,
    )


def test_each_kind() -> None:
    d = torch.tensor([3.0, -4.0])
    assert torch.equal(Attack.parse("scale=10")(_out(d)).delta, d * 10)
    assert torch.equal(Attack.parse("scale")(_out(d)).delta, d * 1000)
    assert torch.equal(Attack.parse("signflip")(_out(d)).delta, -d)
    rnd = Attack.parse("random=2")(_out(d)).delta
    assert float(torch.linalg.vector_norm(rnd)) == pytest.approx(10.0) and not torch.equal(rnd, d)
    stale = Attack.parse("stale")
    assert torch.equal(stale(_out(d)).delta, d)
    later = stale(_out(torch.tensor([1.0, 1.0])))
    assert torch.equal(later.delta, d) and later.base_version == 3  # the old delta on the new base
    lie = Attack.parse("lie-tokens=100")(_out(d))
    assert (lie.tokens, lie.steps) == (6400, 400) and torch.equal(lie.delta, d)


def test_bad_specs_say_what_to_write() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        Attack.parse("melt")
    with pytest.raises(ValueError, match="not a number"):
        Attack.parse("scale=big")
    with pytest.raises(ValueError, match="PEER:KIND"):
        parse_local_attack("scale=3")
    assert parse_local_attack("2:signflip") == (2, "signflip")


def test_alie_shifts_the_honest_mean_by_z_deviations_against_its_sign() -> None:
    alie = Attack.parse("alie=2")
    first = alie(_out(torch.tensor([1.0, -2.0]))).delta
    assert torch.equal(
        first, torch.tensor([1.0, -2.0]) - 2 * torch.tensor([1.0, 2.0]) * torch.tensor([1.0, -1.0])
    )
    second = alie(_out(torch.tensor([3.0, -2.0]))).delta  # mean (2, -2), std (1.414, 0)
    assert torch.allclose(second, torch.tensor([2.0 - 2 * 2**0.5, -2.0]))
    other = alie(_out(torch.tensor([9.0, 9.0]), fragment=1)).delta  # per fragment
    assert torch.equal(other, torch.tensor([-9.0, -9.0]))


def test_ipm_is_minus_epsilon_times_the_honest_estimate() -> None:
    ipm = Attack.parse("ipm=0.5")
    assert torch.equal(ipm(_out(torch.tensor([2.0, 4.0]))).delta, torch.tensor([-1.0, -2.0]))
    assert torch.equal(
        ipm(_out(torch.tensor([4.0, 0.0]))).delta, torch.tensor([-1.5, -1.0])
    )  # mean of both
    assert Attack.parse("ipm").arg == 2.0


def test_steps_claims_the_bound_and_scales_the_step_to_match() -> None:
    d = torch.tensor([3.0, -4.0])
    out = Attack.parse("steps")(_out(d))
    assert (out.steps, out.tokens) == (8, 128) and torch.equal(out.delta, 2 * d)
    assert Attack.parse("steps=3")(_out(d)).steps == 12


def test_colluders_draw_the_same_direction_and_a_lone_one_another() -> None:
    d = torch.randn(64)
    a, b = Attack.parse("random", seed=7), Attack.parse("random", seed=7)
    b(_out(d, fragment=1))  # colluders' histories differ; the draw for one base version does not
    assert torch.equal(a(_out(d)).delta, b(_out(d)).delta)
    assert not torch.equal(a(_out(d)).delta, Attack.parse("random", seed=8)(_out(d)).delta)
    alie_a, alie_b = Attack.parse("alie", seed=7), Attack.parse("alie", seed=7)
    assert torch.equal(
        alie_a(_out(d)).delta, alie_b(_out(d)).delta
    )  # same work, same rule, same step


def test_several_attackers_parse() -> None:
    assert [parse_local_attack(s) for s in ("3:alie", "5:alie=1.5", "6:ipm", "7:steps")] == [
        (3, "alie"),
        (5, "alie=1.5"),
        (6, "ipm"),
        (7, "steps"),
    ]
