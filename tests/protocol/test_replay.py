"""Per-sender replay windows: a flood from fresh keys, however large and however far ahead dated,
never refuses an honest member's next message, never lets a message through twice, and leaves
memory bounded. Pure: a fake ``now``, seeded keys."""

from __future__ import annotations

import contextlib
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import LocalProtocolError, Replay
from protocol.wire.codec import encode
from protocol.wire.messages import Ack
from protocol.wire.replay import ReplayWindow
from protocol.wire.signing import Signer, open_sealed, seal

NOW = 1_000_000.0
SKEW = 60.0
HONEST, NEWCOMER = b"h" * 32, b"n" * 32


def nonce(i: int) -> bytes:
    return i.to_bytes(16, "big")


def flood(
    w: ReplayWindow,
    n: int,
    *,
    start: float,
    rng: random.Random,
    every: int = 0,
    honest: bytes = HONEST,
) -> list[tuple[bytes, bytes, float]]:
    """``n`` messages from fresh keys dated ``SKEW - 1`` s ahead, 100 µs apart; every ``every``
    one of them, ``honest`` sends one dated now (each must be accepted). Returns the honest
    messages."""
    sent = []
    for i in range(n):
        now = start + i * 1e-4
        w.accept(rng.randbytes(32), rng.randbytes(16), now + SKEW - 1, now=now)
        if every and i % every == 0:
            w.accept(honest, nonce(i + 1), now, now=now)
            sent.append((honest, nonce(i + 1), now))
    return sent


def test_a_100k_flood_from_fresh_keys_leaves_honest_members_accepted() -> None:
    w = ReplayWindow(max_skew_s=SKEW)  # the defaults: 100k pairs, 100k dormant floors
    w.accept(HONEST, nonce(0), NOW, now=NOW)
    t0 = time.perf_counter()
    flood(w, 100_000, start=NOW, rng=random.Random(1))
    took = time.perf_counter() - t0
    sizes = w.sizes()
    assert sizes.pairs == len(w) == w.capacity and sizes.live_keys <= w.capacity
    assert sizes.dormant_keys <= w.max_dormant
    now = NOW + 10.0
    assert w.floor_of(HONEST) == NOW  # its own timestamp: nobody else's
    w.accept(HONEST, nonce(1), now, now=now)  # the member's next message
    w.accept(NEWCOMER, nonce(0), now, now=now)  # and one never seen before
    with pytest.raises(Replay, match="floor"):  # its forgotten first message is still no replay
        w.accept(HONEST, nonce(0), NOW, now=now)
    with pytest.raises(Replay):  # (already forgotten for the newcomer: below its own floor)
        w.accept(HONEST, nonce(1), now, now=now + 1)
    assert took < 10.0


def test_a_flood_past_every_table_still_refuses_every_replay_and_no_talking_member() -> None:
    w = ReplayWindow(max_skew_s=SKEW, capacity=1000, max_dormant=1000, buckets=1 << 12, salt=b"s")
    sent = flood(w, 100_000, start=NOW, rng=random.Random(2), every=100)  # overflows all 100 times
    assert len(sent) == 1000
    sizes = w.sizes()
    assert (sizes.pairs, sizes.live_keys <= 1000, sizes.dormant_keys, sizes.buckets) == (
        1000,
        True,
        1000,
        4096,
    )
    now = NOW + 10.0
    for key, n, ts in sent:  # every message the member sent is refused a second time
        with pytest.raises(Replay):
            w.accept(key, n, ts, now=now)
    w.accept(HONEST, nonce(0), now, now=now)
    # A key silent for the whole flood starts from a shared floor: refused only if the flood hit
    # its bucket, and only until the flood's timestamps pass.
    later = now + SKEW
    w.accept(NEWCOMER, nonce(0), later, now=later)


def test_buckets_take_over_only_after_the_dormant_table_overflows() -> None:
    w = ReplayWindow(max_skew_s=SKEW, capacity=2, max_dormant=2, buckets=1)  # one shared bucket
    for i in range(6):  # keys 0..3 evicted to dormant, 0 and 1 then folded into the bucket
        w.accept(bytes([i]) * 32, nonce(0), NOW + i, now=NOW)
    assert w.sizes().dormant_keys == 2 and len(w) == 2
    assert w.floor_of(bytes([0]) * 32) == w.floor_of(NEWCOMER) == NOW + 1  # the bucket's floor
    assert w.floor_of(bytes([3]) * 32) == NOW + 3  # dormant: its own
    # live keys keep the floor they started from (the bucket's then), whatever is folded later
    assert (w.floor_of(bytes([4]) * 32), w.floor_of(bytes([5]) * 32)) == (NOW, NOW + 1)
    assert ReplayWindow(buckets=1).floor_of(NEWCOMER) == -math.inf
    with pytest.raises(Replay, match="floor"):  # dropped from every table, still no replay
        w.accept(bytes([0]) * 32, nonce(0), NOW, now=NOW)


def test_misuse_raises() -> None:
    for kwargs in (
        {"capacity": 0},
        {"max_skew_s": 0},
        {"max_dormant": -1},
        {"buckets": 0},
        {"salt": bytes(65)},
    ):
        with pytest.raises(LocalProtocolError):
            ReplayWindow(**kwargs)  # type: ignore[arg-type]


ops = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 3), st.floats(-70, 70), st.floats(0, 3)),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 4), st.integers(0, 3), st.integers(1, 3))
def test_no_message_is_ever_accepted_twice(
    events: list[tuple[int, int, float, float]], capacity: int, dormant: int, buckets: int
) -> None:
    w = ReplayWindow(max_skew_s=10, capacity=capacity, max_dormant=dormant, buckets=buckets)
    accepted: set[tuple[bytes, bytes, float]] = set()
    now = NOW
    for key, n, offset, step in events:
        now += step
        message = (bytes([key]) * 32, nonce(n), round(now + offset / 7, 3))
        try:
            w.accept(*message, now=now)
        except Replay:
            continue
        assert message not in accepted
        accepted.add(message)
        sizes = w.sizes()
        assert (
            sizes.pairs <= capacity
            and sizes.live_keys <= capacity
            and sizes.dormant_keys <= dormant
        )


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 4))
def test_a_member_with_a_steady_clock_is_never_refused(
    events: list[tuple[int, int, float, float]], capacity: int
) -> None:
    """Whatever others send (any key, any nonce, any allowed date), a member that dates its
    messages by a clock that moves forward is never refused, while buckets are not in play."""
    w = ReplayWindow(max_skew_s=10, capacity=capacity, max_dormant=8)
    now = NOW
    for i, (key, n, offset, step) in enumerate(events):
        now += step
        with contextlib.suppress(Replay):
            w.accept(bytes([key]) * 32, nonce(n), now + offset / 7, now=now)
        w.accept(HONEST, nonce(i), now + 0.001 * i, now=now)


def test_a_validly_signed_flood_through_open_sealed() -> None:
    """2,000 validly signed messages (200 fresh keys, 10 nonces each) through a window 20 times
    smaller: the member's next message opens. The window's caps are the test's (a signature and
    its check cost ~0.5 ms, so 20k messages through caps of 1,000 took 10 s: the same ratio)."""
    rng = random.Random(3)
    w = ReplayWindow(max_skew_s=SKEW, capacity=100, max_dormant=100)
    body = encode(Ack(accepted=True, reason="flood", version=0))
    member = Signer.from_seed(b"m" * 32)
    first = seal(body, member, now=NOW, nonce=nonce(0)).tobytes()
    open_sealed(first, now=NOW, replay=w, max_size=1 << 16)
    for k in range(200):
        key = Signer.from_seed(rng.randbytes(32))
        for j in range(10):
            now = NOW + (k * 10 + j) * 1e-4
            wire = seal(body, key, now=now + SKEW - 1, nonce=nonce(j)).tobytes()
            open_sealed(wire, now=now, replay=w, max_size=1 << 16)
    assert len(w) == 100 and w.sizes().dormant_keys == 100
    now = NOW + 3.0
    opened = open_sealed(
        seal(body, member, now=now, nonce=nonce(1)).tobytes(), now=now, replay=w, max_size=1 << 16
    )
    assert opened.peer_id == member.peer_id
    with pytest.raises(Replay):
        open_sealed(first, now=now, replay=w, max_size=1 << 16)
