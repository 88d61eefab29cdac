"""Stand-in compute (node.workload.standin): seeded, in place, of the configured size, shared drift."""

from __future__ import annotations

import math

import pytest
import torch

from node.config import RunConfig, StandinSpec
from node.diloco.allocator import heap_in_use
from node.workload.model import GPT, GPTConfig
from node.workload.standin import CHUNK, SHARED, StandinOptimizer


def params(n: int = 3 * CHUNK + 1234) -> list[torch.Tensor]:
    """A chunked matrix, a vector and a scalar-sized tensor, all zero (the update is then Δ)."""
    return [torch.zeros(n), torch.zeros(17, 31), torch.zeros(1)]


def stepper(ps: list[torch.Tensor], *, peer_seed: int = 1, rms: float = 1e-3) -> StandinOptimizer:
    naps: list[float] = []
    opt = StandinOptimizer(
        ps, StandinSpec(0.25, rms), lr=1e-3, run_seed=7, peer_seed=peer_seed, sleep=naps.append
    )
    opt.naps = naps  # type: ignore[attr-defined]
    return opt


def flat(ps: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in ps])


def test_the_same_seeds_give_the_same_steps_and_other_seeds_other_noise() -> None:
    a, b, c = params(), params(), params()
    for opt in (stepper(a), stepper(b), stepper(c, peer_seed=2)):
        for _ in range(3):
            opt.step()
    assert torch.equal(flat(a), flat(b))
    assert not torch.equal(flat(a), flat(c))


def test_each_step_moves_every_element_by_the_configured_rms_and_waits_the_rest() -> None:
    ps = params()
    opt = stepper(ps, rms=1e-3)
    opt.step()
    rms = flat(ps).pow(2).mean().sqrt().item()
    assert rms == pytest.approx(1e-3, rel=0.02)
    assert bool((flat(ps) != 0).all())  # every element moved, not a sample of them
    (nap,) = opt.naps  # type: ignore[attr-defined]
    assert 0 < nap <= 0.25 and nap == pytest.approx(0.25 - opt.update_s[-1])


def test_the_lr_schedule_scales_the_step() -> None:
    ps = params()
    opt = stepper(ps, rms=1e-3)
    opt.param_groups[0]["lr"] = 0.5e-3  # half the peak: warm-up or decay
    assert opt.step_rms == pytest.approx(0.5e-3)
    opt.step()
    assert flat(ps).pow(2).mean().sqrt().item() == pytest.approx(0.5e-3, rel=0.02)


def test_peers_share_the_drift_so_their_pseudo_gradients_agree() -> None:
    """Over H steps two peers' updates have cosine H·ρ / (H·ρ + 1 - ρ) (ρ = SHARED): mostly
    the shared drift, as islands training one model move mostly the same way."""
    h = 20
    a, b = params(), params()
    for opt in (stepper(a, peer_seed=1), stepper(b, peer_seed=2)):
        for _ in range(h):
            opt.step()
    cos = torch.nn.functional.cosine_similarity(flat(a), flat(b), dim=0).item()
    expected = h * SHARED / (h * SHARED + 1 - SHARED)
    assert cos == pytest.approx(expected, abs=0.03)
    # and the norm over H steps: √(H²ρ + H(1-ρ)) times one step's
    one = 1e-3 * math.sqrt(flat(a).numel())
    assert flat(a).norm().item() == pytest.approx(
        one * math.sqrt(h * h * SHARED + h * (1 - SHARED)), rel=0.05
    )


def test_parameters_change_in_place_with_no_allocation_per_step() -> None:
    model = GPT(GPTConfig.preset("small"), seed=0)
    opt = StandinOptimizer(model.parameters(), StandinSpec(0.0), lr=1e-3, run_seed=0, peer_seed=1)
    pointers = [p.data_ptr() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # the first step may warm caches
    heap = heap_in_use()
    for _ in range(5):
        opt.step()
    after = heap_in_use()
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not opt.state  # no optimizer state to hold, save or reset
    if heap is not None and after is not None:  # glibc: tensors alive, in bytes
        assert after - heap < 64 * 1024  # not one model-sized (765 kB) buffer more


@pytest.mark.parametrize(
    "text",
    [
        "standin",
        "standin=",
        "standin=x",
        "gpu=1",
        "standin=-1",
        "standin=0.5,rms=2",
        "standin=0.5,x=1",
    ],
)
def test_a_compute_that_is_neither_real_nor_a_standin_spec_is_refused_in_one_line(
    text: str,
) -> None:
    with pytest.raises(ValueError, match=r"--compute must be real or standin=STEP_S") as exc:
        RunConfig(compute=text)
    assert "\n" not in str(exc.value)


def test_a_standin_spec_parses_with_its_default_rms() -> None:
    assert RunConfig().standin is None
    assert RunConfig(compute="standin=0.5").standin == StandinSpec(0.5, 1e-4)
    assert RunConfig(compute="standin=0,rms=3e-4").standin == StandinSpec(0.0, 3e-4)
