"""How a version of a global fragment is written into the island's parameters.

``Adoption`` writes; ``Island`` decides what to adopt and when, and keeps the books (versions,
step and token counts, what is due). Three ways to write a version Θ_p over the parameters θ_p:
blend θ_p ← α·θ_p + (1 − α)·Θ_p (α = 0: overwrite), or rebase θ_p ← Θ_p + (θ_p − θ_ref), which
replays the island's work that no contribution holds yet onto the new version. A resync also
drops the inner optimizer's state of any parameter whose state is not finite.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from protocol.diloco.norms import all_finite

__all__ = ["Adoption"]


class Adoption:
    """Writes global fragments into one island's parameters (trainer thread only)."""

    def __init__(self, params: list[list[nn.Parameter]], optimizer: torch.optim.Optimizer) -> None:
        """``params``: each fragment's parameters, in the fragment plan's order."""
        self.params, self.optimizer = params, optimizer

    def overwrite(self, p: int, flat: torch.Tensor, alpha: float) -> None:
        """θ_p ← α·θ_p + (1 − α)·Θ_p (α = 0: a copy)."""
        with torch.no_grad():
            offset = 0
            for param in self.params[p]:
                n = param.numel()
                incoming = flat[offset : offset + n].view_as(param).to(param.device, param.dtype)
                if alpha:
                    param.mul_(alpha).add_(incoming, alpha=1.0 - alpha)
                else:
                    param.copy_(incoming)
                offset += n

    def rebase(self, p: int, flat: torch.Tensor, reference: torch.Tensor) -> bool:
        """θ_p ← Θ_p + (θ_p − θ_ref); False (nothing written) when θ_p − θ_ref is not finite.
        ``flat`` and ``reference`` lie where the parameters do (on a device: one host wait, for
        the finite check of the whole fragment)."""
        if reference.device.type == "cpu" and all(_flat_fp32(t) for t in self.params[p]):
            return self._rebase_in_slices(p, flat, reference)
        with torch.no_grad():
            kept = []
            offset = 0
            on_cpu = reference.device.type == "cpu"
            for param in self.params[p]:
                n = param.numel()
                theta = param.detach().reshape(-1).float()
                work = (theta.cpu() if on_cpu else theta) - reference[offset : offset + n]
                if on_cpu and not all_finite(work):
                    return False
                kept.append(work)
                offset += n
            if not on_cpu and not _all_finite(kept):
                return False
            offset = 0
            for param, work in zip(self.params[p], kept, strict=True):
                n = param.numel()
                # Θ + 0 is Θ: with no work kept, an overwrite
                rebased = work.add_(flat[offset : offset + n])
                param.copy_(rebased.view_as(param))
                offset += n
        return True

    def _rebase_in_slices(self, p: int, flat: torch.Tensor, reference: torch.Tensor) -> bool:
        """``rebase`` on the CPU, in slices of at most ``SLICE`` values: θ − θ_ref is computed
        twice (the same bits), once to check it is finite and once to write it, and never held
        for the whole fragment (at 124M parameters that was 157 MB at each adoption)."""
        with torch.no_grad():
            for write in (False, True):
                offset = 0
                for param in self.params[p]:
                    theta = param.detach().view(-1)
                    for a in range(0, theta.numel(), SLICE):
                        b = min(a + SLICE, theta.numel())
                        work = theta[a:b] - reference[offset + a : offset + b]
                        if write:
                            theta[a:b].copy_(work.add_(flat[offset + a : offset + b]))
                        elif not all_finite(work):
                            return False
                    offset += theta.numel()
        return True

    def drop_nonfinite_state(self, p: int) -> None:
        """Forget the inner optimizer's state of each parameter of fragment ``p`` whose state
        has a NaN or Inf (a resync: the fresh version must not be stepped with it)."""
        for param in self.params[p]:
            state = self.optimizer.state.get(param)
            if state and not all(
                bool(torch.isfinite(v).all()) for v in state.values() if isinstance(v, torch.Tensor)
            ):
                del self.optimizer.state[param]


SLICE = 1 << 22  # values of θ − θ_ref held at once by a rebase on the CPU (16 MB)


def _flat_fp32(param: torch.Tensor) -> bool:
    """Whether ``param`` is a contiguous fp32 CPU tensor (its values a flat view away)."""
    return param.dtype == torch.float32 and param.is_contiguous() and param.device.type == "cpu"


def _all_finite(parts: list[torch.Tensor]) -> bool:
    """Whether every value of ``parts`` (on a device) is finite, with one host wait: the sum of
    their sums is finite only if every value is; when it is not, each part is checked."""
    if not parts:
        return True
    total = torch.stack([t.sum() for t in parts]).sum()
    return math.isfinite(float(total)) or all(all_finite(t) for t in parts)
