"""Token buckets with a fake clock (protocol.dht.ratelimit)."""

from __future__ import annotations

import pytest

from protocol.dht.ratelimit import RateLimiter, TokenBucket
from protocol.errors import LocalProtocolError


def test_limiter_arguments_are_checked() -> None:
    with pytest.raises(LocalProtocolError):
        TokenBucket(rate=1, burst=0)
    with pytest.raises(LocalProtocolError):
        RateLimiter(rate=1, burst=1, max_peers=0)


def test_token_bucket_refills_at_rate_up_to_burst() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0)
    assert [bucket.allow(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.allow(0.5) and not bucket.allow(0.5)  # 0.5 s * 2/s = one token
    assert [bucket.allow(100.0) for _ in range(4)] == [True, True, True, False]  # capped at burst
    assert not bucket.allow(50.0)  # a clock going back adds nothing
    assert bucket.allow(101.0, cost=2.0) and not bucket.allow(101.0, cost=0.5)


def test_rate_limiter_is_per_peer_and_bounded() -> None:
    limiter = RateLimiter(rate=1.0, burst=2.0, max_peers=2)
    assert limiter.allow(b"a", 0.0) and limiter.allow(b"a", 0.0) and not limiter.allow(b"a", 0.0)
    assert limiter.allow(b"b", 0.0)  # another peer has its own bucket
    assert limiter.allow(b"a", 1.0) and not limiter.allow(b"a", 1.0)
    limiter.allow("c", 1.0)  # evicts the least recently used, b
    assert len(limiter) == 2
    assert not limiter.allow(b"a", 1.0)  # a was kept, still empty


def test_token_bucket_says_how_long_to_wait() -> None:
    bucket = TokenBucket(rate=2.0, burst=2.0)
    assert bucket.wait_s(0.0) == 0.0
    assert bucket.allow(0.0) and bucket.allow(0.0) and not bucket.allow(0.0)
    assert bucket.wait_s(0.0) == pytest.approx(0.5) and bucket.wait_s(0.25) == pytest.approx(0.25)
    assert bucket.wait_s(0.0, cost=3.0) == float("inf")
    assert TokenBucket(rate=0.0, burst=1.0).wait_s(0.0, cost=2.0) == float("inf")


def test_a_charge_known_after_the_work_may_go_into_debt_and_is_paid_back_before_more() -> None:
    bucket = TokenBucket(rate=10.0, burst=100.0)
    bucket.charge(0.0, 150.0)  # an answer larger than what was left: the bucket owes 50
    assert bucket.wait_s(0.0) == pytest.approx(5.1) and not bucket.allow(0.0)
    assert not bucket.allow(5.0) and bucket.allow(5.2)  # paid back at the rate first
    bucket.charge(5.2, 1e9)  # a debt is bounded by one burst
    assert bucket.tokens == -100.0
