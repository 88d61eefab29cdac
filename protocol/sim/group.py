"""An elastic group of chips on the virtual clock: a Decoupled DiLoCo learner, or an elastic
data-parallel job.

Theory of operation. The group's chips are split into slices (the failure domains, see
``protocol.sim.failures``). Each slice is LIVE (in the group's configuration), DOWN (in repair)
or READY (repaired, waiting to rejoin). While it is not reconfiguring the group computes with
its live chips; compute is integrated between events as chip-seconds.

- A live slice fails: it goes DOWN for a repair time; the group drops it in a reconfiguration of
  ``reconfig_s`` (no chip computes). A failure during a reconfiguration joins it (the new
  configuration is built from whatever is healthy when it completes), as do slices repaired
  during it and every READY slice when it starts.
- A repaired slice outside a reconfiguration is READY: it joins the next reconfiguration, or
  forces one (``reconfig_s`` again) ``rejoin_wait_s`` after the first READY slice was repaired.
  So at high failure rates rejoins ride along with drops for free; at low rates each failure
  costs two reconfigurations.
- A READY slice can fail too (back to DOWN, nothing else happens).
- The last live slice fails: the group's state is lost (``on_lost`` is called). It restarts
  (``restart_s``) from the READY slices at once, or from the first slice repaired.

``block``/``unblock`` stop and resume computing (a synchronous learner waiting for a merge).
Nothing is computed after ``until`` (the end of the horizon).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from protocol.sim.config import FailureModel, Hardware
from protocol.sim.events import EventQueue
from protocol.sim.failures import DomainFailures, FailureSource, PerChipFailures

__all__ = ["ElasticGroup"]


class ElasticGroup:
    """One elastic group of ``chips`` chips; see the module docstring."""

    def __init__(
        self,
        queue: EventQueue,
        hw: Hardware,
        chips: float,
        rng: random.Random,
        *,
        until: float,
        failures: FailureModel = "domain",
        source: FailureSource | None = None,
    ) -> None:
        n_slices = max(1, round(chips / hw.chips_per_slice))
        self.chips, self.slice_chips = chips, chips / n_slices
        self._q, self._hw, self._rng, self.until = queue, hw, rng, until
        self._source: FailureSource
        if source is not None:  # a scripted source (tests)
            self._source = source
        elif failures == "chip":
            self._source = PerChipFailures(n_slices, round(self.slice_chips), hw.mtbi_s, rng)
        else:
            self._source = DomainFailures(n_slices, self.slice_chips, hw.mtbi_s, rng)
        self.live, self.down = n_slices, 0
        self.ready: set[int] = set()
        self.stall_until = 0.0
        self.blocked = False
        self.failures = self.reconfigurations = self.losses = 0
        self.chip_s = self.compute_s = 0.0  # integrated up to self._t
        self._t = 0.0
        self._fail_token = self._rejoin_token = 0
        self.on_lost: Callable[[float], None] | None = None
        self.on_restart: Callable[[float], None] | None = None
        self._arm(0.0)

    # -- queries -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The group holds its state (at least one live slice)."""
        return self.live > 0

    def computing(self, now: float) -> bool:
        return self.live > 0 and not self.blocked and now >= self.stall_until

    def advance(self, now: float) -> None:
        """Integrate compute up to ``now`` (capped at ``until``)."""
        end = min(now, self.until)
        if end > self._t:
            if self.live > 0 and not self.blocked:
                dt = end - max(self._t, self.stall_until)
                if dt > 0:
                    self.compute_s += dt
                    self.chip_s += dt * self.live * self.slice_chips
            self._t = end

    # -- control -----------------------------------------------------------------------------

    def block(self, now: float) -> None:
        self.advance(now)
        self.blocked = True

    def unblock(self, now: float) -> None:
        self.advance(now)
        self.blocked = False

    # -- events ------------------------------------------------------------------------------

    def _arm(self, now: float) -> None:
        self._fail_token += 1
        when, slice_id = self._source.next_failure(now)
        if when <= self.until:
            self._q.at(when, self._on_fail, self._fail_token, slice_id)

    def _on_fail(self, token: int, slice_id: int) -> None:
        if token != self._fail_token:
            return
        now = self._q.now
        self.advance(now)
        self.failures += 1
        self._source.remove(slice_id)
        self.down += 1
        self._q.at(now + self._hw.repair.sample(self._rng), self._on_repair, slice_id)
        if slice_id in self.ready:
            self.ready.discard(slice_id)
        else:
            self.live -= 1
            if self.live == 0:
                self._lose(now)
            elif now >= self.stall_until:
                self._reconfigure(now, self._hw.reconfig_s)
        self._arm(now)

    def _on_repair(self, slice_id: int) -> None:
        now = self._q.now
        self.advance(now)
        self._source.add(slice_id, now)
        self.down -= 1
        if self.live == 0:
            self.ready.add(slice_id)
            self._restart(now)
        elif now < self.stall_until:
            self.live += 1
        else:
            self.ready.add(slice_id)
            if len(self.ready) == 1:
                self._rejoin_token += 1
                self._q.at(now + self._hw.rejoin_wait_s, self._on_rejoin, self._rejoin_token)
        self._arm(now)

    def _on_rejoin(self, token: int) -> None:
        if token != self._rejoin_token or not self.ready or self.live == 0:
            return
        now = self._q.now
        self.advance(now)
        self._reconfigure(now, self._hw.reconfig_s)

    # -- helpers -----------------------------------------------------------------------------

    def _reconfigure(self, now: float, duration: float) -> None:
        self.reconfigurations += 1
        self.stall_until = now + duration
        self.live += len(self.ready)
        self.ready.clear()
        self._rejoin_token += 1

    def _lose(self, now: float) -> None:
        self.losses += 1
        if self.on_lost is not None:
            self.on_lost(now)
        if self.ready:
            self._restart(now)

    def _restart(self, now: float) -> None:
        self._reconfigure(now, self._hw.restart_s)
        if self.on_restart is not None:
            self.on_restart(now)

    def __repr__(self) -> str:
        return (
            f"ElasticGroup(chips={self.chips:g}, live={self.live}, down={self.down}, "
            f"ready={len(self.ready)}, failures={self.failures}, stall_until={self.stall_until:g})"
        )
