"""The evaluator behind validated publication (``protocol.diloco.validation`` decides; this measures).

An owner checks a candidate version of its fragment with the rest of the model as its own island
holds it: a private copy of the island's model, made once, into which the island's current
weights of the other fragments and the candidate are copied before each evaluation. The island's
*trained* weights, not the global versions it last adopted: learners' work co-adapts with the
other fragments as they train, and the global versions lag by up to H steps; swapping one fresh
fragment into the lagging others flagged honest work (3 peers, tiny, 1,500 steps: 7 of 44 checks
rejected against the global copies, 2 of 41 against the trained ones; docs/security.md). A read
races the island's optimizer: each value is its old or its new one, both real weights. Evaluations run on the owner's worker thread (never on the event
loop), one at a time per peer (a lock: a peer owning several fragments shares one copy).

Two evaluators, one interface (``Evaluator``):

- ``WindowEvaluator``: the built-in workload's. Windows of ``block_size + 1`` bytes of a pinned
  validation slice (``node.workload.corpus.validation_slice``; every peer of a local swarm derives
  the same bytes, identified by their SHA-256); window ``i`` starts at byte ``i``, so the pool holds
  as many windows as the slice has bytes, far more than one check evaluates. Each window's
  cross-entropy is one loss, so the noise is measured from the spread over windows.
- ``CallableEvaluator``: ``Swarm(validate=...)``'s (``node.api``). ``validate(model) -> loss`` is
  called ``repeats`` times per version (it draws its own batches); the spread of those calls is
  the noise.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from protocol.diloco.fragments import FragmentPlan
from protocol.diloco.validation import (
    MIN_POOL_RATIO,
    ValidationConfig,
    Verdict,
    draw_seed,
    draw_windows,
    judge,
)

__all__ = [
    "CallableEvaluator",
    "Check",
    "Evaluator",
    "OwnerValidation",
    "ValidationSetMismatch",
    "WindowEvaluator",
    "check_pin",
    "recheck",
    "window_evaluator",
]

log = logging.getLogger("atoll.validation")


class Evaluator(Protocol):
    """Per-window losses of the model with ``theta`` as fragment ``fragment``."""

    pool: int  # how many windows there are to draw from
    digest: str  # what is evaluated on (the pinned slice's SHA-256), for the log

    def losses(self, fragment: int, theta: torch.Tensor, windows: Sequence[int]) -> list[float]: ...


class _ModelCopy:
    """A frozen copy of an island's model whose fragments are set from flat vectors."""

    def __init__(
        self,
        model: nn.Module,
        plan: FragmentPlan,
        held: Callable[[], Sequence[torch.Tensor]] | None,
    ) -> None:
        """``held``: the other fragments (flat fp32, one per fragment), read at each evaluation;
        None: ``model``'s own parameters as they are then (the island's trained weights)."""
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        named = dict(self.model.named_parameters())
        self.params = [[named[n] for n in f.names] for f in plan.fragments]
        live = dict(model.named_parameters())
        self.live = [[live[n] for n in f.names] for f in plan.fragments]
        self.held = held
        self.lock = threading.Lock()

    @torch.no_grad()
    def load(self, fragment: int, theta: torch.Tensor) -> None:
        """The other fragments (``held``'s, or the live model's), and ``theta`` as ``fragment``
        (call under ``lock``)."""
        held = self.held() if self.held is not None else None
        for p, params in enumerate(self.params):
            if p != fragment and held is None:
                for param, src in zip(params, self.live[p], strict=True):
                    param.copy_(src.detach())
                continue
            flat = (
                theta if p == fragment or held is None else held[p]
            )  # held is None only for ``fragment`` here
            offset = 0
            for param in params:
                n = param.numel()
                param.copy_(flat[offset : offset + n].view_as(param))
                offset += n


class WindowEvaluator:
    """Cross-entropy per window of a pinned validation slice (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        plan: FragmentPlan,
        held: Callable[[], Sequence[torch.Tensor]] | None,
        data: torch.Tensor,
        *,
        block_size: int,
        batch: int = 16,
    ) -> None:
        """``data``: the validation slice, uint8 (n,). Raises ``ValueError`` when it is shorter
        than one window."""
        if data.numel() <= block_size + 1:
            raise ValueError(
                f"a validation slice of {data.numel()} bytes holds no window of {block_size + 1}"
            )
        self.copy = _ModelCopy(model, plan, held)
        self.data, self.block_size, self.batch = data, block_size, batch
        self.pool = data.numel() - block_size - 1  # window i starts at byte i
        self.digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        self._offsets = torch.arange(block_size + 1)  # (T+1,)

    @torch.no_grad()
    def losses(self, fragment: int, theta: torch.Tensor, windows: Sequence[int]) -> list[float]:
        device = next(self.copy.model.parameters()).device
        starts = torch.tensor(list(windows), dtype=torch.long)
        out: list[float] = []
        with self.copy.lock:
            self.copy.load(fragment, theta)
            for b in range(0, len(starts), self.batch):
                idx = starts[b : b + self.batch, None] + self._offsets  # (B, T+1)
                window = self.data[idx].to(device=device, dtype=torch.long)  # (B, T+1) int64
                logits, _ = self.copy.model(window[:, :-1], None)  # (B, T, vocab)
                loss = F.cross_entropy(
                    logits.float().transpose(1, 2), window[:, 1:], reduction="none"
                )  # (B, T)
                out.extend(loss.mean(dim=1).tolist())
        return out


class CallableEvaluator:
    """``validate(model) -> loss`` called ``repeats`` times per version (see the module docstring)."""

    pool = 1 << 30  # the windows only number the repeats: the callable draws its own batches

    def __init__(
        self,
        model: nn.Module,
        plan: FragmentPlan,
        held: Callable[[], Sequence[torch.Tensor]] | None,
        validate: Callable[[nn.Module], float],
        *,
        repeats: int = 4,
    ) -> None:
        if repeats < 2:
            raise ValueError(f"validation needs at least 2 repeats to measure noise, got {repeats}")
        self.copy = _ModelCopy(model, plan, held)
        self.validate, self.repeats = validate, repeats
        self.digest = f"callable:{getattr(validate, '__qualname__', type(validate).__name__)}"

    @torch.no_grad()
    def losses(self, fragment: int, theta: torch.Tensor, windows: Sequence[int]) -> list[float]:
        with self.copy.lock:
            self.copy.load(fragment, theta)
            return [float(self.validate(self.copy.model)) for _ in range(self.repeats)]


@dataclass(frozen=True, slots=True)
class Check:
    """One check of a candidate: the verdict, and the record the owner's event log keeps of it
    (everything ``atoll replay`` needs to redraw the windows and recompute the verdict)."""

    verdict: Verdict
    record: dict[str, Any]
    seconds: float  # spent evaluating


class OwnerValidation:
    """One owner's checks of its candidates (``protocol.diloco.validation`` for the theory)."""

    def __init__(
        self,
        evaluator: Evaluator,
        config: ValidationConfig = ValidationConfig(),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``rng``: the owner's own randomness for window seeds and which merges to check (a
        fresh ``random.SystemRandom`` unless a test passes a seeded one)."""
        self.evaluator, self.config, self.clock = evaluator, config, clock
        self.rng = rng or random.SystemRandom()
        self._recheck = False  # the merge after a rejected candidate is always checked
        self.checks = self.rejected = 0
        self.seconds = 0.0

    def check(
        self,
        fragment: int,
        version: int,
        current: torch.Tensor,
        candidate: torch.Tensor,
        alone: Callable[[], Mapping[bytes, torch.Tensor]],
    ) -> Check | None:
        """Check ``candidate`` (to be published as ``version``) against ``current``; ``alone``
        gives, per sender, the candidate with only its work applied (asked for only when the
        candidate does not improve beyond noise: ``protocol.diloco.validation.judge``). None when
        this merge is not one of those checked (``config.every``)."""
        if not (
            self._recheck or self.config.every == 1 or self.rng.random() * self.config.every < 1.0
        ):
            return None
        t0 = self.clock()
        seed = draw_seed(self.rng)
        windows = draw_windows(self.evaluator.pool, self.config.windows, seed)
        before = self.evaluator.losses(fragment, current, windows)
        after = self.evaluator.losses(fragment, candidate, windows)
        verdict = judge(before, after, None, self.config)
        scored: dict[bytes, list[float]] | None = None
        if not verdict.publish:
            thetas = alone()
            # one sender's work alone is the candidate: its losses are measured already
            scored = (
                {peer: after for peer in thetas}
                if len(thetas) == 1
                else {
                    peer: self.evaluator.losses(fragment, theta, windows)
                    for peer, theta in thetas.items()
                }
            )
            verdict = judge(before, after, scored, self.config)
        seconds = self.clock() - t0
        self.checks += 1
        self.rejected += int(not verdict.publish)
        self.seconds += seconds
        self._recheck = not verdict.publish
        record = {
            "kind": "validation",
            "version": version,
            "seed": seed,
            "pool": self.evaluator.pool,
            "windows": list(windows),
            "data": self.evaluator.digest,
            "config": dataclasses.asdict(self.config),
            "before": before,
            "candidate": after,
            "alone": None if scored is None else {p.hex(): v for p, v in sorted(scored.items())},
            "publish": verdict.publish,
            "drop": sorted(p.hex() for p in verdict.drop),
            "helped": sorted(p.hex() for p in verdict.helped),
            "reason": verdict.reason,
        }
        return Check(verdict, record, seconds)


def recheck(record: Mapping[str, Any]) -> list[str]:
    """What differs when a logged check (``Check.record``) is recomputed: its windows redrawn from
    its seed, its verdict from its losses (``atoll replay``). Raises ``ValueError`` for a record
    an owner does not write."""
    try:
        # a record from before ``rule`` was logged was judged by rule 1
        config = ValidationConfig(**{"rule": 1, **record["config"]})
        windows = draw_windows(int(record["pool"]), config.windows, int(record["seed"]))
        before, after = (
            [float(x) for x in record["before"]],
            [float(x) for x in record["candidate"]],
        )
        alone = record["alone"]
        scored = (
            None
            if alone is None
            else {bytes.fromhex(p): [float(x) for x in v] for p, v in alone.items()}
        )
        verdict = judge(before, after, scored, config)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a validation record as an owner writes it ({exc!r})") from None
    got = {
        "windows": list(windows),
        "publish": verdict.publish,
        "drop": sorted(p.hex() for p in verdict.drop),
        "helped": sorted(p.hex() for p in verdict.helped),
        "reason": verdict.reason,
    }
    return [
        f"version {record.get('version')}: {key} logged {record.get(key)!r:.80}, recomputed {value!r:.80}"
        for key, value in got.items()
        if record.get(key) != value
    ]


class ValidationSetMismatch(RuntimeError):
    """This peer's validation slice is not the one the swarm's manifest pins."""


def check_pin(digest: str, pinned: str) -> None:
    """Raise ``ValidationSetMismatch`` naming both hashes and what to do unless ``digest`` (this
    peer's validation slice) is ``pinned`` (the manifest's ``validation_sha256``; "": no pin).

    The peer then does not start: as an owner it would publish versions no check stands behind,
    in a swarm whose manifest says every owner checks them on those bytes."""
    if pinned and digest != pinned:
        raise ValidationSetMismatch(
            f"this peer's validation set hashes to {digest} (SHA-256), but the swarm's manifest "
            f"pins {pinned}: validated publication would judge versions on other data. Train on "
            "the swarm's corpus (the same --corpus and --corpus-max-bytes as its founder), or pass "
            "--validate-windows 0 to train without validating (this peer's owned fragments are "
            "then published unchecked, and it logs so)"
        )


def window_evaluator(
    model: nn.Module,
    plan: FragmentPlan,
    held: Callable[[], Sequence[torch.Tensor]] | None,
    data: torch.Tensor,
    *,
    block_size: int,
    windows: int,
    pinned: str = "",
) -> WindowEvaluator | None:
    """The built-in workload's evaluator, or None (logged: validation is then off) when ``windows``
    is 0 or the validation slice is too small for a pool far larger than one check. ``pinned``:
    the SHA-256 the swarm's manifest pins the slice to (``check_pin``; "": none); raises
    ``ValidationSetMismatch`` when ``data`` hashes otherwise."""
    if windows <= 0:
        if pinned:
            log.warning(
                "validated publication is off (--validate-windows 0) in a swarm whose manifest pins "
                "its validation set (%s): this peer's owned fragments are published unchecked",
                pinned[:16],
            )
        return None
    check_pin(hashlib.sha256(data.numpy().tobytes()).hexdigest(), pinned)
    pool = data.numel() - block_size - 1
    if pool < MIN_POOL_RATIO * windows:
        log.warning(
            "validated publication is off: the validation slice holds %d windows, fewer than %d "
            "(%d checks of %d); use a bigger corpus",
            max(pool, 0),
            MIN_POOL_RATIO * windows,
            MIN_POOL_RATIO,
            windows,
        )
        return None
    return WindowEvaluator(model, plan, held, data, block_size=block_size)
