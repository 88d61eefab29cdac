"""Attack injection for measuring the robust merge end to end (``atoll local --attack PEER:KIND``).

An attacking peer trains like the others, but every contribution its learner sends is first
passed through an ``Attack``, which rewrites it the way a malicious member would:

- ``scale=X``: the pseudo-gradient times X (default 1000);
- ``random``: a random direction with X times the honest norm (default 1);
- ``signflip``: the pseudo-gradient negated (and times X, default 1);
- ``stale``: the fragment's first pseudo-gradient, re-sent forever on the current base version;
- ``lie-tokens=X``: tokens and steps claimed X times over (default 1000), for X times the weight;
- ``alie=Z``: "a little is enough" (Baruch et al., 2019): the honest mean shifted by Z standard
  deviations per coordinate against its sign (default 1), both estimated from the attacker's own
  last ``HISTORY`` honest pseudo-gradients of the fragment (with one, its magnitude stands for the
  deviation): inside the spread an honest contribution could have, so norm bounds let it through;
- ``ipm=E``: inner-product manipulation (Xie et al., 2020): minus E times that honest mean
  (default 2), so the aggregate's inner product with the honest direction shrinks or turns negative;
- ``steps=X``: claims X times the steps it trained (default 2: the 2H a version interval lets an
  owner count) with tokens to match, and scales its pseudo-gradient by X, so the per-step rate
  looks honest while the step is X times one.

Several attacking peers of one run collude: each is seeded with the run's seed (not its index),
so a draw that needs randomness (``random``) comes out the same for every attacker at the same
fragment and base version, and the rules above push every attacker the same way. That is all
they share: no side channel, each estimates the honest statistics from its own work.

Everything else about the contribution stays honest: it is well formed and validly signed, so
only the merge's bounds stand between it and the global model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from node.diloco.island import Outgoing
from node.run.attack_peer import is_peer_attack

__all__ = ["KINDS", "Attack", "parse_local_attack"]

KINDS = {
    "scale": 1000.0,
    "random": 1.0,
    "signflip": 1.0,
    "stale": 1.0,
    "lie-tokens": 1000.0,
    "alie": 1.0,
    "ipm": 2.0,
    "steps": 2.0,
}
HISTORY = (
    4  # honest pseudo-gradients per fragment that alie and ipm estimate the honest statistics from
)


@dataclass
class Attack:
    """Rewrites a learner's outgoing contributions (see the module docstring)."""

    kind: str
    arg: float
    seed: int = 0
    _first: dict[int, torch.Tensor] = field(default_factory=dict)
    _seen: dict[int, list[torch.Tensor]] = field(
        default_factory=dict
    )  # per fragment, the last HISTORY honest ones
    _rng: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown attack {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not self.arg > 0:
            raise ValueError(f"attack {self.kind}: the factor must be > 0, got {self.arg}")
        self._rng = torch.Generator().manual_seed(self.seed)

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> Attack:
        """``KIND`` or ``KIND=X`` (see the module docstring). Raises ``ValueError``."""
        kind, _, arg = spec.strip().partition("=")
        if kind not in KINDS:
            raise ValueError(
                f"unknown attack {kind!r} in {spec!r}; choose one of {', '.join(KINDS)}"
            )
        try:
            value = float(arg) if arg else KINDS[kind]
        except ValueError:
            raise ValueError(f"attack {spec!r}: {arg!r} is not a number") from None
        return cls(kind, value, seed)

    def __call__(self, out: Outgoing) -> Outgoing:
        delta = out.delta
        if self.kind == "scale":
            return dataclasses.replace(out, delta=delta * self.arg)
        if self.kind == "signflip":
            return dataclasses.replace(out, delta=delta * -self.arg)
        if self.kind in ("alie", "ipm"):
            return dataclasses.replace(out, delta=self._against(out.fragment, delta))
        if self.kind == "steps":
            factor = int(self.arg)
            return dataclasses.replace(
                out,
                delta=delta * float(factor),
                tokens=out.tokens * factor,
                steps=out.steps * factor,
            )
        if (
            self.kind == "random"
        ):  # the same draw for every colluder at one fragment and base version
            self._rng.manual_seed(
                ((self.seed * 1_000_003 + out.fragment) * 1_000_003 + out.base_version)
                & (2**63 - 1)
            )
            noise = torch.randn(delta.shape, generator=self._rng)
            norm = float(torch.linalg.vector_norm(delta)) * self.arg
            return dataclasses.replace(
                out, delta=noise * (norm / max(float(torch.linalg.vector_norm(noise)), 1e-12))
            )
        if self.kind == "stale":
            first = self._first.setdefault(out.fragment, delta.clone())
            return dataclasses.replace(out, delta=first.clone())
        factor = int(self.arg)  # lie-tokens
        return dataclasses.replace(out, tokens=out.tokens * factor, steps=out.steps * factor)

    def _against(self, fragment: int, delta: torch.Tensor) -> torch.Tensor:
        """alie or ipm, from the honest statistics of this attacker's own recent work."""
        seen = self._seen.setdefault(fragment, [])
        seen.append(delta.detach().clone())
        del seen[:-HISTORY]
        stacked = torch.stack(seen)  # (k, numel_p)
        mean = stacked.mean(dim=0)
        if self.kind == "ipm":
            return mean * -self.arg
        std = stacked.std(dim=0) if len(seen) > 1 else mean.abs()  # one sample: its magnitude
        return mean - self.arg * std * torch.sign(mean)


def parse_local_attack(spec: str) -> tuple[int, str]:
    """``PEER:KIND[=X]`` -> (peer index, ``KIND[=X]``). Raises ``ValueError`` with what to write."""
    peer, sep, attack = spec.partition(":")
    if not sep or not peer.isdigit():
        raise ValueError(f"--attack takes PEER:KIND[=X], e.g. 2:scale=1000; got {spec!r}")
    if not is_peer_attack(attack):
        Attack.parse(attack)  # fail early on a bad kind
    return int(peer), attack
