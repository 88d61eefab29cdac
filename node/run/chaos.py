"""Chaos for ``atoll local``: kill and restart peers on a schedule, slow some, shape their links.

Theory of operation. ``parse_chaos`` turns ``--chaos SPEC`` into a frozen ``ChaosSpec``;
``ChaosSchedule`` is a pure state machine over it: the launcher calls ``tick(now, live,
owners)`` with the seconds since training started, the peers whose process is training and
those that own a fragment (``GET /v1/status`` → ``owned``), and carries out the ``Kill`` and
``Restart`` decisions it returns (``Skip`` says why a due kill did not happen). Time and the
random choice of a victim are arguments, so tests drive it with a fake clock and a seeded rng.
``uptime`` and ``goodput`` turn what the launcher recorded into the report's accounting
(issue 10, "live accounting").

SPEC is ``default`` or comma-separated items:

  kill=TARGET@WHEN[+restartDELAY]   SIGKILL a peer; restart it DELAY later (same key, same
                                    checkpoint folder); without +restart it stays dead.
                                    TARGET: a peer index, ``learner`` (a random live peer that
                                    owns no fragment; any live peer when all own one),
                                    ``owner`` (a random live owner) or
                                    ``any``. WHEN: ``30s`` (once, 30 s after training starts)
                                    or ``every60s`` (at 60 s, 120 s, ...).
  slow=PEERxFACTOR                  peer PEER's inner steps take FACTOR times as long.
  link=PEER:PROFILE                 peer PEER's emulated link (what it sends and serves):
                                    PROFILE as ``--link``, e.g. latency=50ms,bandwidth=10mbit
                                    (its own commas are fine: items start with a known key).
  calm=DURATION                     no new kill in the last DURATION of the run (default
                                    min(60 s, a quarter of it); restarts still happen then).
  default                           kill=learner@every60s+restart20s,kill=owner@every90s+restart20s,calm=60s

Durations are seconds with an optional unit: ``500ms``, ``20s``, ``2m``. Examples::

  atoll local --peers 4 --duration 300 --chaos default
  atoll local --peers 4 --duration 60 --chaos kill=1@15s+restart10s,kill=learner@every25s+restart10s
  atoll local --peers 4 --duration 120 --chaos default,slow=3x3,link=1:latency=50ms,bandwidth=10mbit

Whatever the spec says, a kill never takes one of the last ``MIN_LIVE`` (2) live peers, and a kill
whose restart would come after the end of the run is skipped.
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "MIN_LIVE",
    "ChaosSchedule",
    "ChaosSpec",
    "ChaosSpecError",
    "Kill",
    "KillRule",
    "Restart",
    "Skip",
    "goodput",
    "longest_gaps",
    "median_step_s",
    "parse_chaos",
    "uptime",
]

MIN_LIVE = 2  # a kill never leaves fewer live peers than this
DEFAULT_CALM_S = 60.0
DEFAULT = "kill=learner@every60s+restart20s,kill=owner@every90s+restart20s,calm=60s"
ROLES = ("learner", "owner", "any")
LINK_KEYS = ("latency=", "bandwidth=", "drop=")
EXAMPLE = "e.g. --chaos kill=learner@every60s+restart20s,slow=3x3"

_DUR = r"(\d+(?:\.\d+)?)(ms|s|m)?"
_KILL = re.compile(rf"^(learner|owner|any|\d+)@(every)?{_DUR}(?:\+restart{_DUR})?$")
_SLOW = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)$")


class ChaosSpecError(ValueError):
    """A ``--chaos`` spec that cannot be run; the message is one line with what to write."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KillRule:
    item: str  # as written, for reasons
    target: str  # "learner", "owner", "any" or a peer index in decimal
    at_s: float  # first kill, seconds after training starts
    every_s: float = 0.0  # 0: once
    restart_s: float | None = None  # None: stays dead


@dataclass(frozen=True, slots=True, kw_only=True)
class ChaosSpec:
    text: str
    kills: tuple[KillRule, ...] = ()
    slow: tuple[tuple[int, float], ...] = ()  # (peer, factor)
    links: tuple[tuple[int, str], ...] = ()  # (peer, link profile)
    calm_s: float | None = None  # None: min(DEFAULT_CALM_S, a quarter of the run)

    def calm_for(self, duration_s: float) -> float:
        return self.calm_s if self.calm_s is not None else min(DEFAULT_CALM_S, duration_s / 4)


def _seconds(value: str, unit: str | None) -> float:
    return float(value) * {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[unit]


def _bad(item: str, expected: str, example: str) -> ChaosSpecError:
    return ChaosSpecError(f"bad --chaos item {item!r}: expected {expected}, e.g. {example}")


def _peer(item: str, raw: str, peers: int, expected: str, example: str) -> int:
    index = int(raw)
    if not 0 <= index < peers:
        raise _bad(item, f"{expected} with PEER one of 0..{peers - 1}", example)
    return index


def _kill_rule(item: str, peers: int) -> KillRule:
    expected = (
        "kill=TARGET@WHEN[+restartDELAY] with TARGET learner, owner, any or a peer index "
        "and WHEN 30s (once) or every60s"
    )
    m = _KILL.match(item.removeprefix("kill="))
    if not m:
        raise _bad(item, expected, "kill=learner@every60s+restart20s or kill=2@30s+restart10s")
    target, every, value, unit, restart, restart_unit = m.groups()
    if target.isdigit():
        _peer(item, target, peers, expected, "kill=2@30s+restart10s")
    at = _seconds(value, unit)
    if at <= 0:
        raise _bad(item, expected + " after 0 s", "kill=learner@every60s+restart20s")
    return KillRule(
        item=item,
        target=target,
        at_s=at,
        every_s=at if every else 0.0,
        restart_s=_seconds(restart, restart_unit) if restart else None,
    )


def _items(text: str) -> Iterable[str]:
    """Split on commas, gluing a link profile's own ``latency=``/``bandwidth=``/``drop=`` parts
    back onto the ``link=`` item before them."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "default":
            items.extend(DEFAULT.split(","))
            continue
        if not part:
            raise ChaosSpecError(
                f"bad --chaos {text!r}: an empty item; items are separated by single commas, {EXAMPLE}"
            )
        if part.startswith(LINK_KEYS) and items and items[-1].startswith("link="):
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def parse_chaos(text: str, peers: int) -> ChaosSpec:
    """Parse ``--chaos SPEC`` (see the module docstring) for a swarm of ``peers``.

    Raises ``ChaosSpecError`` (a ``ValueError``) with one line saying what is expected."""
    from node.wire.transport import LinkProfile

    kills: list[KillRule] = []
    slow: dict[int, float] = {}
    links: dict[int, str] = {}
    calm: float | None = None
    for item in _items(text):
        key = item.partition("=")[0]
        if key == "kill":
            kills.append(_kill_rule(item, peers))
        elif key == "slow":
            m = _SLOW.match(item.removeprefix("slow="))
            if not m or float(m.group(2)) < 1.0:
                raise _bad(item, "slow=PEERxFACTOR with FACTOR >= 1", "slow=3x3")
            slow[_peer(item, m.group(1), peers, "slow=PEERxFACTOR", "slow=3x3")] = float(m.group(2))
        elif key == "link":
            expected, example = "link=PEER:PROFILE", "link=1:latency=50ms,bandwidth=10mbit"
            index, sep, profile = item.removeprefix("link=").partition(":")
            if not (sep and index.isdigit() and profile):
                raise _bad(item, expected, example)
            try:
                LinkProfile.parse(profile)
            except ValueError as exc:
                raise _bad(item, f"{expected} ({exc})", example) from None
            links[_peer(item, index, peers, expected, example)] = profile
        elif key == "calm":
            m = re.match(rf"^{_DUR}$", item.removeprefix("calm="))
            if not m:
                raise _bad(item, "calm=DURATION", "calm=60s")
            calm = _seconds(*m.groups())
        else:
            raise ChaosSpecError(
                f"bad --chaos item {item!r}: expected default or items kill=..., "
                f"slow=..., link=..., calm=... separated by commas, {EXAMPLE}"
            )
    if not (kills or slow or links):
        raise ChaosSpecError(f"bad --chaos {text!r}: nothing to do; {EXAMPLE}")
    return ChaosSpec(
        text=text,
        kills=tuple(kills),
        slow=tuple(sorted(slow.items())),
        links=tuple(sorted(links.items())),
        calm_s=calm,
    )


# --- the schedule ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kill:
    peer: int
    restart_at: float | None  # seconds after the start; None: stays dead
    reason: str


@dataclass(frozen=True, slots=True)
class Restart:
    peer: int
    reason: str


@dataclass(frozen=True, slots=True)
class Skip:
    item: str
    reason: str


Decision = Kill | Restart | Skip


@dataclass
class ChaosSchedule:
    """When to kill whom and when to restart them (see the module docstring)."""

    spec: ChaosSpec
    duration_s: float
    rng: random.Random
    _next: list[float] = field(init=False)
    _restarts: dict[int, float] = field(default_factory=dict)  # peer -> restart time

    def __post_init__(self) -> None:
        self._next = [rule.at_s for rule in self.spec.kills]

    @property
    def stop_at(self) -> float:
        """No new kill after this many seconds."""
        return self.duration_s - self.spec.calm_for(self.duration_s)

    def owners_needed(self, now: float) -> bool:
        """Whether a kill by role is due: the caller then passes fresh ``owners`` to ``tick``."""
        return any(
            r.target in ("learner", "owner") and t <= now <= self.stop_at
            for r, t in zip(self.spec.kills, self._next, strict=True)
        )

    def pending_restarts(self) -> dict[int, float]:
        return dict(self._restarts)

    def finished(self) -> bool:
        """No restart pending and no kill left before ``stop_at``."""
        return not self._restarts and all(t > self.stop_at for t in self._next)

    def tick(self, now: float, live: Collection[int], owners: Collection[int]) -> list[Decision]:
        """The kills and restarts due at ``now``, in time order. ``live``: peers whose process
        is training; ``owners``: those that own a fragment."""
        out: list[Decision] = []
        for peer, at in sorted(self._restarts.items(), key=lambda kv: (kv[1], kv[0])):
            if at <= now:
                del self._restarts[peer]
                out.append(Restart(peer, f"restart peer {peer} at {now:.1f} s (due {at:.1f} s)"))
        alive = set(live) - set(self._restarts)
        while True:
            due = [(t, i) for i, t in enumerate(self._next) if t <= now and t <= self.stop_at]
            if not due:
                break
            t, i = min(due)
            rule = self.spec.kills[i]
            self._next[i] = t + rule.every_s if rule.every_s else float("inf")
            out.append(self._kill(rule, t, alive, set(owners)))
        return out

    def _kill(self, rule: KillRule, t: float, alive: set[int], owners: set[int]) -> Decision:
        restart_at = t + rule.restart_s if rule.restart_s is not None else None
        if restart_at is not None and restart_at >= self.duration_s:
            return Skip(
                rule.item,
                f"{rule.item} at {t:.1f} s: skipped, its restart at {restart_at:.1f} s "
                f"would come after the end ({self.duration_s:.1f} s)",
            )
        if len(alive) <= MIN_LIVE:
            return Skip(
                rule.item,
                f"{rule.item} at {t:.1f} s: skipped, only {len(alive)} live peers "
                f"(never the last {MIN_LIVE})",
            )
        pool, what = self._candidates(rule.target, alive, owners)
        if not pool:
            return Skip(
                rule.item,
                f"{rule.item} at {t:.1f} s: skipped, no live {what} "
                f"({len(alive)} live, {len(owners & alive)} owners)",
            )
        victim = self.rng.choice(sorted(pool))
        alive.discard(victim)
        if restart_at is not None:
            self._restarts[victim] = restart_at
        then = f"restart at {restart_at:.1f} s" if restart_at is not None else "no restart"
        return Kill(
            victim,
            restart_at,
            f"{rule.item} at {t:.1f} s: killed peer {victim} "
            f"(1 of {len(pool)} live {what}; {len(alive) + 1} were live), {then}",
        )

    @staticmethod
    def _candidates(target: str, alive: set[int], owners: set[int]) -> tuple[set[int], str]:
        if target == "learner":  # every peer learns: prefer those that own nothing, so a
            # learner's loss is measured apart from an owner's, but never skip for want of one
            # (with as many fragments as peers, every peer may own one)
            learners = alive - owners
            return (
                (learners, "peers owning nothing")
                if learners
                else (set(alive), "learners (all own fragments)")
            )
        if target == "owner":
            return alive & owners, "owners"
        if target == "any":
            return set(alive), "peers"
        return alive & {int(target)}, f"peer {target}"


# --- accounting ----------------------------------------------------------------------------------


def median_step_s(progress: Sequence[tuple[float, int, int]]) -> float:
    """The median inner-step time from progress events ``(time, incarnation, step)``: the median
    over consecutive events of one incarnation of elapsed time ÷ steps done in between."""
    last: dict[int, tuple[float, int]] = {}
    rates: list[float] = []
    for t, who, step in progress:
        if who in last and step > last[who][1]:
            rates.append((t - last[who][0]) / (step - last[who][1]))
        last[who] = (t, step)
    return statistics.median(rates) if rates else 0.0


def uptime(
    published: Sequence[tuple[float, int]],
    fragments: int,
    start: float,
    end: float,
    window_s: float | Callable[[float], float],
) -> float:
    """The fraction of ``[start, end]`` in which every fragment advanced at least once per
    ``window_s`` (2H: 2 × H × the median inner-step time; a function of the time a wait began
    when H grows during the run).

    ``published``: ``(time, fragment)`` of each new version. A fragment is *down* from
    ``window_s`` after its last version (or after ``start``) until its next version (or
    ``end``); a moment counts as up when no fragment is down. Returns 1.0 for an empty span."""
    if end <= start:
        return 1.0
    down: list[tuple[float, float]] = []
    for p in range(fragments):
        times = sorted(t for t, f in published if f == p and start <= t <= end)
        for a, b in zip([start, *times], [*times, end], strict=True):
            w = window_s(a) if callable(window_s) else window_s
            if b - a > w:
                down.append((a + w, b))
    lost, reach = 0.0, start
    for a, b in sorted(down):
        if b > reach:
            lost += b - max(a, reach)
            reach = b
    return 1.0 - lost / (end - start)


def longest_gaps(
    published: Sequence[tuple[float, int]], fragments: int, start: float, end: float
) -> list[float]:
    """Per fragment, the longest time in ``[start, end]`` without a new version."""
    out = []
    for p in range(fragments):
        times = sorted(t for t, f in published if f == p and start <= t <= end)
        out.append(max(b - a for a, b in zip([start, *times], [*times, end], strict=True)))
    return out


def goodput(results: Sequence[Mapping[str, object]], *, peers: int, span_s: float) -> float:
    """Learner time whose work reached the global model ÷ provisioned learner time.

    Approximated from each peer's last incarnation's result: its island's ``steps`` (a restarted
    island resumes its checkpoint's step count, so this counts the work that survived the
    kills) times the fraction of its contributions the owners accepted
    (``contributions_accepted / contributions_sent``: every step's work leaves in one
    contribution per fragment) times its ``median_compute_s`` (a step's time less any wait for
    a merge, which synchronous modes spend idle; ``median_step_s`` if absent). Provisioned time is
    ``peers × span_s`` (the training wall time, start-up not included). So a killed
    incarnation's steps after its last checkpoint, the time it lay dead and a restart's
    start-up count as provisioned time with no goodput."""
    if peers <= 0 or span_s <= 0:
        return 0.0
    useful = 0.0
    for r in results:
        sent = _number(r, "contributions_sent")
        share = min(1.0, _number(r, "contributions_accepted") / sent) if sent else 0.0
        per_step = _number(r, "median_compute_s") or _number(r, "median_step_s")
        useful += _number(r, "steps") * share * per_step
    return useful / (peers * span_s)


def _number(result: Mapping[str, object], key: str) -> float:
    value = result.get(key, 0)
    return float(value) if isinstance(value, int | float) else 0.0
