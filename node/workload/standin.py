"""Stand-in compute (``--compute standin=STEP_S``): inner steps that cost a device's time, not a CPU's.

A swarm of 124M-parameter models cannot train on a 2-core box, yet what Atoll adds around the
training (fragments, contributions, owners, replicas, spreading, state sync, checkpoints) only
needs the parameters to move the way training moves them, at the pace a device would. Each stand-in
step therefore

* waits ``STEP_S`` seconds of wall time (``time.sleep`` on the training thread: the node's thread
  runs meanwhile, as it does while a GPU computes), less the time the update itself took;
* moves every parameter in place by ``Δ = r_t · (√ρ · d + √(1-ρ) · n_t)``: ``d`` a drift shared by
  every peer of the run (seeded by the run's seed, the same each step, as a gradient's direction
  persists), ``n_t`` this peer's noise of step ``t`` (seeded by the peer's seed and ``t``), ``ρ =
  SHARED`` the share of each step's variance the peers have in common, and ``r_t`` the step's RMS
  per element: ``rms`` (default ``DEFAULT_STEP_RMS``) times the inner lr schedule's shape
  (``lr_t / lr``), so warm-up and decay show. Over H steps a peer's pseudo-gradient is mostly the
  shared drift (H·√ρ against √H·√(1-ρ)), so merging averages related vectors, as it does in
  training, and error feedback, clipping and codecs see dense, Gaussian-tailed values.

Cheap at 124M parameters: ``d`` and ``n`` are not drawn per step (a fresh ``randn`` of 124M floats
costs about a second of CPU) but read from two fixed seeded buffers of ``BUFFER`` floats (8 MiB
each): parameter chunks of up to ``CHUNK`` elements read ``d`` at offsets fixed per chunk and ``n``
at offsets (and signs) drawn per step. One step is two in-place ``add_`` passes over the model, no
allocation (docs/scale.md has the measured cost).

There is no loss: nothing is evaluated in this mode, and the report says so.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from node.config import StandinSpec

__all__ = ["BUFFER", "CHUNK", "DEFAULT_STEP_RMS", "SHARED", "StandinOptimizer", "StandinSpec"]

DEFAULT_STEP_RMS = 1e-4  # AdamW at GPT-2's peak lr 6e-4 moves an element ~1-2e-4 per step
SHARED = 0.1  # the share of a step's variance every peer has in common (the drift)
BUFFER = 1 << 21  # floats per seeded buffer (8 MiB)
CHUNK = 1 << 19  # the most elements one add_ reads from a buffer; offsets fall in BUFFER - CHUNK


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One contiguous piece of one parameter and the drift it takes (fixed: a view of ``d``)."""

    view: torch.Tensor  # a flat view into the parameter's storage
    drift: torch.Tensor  # a view of the shared drift buffer, as long as ``view``


class StandinOptimizer(torch.optim.Optimizer):
    """An inner "optimizer" whose ``step`` is a stand-in step (module docstring): the island hooks
    its ``step`` like AdamW's, its ``lr`` follows the inner schedule, and it keeps no state.

    ``run_seed`` seeds the drift every peer shares; ``peer_seed`` this peer's noise. ``sleep``:
    how to wait (``time.sleep``; tests pass one that records)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        spec: StandinSpec,
        *,
        lr: float,
        run_seed: int,
        peer_seed: int,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        params = list(params)
        super().__init__(params, {"lr": lr})
        device = params[0].device if params else torch.device("cpu")
        self.spec, self.peak_lr, self.peer_seed, self._sleep = spec, lr, peer_seed, sleep
        self.next_step = 0  # the step the next ``step()`` is (the loop sets it; else counts up)
        self.update_s: list[float] = []  # CPU time of each step's update (the last 1,000)
        drift = _seeded_normal(run_seed, salt=0x5EED_D81F).to(device)
        self._noise = _seeded_normal(peer_seed, salt=0x5EED_0015).to(device)
        self._chunks = self._cut(drift, run_seed)

    def _cut(self, drift: torch.Tensor, run_seed: int) -> list[_Chunk]:
        """Every parameter's flat storage in chunks of at most ``CHUNK``, each with its fixed
        slice of the drift (offsets from ``run_seed``: the same on every peer)."""
        rng = random.Random(run_seed)
        chunks = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_contiguous():
                    raise ValueError(
                        "stand-in compute moves parameters in place: need contiguous ones"
                    )
                flat = p.detach().view(-1)  # shares p's storage
                for start in range(0, flat.numel(), CHUNK):
                    view = flat[start : start + CHUNK]
                    at = rng.randrange(BUFFER - view.numel() + 1)
                    chunks.append(_Chunk(view, drift[at : at + view.numel()]))
        return chunks

    @property
    def step_rms(self) -> float:
        """This step's RMS change per element: ``rms`` times the lr schedule's shape."""
        lr = float(self.param_groups[0]["lr"])
        return self.spec.step_rms * (lr / self.peak_lr if self.peak_lr > 0 else 1.0)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Move every parameter by one stand-in step, then wait out the rest of ``step_s``."""
        t0 = time.perf_counter()
        self.apply(self.next_step)
        took = time.perf_counter() - t0
        self.update_s = [*self.update_s[-999:], took]
        self.next_step += 1
        if self.spec.step_s > took:
            self._sleep(self.spec.step_s - took)

    def apply(self, step: int) -> None:
        """The in-place update of step ``step`` (no wait): deterministic given the seeds."""
        r = self.step_rms
        common, own = r * math.sqrt(SHARED), r * math.sqrt(1.0 - SHARED)
        rng = random.Random(self.peer_seed * 1_000_003 + step)  # this peer's noise of this step
        for c in self._chunks:
            n = c.view.numel()
            at = rng.randrange(BUFFER - n + 1)
            sign = 1.0 if rng.random() < 0.5 else -1.0
            c.view.add_(c.drift, alpha=common)
            c.view.add_(self._noise[at : at + n], alpha=sign * own)


def _seeded_normal(seed: int, *, salt: int) -> torch.Tensor:
    """``BUFFER`` standard normal floats from ``seed`` (fp32, drawn on the CPU: the same on
    every device)."""
    g = torch.Generator().manual_seed((seed * 2_654_435_761 + salt) % (1 << 63))
    return torch.randn(BUFFER, generator=g)
