"""The averaging bench's incumbent: one hivemind 1.1.12 ``DecentralizedAverager`` peer.

Each peer runs a hivemind DHT (its own process and p2pd daemon) and an averager (another
process) over the bench's tensors, with ``target_group_size = N``: matchmaking starts the
all-reduce as soon as the group is full instead of waiting out ``min_matchmaking_time``
(``min_group_size`` stays 2, so survivors of a kill can still form a group). One round is one
``averager.step()``: matchmaking plus a butterfly all-reduce. Inputs are reset every round to
Θ₀ − Δ_i (``prepare``), so a correct round leaves Θ₀ − mean(Δ) on every peer.

hivemind is imported only here, only when the bench runs it (the ``bench`` extra), never by
``node/`` or ``protocol/``. Its 8-bit codecs are broken with numpy >= 2.4; the bench compares
``none`` and fp16 (``Float16Compression``), and runs ``none`` against Atoll's ``int8``.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.averaging_inputs import (
    Layout,
    chunk_count,
    classify,
    delta,
    initial,
    mean_of,
    relative_error,
)

__all__ = ["HivemindSide", "hivemind_missing"]

PREFIX = "bench_averaging"
# hivemind.Optimizer's defaults (averaging_timeout, and next_chunk_timeout = matchmaking_time);
# the averager's own defaults have no timeouts, and a round whose peer dies then never ends
ALLREDUCE_TIMEOUT_S = 60.0
NEXT_CHUNK_TIMEOUT_S = 15.0


def hivemind_missing() -> str | None:
    """Why hivemind cannot run here (None when it can)."""
    try:
        import hivemind  # noqa: F401
    except Exception as exc:  # ImportError, or a broken dependency at import time
        return (
            f"import hivemind failed: {exc!r} (pip install -e '.[bench]', see docs/benchmarks.md)"
        )
    return None


class HivemindSide:
    """One hivemind peer: DHT + averager over the bench's tensors."""

    def __init__(
        self,
        *,
        index: int,
        peers: int,
        seed: int,
        layout: Layout,
        codec: str,
        initial_peers: list[str],
    ) -> None:
        import hivemind
        from hivemind.compression import Float16Compression, NoCompression

        self.index, self.peers, self.seed, self.layout = index, peers, seed, layout
        self.codec = "fp16" if codec == "fp16" else "none"  # int8 (Atoll's) runs against fp32
        self.dht = hivemind.DHT(
            initial_peers=initial_peers or None, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
        compression = NoCompression() if self.codec == "none" else Float16Compression()
        self.averager = hivemind.averaging.DecentralizedAverager(
            [torch.zeros(n) for n in layout.sizes()],
            self.dht,
            start=True,
            prefix=PREFIX,
            target_group_size=peers,
            min_group_size=2,
            compression=compression,
            allreduce_timeout=ALLREDUCE_TIMEOUT_S,
            next_chunk_timeout=NEXT_CHUNK_TIMEOUT_S,
        )
        self.round = -1

    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def prepare(self, round_: int) -> None:
        """Reset the averaged tensors to Θ₀ − Δ_i (outside the timing)."""
        self.round = round_
        with self.averager.get_tensors() as tensors:
            for t, tensor in enumerate(tensors):
                tensor.copy_(initial(self.seed, self.layout, t))
                tensor.sub_(delta(self.seed, self.layout, round_, self.index, t))

    def cycle(self, timeout_s: float) -> dict[str, Any]:
        """One ``averager.step()``; a failure is data (its error), not an exception."""
        try:
            result = self.averager.step(timeout=timeout_s, allow_retries=True)
        except Exception as exc:
            return {"ok": False, "error": repr(exc)[:400]}
        if result is None:
            return {"ok": False, "error": "averager.step returned None (no group found)"}
        return {"ok": True, "group": len(result)}

    def check(self, sets: dict[str, list[int]], stride: int = 1) -> dict[str, Any]:
        """Every ``stride``-th chunk of every tensor against each set's plain mean: per chunk the
        set it matches; a mix or a "neither" is a silently partial average."""
        with self.averager.get_tensors() as tensors:  # no round runs while the launcher checks
            return self._check(list(tensors), sets, stride)

    def _check(
        self, held_all: list[torch.Tensor], sets: dict[str, list[int]], stride: int
    ) -> dict[str, Any]:
        counts: dict[str, int] = {}
        worst: dict[str, float] = dict.fromkeys(sets, 0.0)
        for t, held in enumerate(held_all):
            base = initial(self.seed, self.layout, t)
            n = held.numel()
            for c in range(self.index % stride, chunk_count(n), stride):
                lo, hi = c * (1 << 16), min(n, (c + 1) * (1 << 16))
                errors = {}
                for name, members in sets.items():
                    ds = [
                        delta(self.seed, self.layout, self.round, i, t, range(c, c + 1))
                        for i in members
                    ]
                    ref = base[lo:hi] - mean_of(ds)
                    errors[name] = relative_error(held[lo:hi], ref, base[lo:hi])
                    worst[name] = max(worst[name], errors[name])
                match = classify(errors, self.codec)
                counts[match] = counts.get(match, 0) + 1
        return {
            "chunks": counts,
            "matches": sorted(counts),
            "worst_errors": {k: float(f"{v:.3g}") for k, v in worst.items()},
        }

    def digests(self) -> list[str]:
        return []

    def close(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()
