"""Emulated links: latency, a bandwidth cap and a drop rate on this node's outbound requests, per
destination (kernel traffic shaping is not available on every machine)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

__all__ = ["LinkDropped", "LinkEmulator", "LinkProfile"]


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """An emulated link: one-way added latency, a bandwidth cap (0 = none), a drop rate."""

    latency_s: float = 0.0
    bandwidth_bps: float = 0.0
    drop_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bps < 0 or not 0.0 <= self.drop_rate <= 1.0:
            raise ValueError(
                f"invalid link profile {self}: need latency >= 0, bandwidth >= 0, 0 <= drop <= 1"
            )

    @classmethod
    def parse(cls, spec: str) -> LinkProfile:
        """Parse ``latency=50ms,bandwidth=10mbit,drop=0.01`` (any subset, any order)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key not in ("latency", "bandwidth", "drop"):
                raise ValueError(
                    f"bad link spec {part!r}: use latency=50ms,bandwidth=10mbit,drop=0.01"
                )
            values[key] = _parse_quantity(key, raw.strip().lower())
        return cls(
            values.get("latency", 0.0), values.get("bandwidth", 0.0), values.get("drop", 0.0)
        )

    @property
    def active(self) -> bool:
        return self.latency_s > 0 or self.bandwidth_bps > 0 or self.drop_rate > 0


def _parse_quantity(key: str, raw: str) -> float:
    units = {
        "latency": {"ms": 1e-3, "s": 1.0, "": 1.0},
        "bandwidth": {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0, "": 1.0},
        "drop": {"": 1.0},
    }[key]
    for suffix in sorted(units, key=len, reverse=True):
        if raw.endswith(suffix):
            try:
                return float(raw[: len(raw) - len(suffix)]) * units[suffix]
            except ValueError:
                break
    raise ValueError(
        f"bad {key} value {raw!r}; examples: latency=50ms, bandwidth=10mbit, drop=0.01"
    )


class LinkDropped(ConnectionError):
    """The link emulator dropped this request, as a lossy network would."""


@dataclass
class LinkEmulator:
    """Applies a ``LinkProfile`` to outbound requests; per-destination profiles override."""

    default: LinkProfile = field(default_factory=LinkProfile)
    per_peer: dict[str, LinkProfile] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def profile(self, url: str) -> LinkProfile:
        for prefix, prof in self.per_peer.items():
            if url.startswith(prefix):
                return prof
        return self.default

    async def before_send(self, url: str) -> None:
        prof = self.profile(url)
        if prof.drop_rate and self.rng.random() < prof.drop_rate:
            raise LinkDropped(f"emulated drop on link to {url} (rate {prof.drop_rate})")
        if prof.latency_s:
            await asyncio.sleep(prof.latency_s)

    async def throttle(self, url: str, nbytes: int) -> None:
        prof = self.profile(url)
        if prof.bandwidth_bps:
            await asyncio.sleep(nbytes * 8 / prof.bandwidth_bps)
