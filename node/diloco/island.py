"""The island: a learner that trains its own replica and never waits on the network.

``Island`` hooks the inner optimizer's ``step()`` (``register_step_post_hook``, as torchft's
DiLoCo does), so a user's training loop barely changes::

    island = Island(model, inner_optimizer, plan, link, IslandConfig(...))
    for batch in loader:
        loss = model(batch)...; loss.backward()
        island.tokens(batch.numel())    # tokens of this step, counted before the step ships
        inner_optimizer.step()          # the hook adopts arrived fragments, ships due ones
        inner_optimizer.zero_grad()

After every inner step the hook (1) adopts global fragments that arrived since the last step,
(2) for each fragment due at this step snapshots the pseudo-gradient Δ_p = Θ_p^base − θ_p and
hands it to the network side without waiting.

When is a fragment due? First at its offset in the staggered schedule of
``protocol.diloco.fragments`` (so fragments go out evenly), then H inner steps after each
adoption of a new version of it. Counting from adoption keeps the swarm in phase by itself:
every learner receives version v+1 at about the same moment, so their next contributions
reach the owner together, inside the grace window, whatever their start-up skew was. A
refused or undelivered contribution makes the fragment due again H steps later. Compression,
signing and sending happen on the network thread. The only synchronisation is the ``Inbox``
(``node.diloco.inbox``): a lock held for a dict swap, which the hook never waits for (a busy inbox
is adopted a step later). The time each hook spends with the network side
(taking the inbox, enqueueing due fragments — not the local tensor copies) is measured; a step
where it exceeds max(50 ms, half a step) is reported as stalled.

An island slower than the swarm's version rate would otherwise rarely ship: a new version of a
fragment arrives before it trains H steps, and adopting it overwrites those steps and restarts
the count. With ``ship_before_adopt = N`` a fragment trained N or more steps since its last
adoption, with nothing in flight, ships that work first (against the base it was trained from,
so one version stale at the owner, and discounted there), then adopts. N bounds how often it
ships (at most every N steps per fragment): N = 1 let early shipments make versions that
triggered more early shipments, everyone's (docs/results.md, "Stragglers that ship").

Arrivals are adopted as θ_p ← α·θ_p + (1 − α)·Θ_p (α = 0: overwrite), or, with ``rebase``
(the default), as θ_p ← Θ_p + (θ_p − θ_ref): the island's work that no contribution holds yet
is replayed onto the new version, like a git rebase. θ_ref is the fragment as it shipped when a
contribution is in flight, else the base it was trained from; the steps and tokens of that kept
work stay counted, so the next contribution carries it. Either way the fragment is due H steps
after the adoption, but no later than 2H steps after its kept work began (at once if they have
passed): versions arriving more often than every H steps cannot keep it from shipping. AdamW
moments are kept. A forced delivery (a resync after the island's own fragment went non-finite)
overwrites θ_p whatever α and the version held, and resets the inner optimizer's state of any
parameter of the fragment whose state is not finite. Versions act as fencing tokens: only a
version above the one held is adopted. ``Island`` decides what to adopt and when, and keeps the
books; writing a version into the parameters (blended, overwritten, rebased) is
``node.diloco.adoption``.

On a GPU the island also holds its global fragments on the device, so Δ and adoption run there;
arrived versions are copied to the device as they are delivered, and Δ goes to the network side
with an event its stream waits for (``node.diloco.device``, docs/gpu.md). On the CPU nothing
crosses and this is the code as it was.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from node.diloco.adoption import Adoption
from node.diloco.device import DeviceLink, Landed
from node.diloco.flat import new_flat
from node.diloco.inbox import Arrival, Inbox
from node.diloco.run_delay import thread_run_delays, waited_for_cpu
from node.diloco.sharding import ShardedFragments
from node.diloco.ship_window import Handoff, ShipWindow
from protocol.diloco.fragments import FragmentPlan, due_offset

log = logging.getLogger(__name__)

__all__ = ["Island", "IslandConfig", "IslandStats", "Outgoing"]

# A step counts as stalled when its exchange with the network side (taking the inbox: this
# thread's CPU time, so that the OS preempting it on a busy machine does not count; handing off
# due fragments and any wait for merges in synchronous mode: wall time) took longer than this,
# or than half a step. Wall time would count run-queue latency: with more runnable threads than
# cores the OS takes 50-100 ms from a thread now and then, wherever it happens to be.
STALL_MIN_S = 0.050


@dataclass(frozen=True, slots=True, kw_only=True)
class IslandConfig:
    inner_steps: int = 30  # H
    # H for a fragment that syncs at a given inner step (None: always ``inner_steps``); see
    # protocol.diloco.interval for schedules that grow H as the inner learning rate decays
    interval: Callable[[int], int] | None = None
    adopt_alpha: float = 0.0
    in_flight_timeout_steps: int = 0  # 0: 2·H; a contribution unanswered this long is given up
    # synchronous DiLoCo (a comparison mode): after shipping a fragment, wait for its merged
    # version (or a refusal) before the next inner step, at most this long
    wait_for_merge: bool = False
    wait_timeout_s: float = 120.0
    # adopt a trained fragment's new version only once it has shipped. Off by default: at the
    # default staleness bound S = 2 a held island's contributions come too stale and are refused
    # (4 peers, one 2x slower, 600 steps: eval 3.006 with it, 1.596 without). Without it, an island
    # slower than the swarm's version rate rarely ships: its H count restarts at every adoption
    hold_until_shipped: bool = False
    # ship a fragment's work before adopting a newer version of it (0: off): when a version
    # arrives for a fragment trained at least this many steps since its last adoption and not in
    # flight, its pseudo-gradient against the base held goes out first (one version stale at the
    # owner, discounted), so an island slower than the swarm's version rate still contributes
    ship_before_adopt: int = 0
    # adopt by rebasing: θ_p ← Θ_p + (θ_p − θ_ref), keeping the work no contribution holds yet.
    # θ_ref is θ_p as it shipped (the work since then is in no contribution) or, with nothing in
    # flight, the base the island trained from (none of its work since is). Overwriting throws
    # that work away: every version arriving while a fragment is in flight, or from a merge the
    # island was not in, undid inner steps
    rebase: bool = True
    # contributions open on the network side at once when several fragments ship together (the
    # end-of-run flush, a synchronous step, resends): ``node.diloco.ship_window``. 0: not bounded,
    # for a ``submit`` that does not report its handoffs (``ContributionSender`` does)
    ship_window: int = 0

    def __post_init__(self) -> None:
        if self.rebase and self.adopt_alpha:
            raise ValueError(
                f"adopt_alpha={self.adopt_alpha} blends the island's parameters into each version and "
                "rebase keeps its unshipped work on top of it: set rebase=False to blend"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """One due fragment's pseudo-gradient, handed from the trainer to the network side."""

    fragment: int
    base_version: int
    tokens: int
    steps: int
    step_time: float
    sender_step: int
    delta: torch.Tensor  # [numel_p] float32, a private copy, on the island's device
    last: bool = False  # the island's end-of-run flush: its last contribution for the fragment
    ready: Any = None  # on CUDA: the event after which ``delta`` holds its values (else None)
    # its claim on the island's ``ShipWindow`` (None: not bounded): the network side says when
    # Δ is compressed and when the contribution is answered
    handoff: Handoff | None = None


@dataclass
class IslandStats:
    step: int = 0
    tokens_trained: int = 0
    stalled_steps: int = 0
    sent: int = 0
    gave_up_in_flight: int = 0
    deferred_adoptions: int = 0
    shipped_before_adopting: int = 0  # contributions sent early, as a newer version arrived
    flushed: int = 0  # contributions sent at the end of training (``flush``)
    adopted: int = 0
    resynced: int = 0
    declined: int = 0  # contributions in flight dropped because their owner declined the candidate
    step_times: list[float] = field(default_factory=list)
    step_times_detached: list[float] = field(default_factory=list)  # while ``enabled`` was False
    compute_times: list[float] = field(
        default_factory=list
    )  # step times less any wait for a merge (sync)


class Island:
    """Wraps a model and its inner optimizer; talks to the swarm through ``submit``/``deliver``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: FragmentPlan,
        submit: Callable[[Outgoing], None],
        cfg: IslandConfig,
        *,
        device_link: DeviceLink | None = None,
        shards: ShardedFragments | None = None,
    ) -> None:
        """``device_link``: how tensors cross between the parameters' device and the host (default:
        ``DeviceLink`` of the first parameter's device; on the CPU nothing crosses). ``shards``:
        rank 0 of an FSDP island, whose parameters are shards: each fragment is gathered only
        while it ships or is adopted (``node.diloco.sharding``)."""
        self.model, self.plan, self.cfg, self.optimizer = model, plan, cfg, optimizer
        self._submit = submit
        self._shards = shards
        named = dict(model.named_parameters())
        missing = [n for f in plan.fragments for n in f.names if n not in named]
        if missing:
            raise ValueError(f"fragment plan names parameters the model lacks: {missing[:5]}")
        self.params: list[list[nn.Parameter]] = [
            [named[n] for n in f.names] for f in plan.fragments
        ]
        first = next((t for ts in self.params for t in ts), None)
        self.device_link = device_link or DeviceLink(
            first.device if first is not None else torch.device("cpu")
        )
        # global fragments live on the CPU, where the network side decodes and hashes them; on a
        # device the island also holds a copy there (``_base``), which Δ and rebases read
        self.global_flat: list[torch.Tensor] = []
        for p in range(len(self.params)):
            with self._full(p, write=False):
                self.global_flat.append(self._flatten(p).float().cpu())
        self._device_global: list[torch.Tensor] | None = None
        self._mirrored: list[torch.Tensor | None] = [None] * len(self.params)
        if self.device_link.staged:  # the same values, copied over rather than gathered again
            self._device_global = [
                g.to(self.device_link.device, copy=True) for g in self.global_flat
            ]
            self._mirrored = list(self.global_flat)
        self.versions: list[int] = [0] * len(self.params)
        # per fragment, how often its parameters were replaced by a global version (a final or a
        # resync may replace them at the version held): what the other ranks of an island follow
        self.adoptions: list[int] = [0] * len(self.params)
        self._adopted_at: list[int] = [0] * len(self.params)  # the step of each one's last adoption
        self.c_steps = [0] * len(self.params)
        self.c_tokens = [0] * len(self.params)
        self.in_flight: list[int | None] = [None] * len(self.params)  # step it was sent at
        # rebase: per fragment in flight, θ_p as it shipped and the steps and tokens it covered
        # (None for the flush's last contributions: θ_p itself, no step follows them)
        self._shipped: list[tuple[torch.Tensor | None, int, int] | None] = [None] * len(self.params)
        # per fragment, the round (by the version it merges on) that our last accepted
        # contribution joined, and the step it was accepted at: written by the network side
        self._joined: list[tuple[int, int] | None] = [None] * len(self.params)
        n, h = len(self.params), cfg.inner_steps
        self.next_due = [due_offset(p, n, h) + 1 for p in range(n)]
        self.stats = IslandStats()
        self._inbox = Inbox()  # versions arrived from the network side, not yet adopted
        self.window = ShipWindow(cfg.ship_window) if cfg.ship_window else None
        # True during ``flush``: the network side then sends silent accepted work again after
        # ``ContributionSender.resend_after_s`` (a declined round publishes no version)
        self.flushing = False
        self._adoption = Adoption(self.params, optimizer)
        self._step_ema = 0.0
        self._copy_s = self._submit_s = 0.0  # per-hook timing, for the stall count
        self._last_step_at: float | None = None
        self._last_blocked = 0.0  # the previous hook's wait for merges (sync mode)
        self.enabled = True  # False: train as if alone (no adoption, no shipping), for measurement
        self._hook = optimizer.register_step_post_hook(self._after_step)

    # --- called by the user's loop (trainer thread) --------------------------------------------
    def tokens(self, n: int) -> None:
        """Count ``n`` tokens for the step about to be taken (call before ``optimizer.step()``)."""
        self.stats.tokens_trained += n
        for p in range(len(self.c_tokens)):
            self.c_tokens[p] += n

    def close(self) -> None:
        self._hook.remove()

    # --- called by the network side (any thread) -----------------------------------------------
    def deliver(
        self, fragment: int, version: int, flat: torch.Tensor, *, force: bool = False
    ) -> None:
        """A verified global fragment arrived; it is adopted after the next inner step.

        ``force``: adopt it whole even if it is not above the version held (a resync)."""
        self.deliver_many({fragment: (version, flat)}, force=force)

    def deliver_many(
        self, arrived: dict[int, tuple[int, torch.Tensor]], *, force: bool = False
    ) -> None:
        """Several fragments at once: all are adopted after the same inner step."""
        landed = {
            p: (v, self.device_link.to_device(flat, ("in", p))) for p, (v, flat) in arrived.items()
        }
        self._inbox.put_many(landed, force=force)

    def resolved(self, fragment: int, accepted: bool, joined: int = -1) -> None:
        """The owner answered a contribution; a refusal frees the fragment to be sent again.
        ``joined``: the round an accepted one joined, by the version it merges on (the Ack's
        version): the fragment is not sent again before that round's version is held."""
        if accepted and joined >= 0:
            self._joined[fragment] = (joined, self.stats.step)
        if not accepted:
            self.in_flight[fragment] = None
            self._shipped[fragment] = None
            self.next_due[fragment] = self.stats.step + self._h()
            self._inbox.announce()

    def declined(self, fragment: int, base: int) -> None:
        """The owner declined (validation) the candidate holding this fragment's work in flight
        on version ``base``: after the next inner step the island drops that work and goes on
        from the version it holds (``_drop_declined``); a synchronous step stops waiting."""
        self._inbox.decline(fragment, base)

    def resend(self, fragment: int) -> None:
        """The owner that accepted this fragment's contribution left before merging it: send the
        cumulative pseudo-gradient again at the next step (it still covers that work)."""
        self._joined[fragment] = None  # the next owner holds no copy of it
        self.in_flight[fragment] = None
        self._shipped[fragment] = None
        self.next_due[fragment] = self.stats.step
        self._inbox.announce()

    @property
    def news(self) -> int:
        """How many deliveries, refusals and resends this island has had so far (for ``wait_for_news``)."""
        return self._inbox.news

    def wait_for_news(self, seen: int, timeout_s: float) -> bool:
        """Block (at most ``timeout_s``) until the island has had a delivery, a refusal or a resend
        since ``news`` read ``seen``; return whether it has. For a loop that drives the optimizer
        only when there is something to ship or adopt, instead of polling (``bench.averaging``)."""
        return self._inbox.wait_for_news(seen, timeout_s)

    def flush(self, timeout_s: float) -> int:
        """End of training: send every fragment's work that no contribution holds yet.

        Ships each fragment with nothing in flight at once; then waits (at most ``timeout_s``)
        for the versions of the fragments that were in flight, so that what ships next is
        measured from them, adopts what arrived, and ships those trained since. Returns how many
        fragments shipped. Without it a run's last up-to-H steps of each fragment never reach
        the global model, which costs most when H grows late in a run. Waiting for every
        fragment before shipping any made a circular wait across fragments: an owner's last
        round waits for each learner's last contribution, and a learner's flush of that
        fragment waited for another fragment's version, held by the same kind of round.

        The fragments ship one after another through the island's ``ShipWindow`` (if it has
        one): each waits (until the deadline) for the previous one's Δ to be compressed, so no
        more than a window's worth of buffers are alive at once. While it waits, the network
        side sends silent accepted work again (``flushing``): a round its owner declined never
        publishes the version waited for, and the resent fragment ships now instead.

        It is the end of training: with ``rebase`` the fragments it ships keep no copy of θ_p
        as shipped (a fragment's fp32 bytes each, all of the model when every fragment ships),
        for no step follows, and a version arriving for one of them is adopted whole.
        Training on after a flush would lose those steps at that adoption."""
        deadline = time.monotonic() + timeout_s
        self.flushing = True
        try:
            self.adopt_pending()
            # work in flight first gets its version. Not a fragment whose accepted work waits in
            # the round its last steps would join (``_awaits_round``): that round's owner waits
            # for every learner's last contribution, ours included, a circular wait until the
            # deadline (30 s at the end of every test swarm); they go now, and are refused as a
            # duplicate, those steps lost
            flying = {p for p, sent in enumerate(self.in_flight) if sent is not None}
            shipped = self._ship_last(deadline)
            self._inbox.wait_while(lambda: self._waiting(flying), deadline, poll_s=0.5)
            self.adopt_pending()
            shipped += self._ship_last(deadline)
        finally:
            self.flushing = False
        self.stats.flushed += shipped
        return shipped

    def _ship_last(self, deadline: float) -> int:
        """Ship, marked last, every fragment trained since its version and not in flight, one
        after another within the ship window (past ``deadline``, without waiting for room)."""
        due = [
            p for p in range(len(self.params)) if self.in_flight[p] is None and self.c_steps[p] > 0
        ]
        for p in due:
            self._wait_for_room(deadline)
            self._ship(p, last=True)
        return len(due)

    def _wait_for_room(self, deadline: float) -> float:
        """Block until the ship window has room for one more contribution (or ``deadline``);
        return the seconds waited."""
        if self.window is None:
            return 0.0
        t0 = time.perf_counter()
        self.window.wait_for_room(deadline)
        return time.perf_counter() - t0

    def _h(self) -> int:
        """H for a fragment syncing at the current step."""
        interval = self.cfg.interval
        return self.cfg.inner_steps if interval is None else max(1, interval(self.stats.step))

    # --- the hook ------------------------------------------------------------------------------
    def _after_step(self, _opt: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            (self.stats.step_times if self.enabled else self.stats.step_times_detached).append(dt)
            self.stats.compute_times.append(dt - self._last_blocked)
            self._step_ema = dt if self._step_ema == 0 else 0.9 * self._step_ema + 0.1 * dt
        self._last_step_at = now  # the hook's own work counts in the next step's time
        self.stats.step += 1
        for p in range(len(self.c_steps)):
            self.c_steps[p] += 1
        if not self.enabled:
            return
        t0 = time.thread_time()
        self.adopt_pending(block=False, between_steps=True)
        adopting = time.thread_time()
        due = [p for p, at in enumerate(self.next_due) if self.stats.step >= at]
        if due and self.cfg.wait_for_merge:
            # synchronous: the whole model goes at once. Shipping one fragment and waiting would
            # deadlock learners whose fragments fall due at different steps (after a restart)
            due = list(range(len(self.next_due)))
        blocked = 0.0
        if self.cfg.wait_for_merge:  # synchronous mode: these waits are what it costs
            deadline = time.monotonic() + self.cfg.wait_timeout_s
            for p in due:  # one after another within the ship window
                blocked += self._wait_for_room(deadline)
                self._ship(p)
            t_wait = time.perf_counter()
            self._wait_for_merges(deadline)
            blocked += time.perf_counter() - t_wait
        else:
            self._ship_due(due)
        self._last_blocked = blocked
        # time with the network side, excluding the local tensor copies of adoption and snapshots
        waited = (adopting - t0 - self._copy_s) + self._submit_s + blocked
        if waited > max(STALL_MIN_S, 0.5 * self._step_ema):
            self.stats.stalled_steps += 1
            log.info(
                "step %d stalled %.0f ms on the network side: taking the inbox %.0f ms of CPU "
                "(copies left out), handing off %.0f ms, waiting for merges %.0f ms",
                self.stats.step,
                1e3 * waited,
                1e3 * (adopting - t0 - self._copy_s),
                1e3 * self._submit_s,
                1e3 * blocked,
            )
        self._copy_s = self._submit_s = 0.0

    def _waiting(self, among: Collection[int] | None = None) -> bool:
        """Some fragment (of ``among``, if given) is in flight and neither its next version nor
        a refusal has come (called by ``Inbox.wait_while``, which holds its lock)."""
        return any(
            sent is not None
            and not self._inbox.newer(p, self.versions[p])
            and not self._inbox.declined(p, self.versions[p])
            for p, sent in enumerate(self.in_flight)
            if among is None or p in among
        )

    def _ship_due(self, due: list[int]) -> None:
        """Decoupled: ship the fragments due at this step without waiting. The first always
        ships (fragments fall due one at a time while training); more at once (resends after an
        owner left) ship only while the ship window has room, the rest at a later step."""
        shipped = False
        for p in due:
            if self._awaits_round(p):
                continue  # stays due: it ships at a step after that round's version is adopted
            if shipped and self.window is not None and not self.window.has_room():
                return
            shipped = self._ship(p) or shipped

    def _awaits_round(self, p: int) -> bool:
        """Whether fragment ``p``'s last accepted work still waits in the round that work on
        the version held would join: its owner would refuse that as a duplicate (an accepted
        contribution carried into the next round while the owner merged, or one accepted stale
        into a round whose base we do not hold yet). Given up, as work in flight is, when that
        round has not closed within the in-flight timeout of its opening here (the adoption of
        its base version) or of the acceptance, whichever came later: a round an owner's
        validation declined and merged again opens late."""
        held = self._joined[p]
        if held is None:
            return False
        round_, accepted_at = held
        if self.versions[p] > round_:
            return False
        opened = self._adopted_at[p] if self.versions[p] == round_ else accepted_at
        return self.stats.step - max(accepted_at, opened) < self._in_flight_timeout()

    def _in_flight_timeout(self) -> int:
        """Steps after which work sent, or waiting for its round, is given up: 2H unless set."""
        return self.cfg.in_flight_timeout_steps or 2 * self.cfg.inner_steps

    def _wait_for_merges(self, deadline: float) -> None:
        """Synchronous mode: block until every fragment in flight has its merged version."""
        self._inbox.wait_while(self._waiting, deadline, poll_s=1.0)
        self.adopt_pending()

    def _ship(self, p: int, *, last: bool = False) -> bool:
        """Snapshot fragment ``p``'s work and submit it; False if it is in flight (not given up)."""
        sent_at = self.in_flight[p]
        if sent_at is not None and self.stats.step - sent_at < self._in_flight_timeout():
            return False
        if sent_at is not None:
            self.stats.gave_up_in_flight += 1
        handoff = self.window.open(p) if self.window is not None else None
        with self._full(p, write=False):
            if self.cfg.rebase and not last:
                # θ_p as it ships, copied exactly (Θ − Δ would round), and Δ from it
                shipped = self._flatten(p).float().to(self._base(p).device)
                self._shipped[p] = (shipped, self.c_steps[p], self.c_tokens[p])
                delta = torch.sub(self._base(p), shipped)
            else:
                delta = self._pseudo_gradient(p)  # the same bits as Θ − (θ_p copied)
                if self.cfg.rebase:  # the flush: training is over, so θ_p stays as it shipped
                    self._shipped[p] = (None, self.c_steps[p], self.c_tokens[p])
        self.in_flight[p] = self.stats.step
        self.next_due[p] = self.stats.step + self._h()
        self.stats.sent += 1
        out = Outgoing(
            fragment=p,
            base_version=self.versions[p],
            tokens=self.c_tokens[p],
            steps=max(self.c_steps[p], 1),
            step_time=self._step_ema,
            sender_step=self.stats.step,
            delta=delta,
            last=last,
            ready=self.device_link.record(),  # on CUDA, the network side's stream waits for Δ
            handoff=handoff,
        )
        # wall time, for a hand-off that blocks is a stall, less the time the scheduler kept this
        # thread, or the one holding the GIL, waiting for a CPU (a busy box, not the network side)
        t0, queued = time.perf_counter(), thread_run_delays()
        self._submit(out)
        wall = time.perf_counter() - t0
        explained = waited_for_cpu(queued, thread_run_delays(), threading.get_native_id())
        self._submit_s += max(0.0, wall - explained)
        return True

    def _pseudo_gradient(self, p: int) -> torch.Tensor:
        """Θ_base − θ of fragment ``p`` as a new flat fp32 tensor on the island's device (the
        network side keeps it), subtracted parameter by parameter into it: one buffer
        (``new_flat``: on the CPU the block the last one left, not fresh pages), not a
        concatenated copy of θ and then the difference."""
        base = self._base(p)
        on_host = self._device_global is None  # θ is copied to the host (a no-op on the CPU)
        out = new_flat(base.numel()) if on_host else torch.empty_like(base)
        offset = 0
        with torch.no_grad():
            for param in self.params[p]:
                n = param.numel()
                theta = param.detach().reshape(-1).float()
                torch.sub(
                    base[offset : offset + n],
                    theta.cpu() if on_host else theta,
                    out=out[offset : offset + n],
                )
                offset += n
        return out

    def _base(self, p: int) -> torch.Tensor:
        """The global fragment ``p`` this island holds, on its device (on the CPU: ``global_flat``).
        A host copy replaced from outside (a resumed checkpoint) is copied over again here."""
        if self._device_global is None:
            return self.global_flat[p]
        host = self.global_flat[p]
        if self._mirrored[p] is not host:
            self._device_global[p] = self.device_link.arrive(self.device_link.to_device(host, None))
            self._mirrored[p] = host
        return self._device_global[p]

    def _flatten(self, p: int) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in self.params[p]])

    def _full(self, p: int, *, write: bool) -> contextlib.AbstractContextManager[None]:
        """Fragment ``p``'s full parameters in ``self.params[p]`` for the block (a sharded
        island gathers them, and with ``write`` scatters them back; otherwise they are)."""
        if self._shards is None:
            return contextlib.nullcontext()
        return self._shards.full(p, self.params[p], write=write)

    # --- adopting what arrived (trainer thread) ------------------------------------------------
    def adopt_final(self, fragment: int, version: int, flat: torch.Tensor) -> None:
        """Adopt the owner's final version even if it is not above the one held.

        At the end of a run the current owner's latest version is authoritative: after an
        owner's crash the new owner may restart below a version some learner already held.
        """
        self._adopt(fragment, version, self.device_link.to_device(flat, None), rebase=False)

    def adopt_pending(self, *, block: bool = True, between_steps: bool = False) -> int:
        """Adopt whatever arrived; return how many fragments were adopted (trainer thread only).

        With ``block=False`` (the hook) a busy inbox is left for the next step instead of waited on.
        ``between_steps`` (the hook, with ``hold_until_shipped``): a fragment this island has
        trained since it last adopted one, and not shipped yet, keeps its arrived version
        waiting until it ships. Adopting it then would overwrite those steps' work, and restart
        the fragment's H count: an island slower than the swarm's version rate would never ship.
        """
        hold = between_steps and self.cfg.hold_until_shipped
        for fragment, base in sorted(self._inbox.take_declined().items()):
            if self.in_flight[fragment] is not None and self.versions[fragment] == base:
                self._drop_declined(fragment)
        arrived = self._inbox.take(block=block, keep=self._unshipped if hold else None)
        if arrived is None:
            self.stats.deferred_adoptions += 1
            return 0
        for fragment, (version, flat, force) in sorted(arrived.items()):
            if force:
                self._resync(fragment, version, flat)
            elif version > self.versions[fragment]:
                if between_steps and self._ships_first(fragment):
                    self._ship(fragment)
                    self.stats.shipped_before_adopting += 1
                self._adopt(fragment, version, flat)
        return len(arrived)

    def _unshipped(self, p: int, arrival: Arrival) -> bool:
        """Whether an arrival for ``p`` waits until ``p`` ships (``hold_until_shipped``): not
        forced, and ``p`` has trained since its last adoption with nothing in flight."""
        trained = self.in_flight[p] is None and self.c_steps[p] > 0
        return not arrival[2] and trained and not self._awaits_round(p)  # that may be its round's

    def _ships_first(self, p: int) -> bool:
        """Whether fragment ``p``'s work since its last adoption ships before a newer version
        replaces it (``ship_before_adopt``): enough steps trained, and none of it in flight."""
        least = self.cfg.ship_before_adopt
        return least > 0 and self.in_flight[p] is None and self.c_steps[p] >= least

    def _drop_declined(self, p: int) -> None:
        """Drop fragment ``p``'s work in flight, which its owner declined: adopt the version held
        again, as if the round had published it (with ``rebase``, θ_p ← Θ_p + (θ_p − θ_shipped)
        keeps only the work trained since it shipped). The refused work is never sent again."""
        device = None if self._device_global is None else self._device_global[p]
        self._joined[p] = None  # the owner dropped that work with its round's candidate
        self._adopt(p, self.versions[p], Landed(self.global_flat[p], device))
        self.stats.declined += 1

    def _resync(self, p: int, version: int, flat: Landed) -> None:
        """Overwrite fragment ``p`` with ``flat``; drop inner-optimizer state that is not finite."""
        if self._shards is not None:  # every rank checks its own shard of the state
            self._shards.drop_nonfinite_state(p)
        else:
            self._adoption.drop_nonfinite_state(p)
        self._adopt(p, version, flat, alpha=0.0, rebase=False)
        self.stats.resynced += 1

    def _adopt(
        self,
        p: int,
        version: int,
        landed: Landed,
        *,
        alpha: float | None = None,
        rebase: bool | None = None,
    ) -> None:
        t0 = time.thread_time()
        flat = self.device_link.arrive(landed)  # on the island's device; no host wait on CUDA
        alpha = self.cfg.adopt_alpha if alpha is None else alpha
        shipped = self._shipped[p]
        reference = None
        if self.cfg.rebase if rebase is None else rebase:  # the work to keep is θ_p − reference
            if shipped is not None:
                reference = shipped[0]  # None after a last one: no work since, overwrite
            elif self.c_steps[p]:
                reference = self._base(p)
        with self._full(p, write=True):
            if reference is not None and not self._adoption.rebase(p, flat, reference):
                reference = None  # the local work is not finite: overwrite
            if reference is None:
                self._adoption.overwrite(p, flat, alpha)
        self.global_flat[p] = landed.host.float()
        if self._device_global is not None:
            self._device_global[p], self._mirrored[p] = flat.float(), self.global_flat[p]
        self.versions[p] = version
        if reference is None:
            self.c_steps[p] = self.c_tokens[p] = 0
        elif shipped is not None:  # the steps since it shipped stay counted (unshipped: all)
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
        self._adopted_at[p] = self.stats.step
        self._copy_s += time.thread_time() - t0

    # --- the global model this island holds ----------------------------------------------------
    def global_state(self) -> dict[str, torch.Tensor]:
        """The global fragments this island last adopted, as a name → tensor dict."""
        state: dict[str, torch.Tensor] = {}
        for p, params in enumerate(self.params):
            offset = 0
            for name, param in zip(self.plan.fragments[p].names, params, strict=True):
                n = param.numel()
                state[name] = self.global_flat[p][offset : offset + n].view(param.shape)
                offset += n
        return state
