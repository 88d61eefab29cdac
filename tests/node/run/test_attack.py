"""Attack injection: each kind rewrites a contribution the way a malicious member would."""

from __future__ import annotations

import pytest
import torch

from node.diloco.island import Outgoing
from node.run.attack import Attack, parse_local_attack


def _out(delta: torch.Tensor, fragment: int = 0) -> Outgoing:
    return Outgoing(fragment=fragment, base_version=3, tokens=64, steps=4, step_time=0.1, sender_step=9,
                    delta=delta)


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
