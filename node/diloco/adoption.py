"""How an island adopts the global fragments that arrived: blended, overwritten or rebased.

``IslandAdoption`` is mixed into ``Island`` (which provides the attributes below). Arrivals wait
in the inbox until the trainer thread takes them (``adopt_pending``: from the hook after each
inner step, and after any wait for merges). A version above the one held is adopted by blending,
overwriting or, with ``rebase``, replaying the island's unshipped work onto it; with
``ship_before_adopt`` that work ships first. A forced arrival (a resync) overwrites the fragment
and drops inner-optimizer state that is not finite; the owner's final version is adopted
whatever version is held (``adopt_final``). After an adoption the fragment is due H steps later,
or sooner if its kept work began more than H steps ago.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from protocol.diloco.norms import all_finite

if TYPE_CHECKING:
    from node.diloco.island import IslandConfig, IslandStats

__all__ = ["IslandAdoption"]


class IslandAdoption:
    """The adopting side of ``Island``."""

    cfg: IslandConfig
    optimizer: torch.optim.Optimizer
    params: list[list[nn.Parameter]]
    global_flat: list[torch.Tensor]
    versions: list[int]
    adoptions: list[int]
    c_steps: list[int]
    c_tokens: list[int]
    in_flight: list[int | None]
    _shipped: list[tuple[torch.Tensor, int, int] | None]
    next_due: list[int]
    stats: IslandStats
    _inbox: dict[int, tuple[int, torch.Tensor, bool]]
    _lock: threading.Lock
    _copy_s: float

    if TYPE_CHECKING:  # Island's

        def _h(self) -> int: ...

        def _ship(self, p: int) -> None: ...

    # --- taking what arrived -------------------------------------------------------------------
    def adopt_final(self, fragment: int, version: int, flat: torch.Tensor) -> None:
        """Adopt the owner's final version even if it is not above the one held.

        At the end of a run the current owner's latest version is authoritative: after an
        owner's crash the new owner may restart below a version some learner already held.
        """
        self._adopt(fragment, version, flat, rebase=False)

    def adopt_pending(self, *, block: bool = True, between_steps: bool = False) -> int:
        """Adopt whatever arrived; return how many fragments were adopted (trainer thread only).

        With ``block=False`` (the hook) a busy inbox is left for the next step instead of waited on.
        ``between_steps`` (the hook, with ``hold_until_shipped``): a fragment this island has
        trained since it last adopted one, and not shipped yet, keeps its arrived version
        waiting until it ships. Adopting it then would overwrite those steps' work, and restart
        the fragment's H count: an island slower than the swarm's version rate would never ship.
        """
        if not self._lock.acquire(blocking=block):
            self.stats.deferred_adoptions += 1
            return 0
        try:
            arrived, self._inbox = self._inbox, {}
            if between_steps and self.cfg.hold_until_shipped:
                held = {
                    p: a
                    for p, a in arrived.items()
                    if not a[2] and self.in_flight[p] is None and self.c_steps[p] > 0
                }
                for p in held:
                    del arrived[p]
                self._inbox.update(held)
        finally:
            self._lock.release()
        for fragment, (version, flat, force) in sorted(arrived.items()):
            if force:
                self._resync(fragment, version, flat)
            elif version > self.versions[fragment]:
                if between_steps and self._ships_first(fragment):
                    self._ship(fragment)
                    self.stats.shipped_before_adopting += 1
                self._adopt(fragment, version, flat)
        return len(arrived)

    # --- each arrival --------------------------------------------------------------------------
    def _ships_first(self, p: int) -> bool:
        """Whether fragment ``p``'s work since its last adoption ships before a newer version
        replaces it (``ship_before_adopt``): enough steps trained, and none of it in flight."""
        least = self.cfg.ship_before_adopt
        return least > 0 and self.in_flight[p] is None and self.c_steps[p] >= least

    def _resync(self, p: int, version: int, flat: torch.Tensor) -> None:
        """Overwrite fragment ``p`` with ``flat``; drop inner-optimizer state that is not finite."""
        for param in self.params[p]:
            state = self.optimizer.state.get(param)
            if state and not all(
                bool(torch.isfinite(v).all()) for v in state.values() if isinstance(v, torch.Tensor)
            ):
                del self.optimizer.state[param]
        self._adopt(p, version, flat, alpha=0.0, rebase=False)
        self.stats.resynced += 1

    def _adopt(
        self,
        p: int,
        version: int,
        flat: torch.Tensor,
        *,
        alpha: float | None = None,
        rebase: bool | None = None,
    ) -> None:
        t0 = time.thread_time()
        alpha = self.cfg.adopt_alpha if alpha is None else alpha
        shipped = self._shipped[p]
        reference = None
        if self.cfg.rebase if rebase is None else rebase:  # the work to keep is θ_p − reference
            if shipped is not None:
                reference = shipped[0]
            elif self.c_steps[p]:
                reference = self.global_flat[p]
        if reference is not None and not self._rebase(p, flat, reference):
            reference = None  # the local work is not finite: overwrite
        if reference is None:
            self._overwrite(p, flat, alpha)
        self.global_flat[p] = flat.float()
        self.versions[p] = version
        if reference is None:
            self.c_steps[p] = self.c_tokens[p] = 0
        elif (
            shipped is not None
        ):  # the steps since it shipped stay counted (unshipped work: all of it)
            self.c_steps[p], self.c_tokens[p] = (
                self.c_steps[p] - shipped[1],
                self.c_tokens[p] - shipped[2],
            )
        # H counts from this adoption, which keeps the island in phase with the merge that made
        # it, but kept work is due no later than 2H after it began: versions arriving more often
        # than every H steps cannot starve it
        h = self._h()
        self.next_due[p] = self.stats.step + min(h, 2 * h - self.c_steps[p])
        self.in_flight[p] = None
        self._shipped[p] = None
        self.stats.adopted += 1
        self.adoptions[p] += 1
        self._copy_s += time.thread_time() - t0

    def _overwrite(self, p: int, flat: torch.Tensor, alpha: float) -> None:
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

    def _rebase(self, p: int, flat: torch.Tensor, reference: torch.Tensor) -> bool:
        """θ_p ← Θ_p + (θ_p − θ_ref); False (nothing written) when θ_p − θ_ref is not finite."""
        with torch.no_grad():
            kept = []
            offset = 0
            for param in self.params[p]:
                n = param.numel()
                work = param.detach().reshape(-1).float().cpu() - reference[offset : offset + n]
                if not all_finite(work):
                    return False
                kept.append(work)
                offset += n
            offset = 0
            for param, work in zip(self.params[p], kept, strict=True):
                n = param.numel()
                rebased = work.add_(
                    flat[offset : offset + n]
                )  # Θ + 0 is Θ: with no work kept, an overwrite
                param.copy_(rebased.view_as(param))
                offset += n
        return True
