"""How many inner steps a fragment trains between two syncs, as the inner learning rate decays.

A constant H spends as many rounds on the last, low-learning-rate stretch of a run as on its
first, where the islands move furthest apart. Growing H as the learning rate falls spends the
same number of rounds where they buy more: the Quadratic Synchronization Rule (Gu et al.,
ICLR 2024, arXiv 2310.14423) sets H ∝ 1/lr²; ``inverse-lr`` grows it as 1/lr (an island's drift
over H steps grows with lr·H, so a round's cost stays about even).

``sqrt-lr`` goes the other way: H = base·√(lr/peak) *shrinks* as the learning rate decays, so
the islands sync more often over the low-lr end of a run, where the global model that is
evaluated is made, and less often early on (with a cosine to 0.1 of the peak, H ends at
0.32·base; base 320 spends the same 15 rounds over 3,000 steps as a constant 200).

``interval(base, lr_ratio, growth)`` takes the inner learning rate as a fraction of its peak
(``lr_ratio`` in (0, 1]; during warmup pass 1) and returns H: for the growing schedules never
below ``base`` and at most ``MAX_GROWTH`` times it, so a schedule decaying to zero cannot stop a
fragment from syncing; for ``sqrt-lr`` at most ``base`` and at least 1.
"""

from __future__ import annotations

import math

from protocol.errors import LocalProtocolError

__all__ = ["GROWTHS", "MAX_GROWTH", "SHRINKING", "interval"]

GROWTHS = ("constant", "inverse-lr", "qsr", "sqrt-lr")
SHRINKING = ("sqrt-lr",)
MAX_GROWTH = 100


def interval(base: int, lr_ratio: float, growth: str) -> int:
    """Inner steps until a fragment that syncs now is due again.

    Raises ``LocalProtocolError`` for ``base`` < 1, an unknown ``growth``, or an ``lr_ratio``
    that is not finite or not in (0, 1] (clamp warmup to 1 before calling)."""
    if base < 1:
        raise LocalProtocolError(f"sync interval base must be >= 1 inner step, got {base}")
    if growth not in GROWTHS:
        raise LocalProtocolError(
            f"sync interval growth must be one of {', '.join(GROWTHS)}, got {growth!r}"
        )
    if not (math.isfinite(lr_ratio) and 0.0 < lr_ratio <= 1.0 + 1e-9):
        raise LocalProtocolError(
            f"lr_ratio must be in (0, 1] (the lr as a fraction of its peak), got {lr_ratio!r}"
        )
    if growth == "constant":
        return base
    if growth == "sqrt-lr":
        return max(1, int(base * math.sqrt(min(1.0, lr_ratio)) + 1e-9))
    power = 1 if growth == "inverse-lr" else 2
    grown = base / min(1.0, lr_ratio) ** power
    return int(min(grown, base * MAX_GROWTH) + 1e-9)  # 100 / 0.1**2 is 9999.99...
