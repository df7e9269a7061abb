"""Token buckets and per-tenant limits on a hand-moved clock: capacities, refills, waits, refunds, concurrency,
limits changed by a reload, and OpenAI's duration format."""

from __future__ import annotations

import math

import pytest

from pagedserve.tenants.rate_limiter import (CONCURRENCY, REQUESTS, TOKENS, Limits, RateLimiter, TenantLimiter,
                                             TokenBucket, format_duration)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_starts_full_and_refills_at_its_rate():
    clock = Clock()
    bucket = TokenBucket(5, 5 / 60, clock)
    assert [bucket.take(1) for _ in range(5)] == [0, 0, 0, 0, 0]
    assert bucket.take(1) == pytest.approx(12.0)  # one request every 12 s at 5 per minute
    clock.now += 6
    assert bucket.take(1) == pytest.approx(6.0) and bucket.level() == pytest.approx(0.5)
    clock.now += 6
    assert bucket.take(1) == 0
    clock.now += 3600
    assert bucket.level() == 5  # never above capacity


def test_more_than_the_capacity_can_never_be_taken():
    bucket = TokenBucket(100, 100 / 60, Clock())
    assert math.isinf(bucket.take(101)) and bucket.level() == 100


def test_give_back_refills_up_to_the_capacity():
    bucket = TokenBucket(100, 1, Clock())
    assert bucket.take(80) == 0
    bucket.give_back(30)
    assert bucket.level() == 50
    bucket.give_back(500)
    assert bucket.level() == 100 and bucket.seconds_until_full() == 0


def test_requests_per_minute_refuse_the_sixth_of_five():
    clock = Clock()
    limiter = TenantLimiter(Limits(requests_per_minute=5), clock)
    for _ in range(5):
        assert limiter.admit() is None
        limiter.release()
    refusal = limiter.admit()
    assert refusal.limit == REQUESTS and refusal.retry_after == pytest.approx(12.0) and refusal.capacity == 5
    assert limiter.in_flight == 0


def test_tokens_are_reserved_refused_by_count_and_refunded():
    limiter = TenantLimiter(Limits(tokens_per_minute=100), Clock())
    assert limiter.reserve(60) is None and limiter.reserve(30) is None
    refusal = limiter.reserve(20)
    assert refusal.limit == TOKENS and refusal.requested == 20 and not refusal.never
    assert refusal.retry_after == pytest.approx(10 / (100 / 60))
    limiter.refund(25)  # a short completion gives back what it did not generate
    assert limiter.reserve(20) is None and limiter.tokens.level() == pytest.approx(15)
    assert limiter.reserve(101).never


def test_concurrency_holds_until_release_and_does_not_spend_requests():
    limiter = TenantLimiter(Limits(requests_per_minute=10, max_concurrent_requests=2), Clock())
    assert limiter.admit() is None and limiter.admit() is None
    refusal = limiter.admit()
    assert refusal.limit == CONCURRENCY and limiter.in_flight == 2
    assert limiter.requests.level() == 8  # the refused one took nothing
    limiter.release()
    assert limiter.admit() is None and limiter.in_flight == 2


def test_no_limits_never_refuse():
    limiter = TenantLimiter(Limits(), Clock())
    assert all(limiter.admit() is None for _ in range(1000)) and limiter.reserve(10**9) is None
    assert limiter.requests is None and limiter.tokens is None


def test_state_survives_new_limits_by_tenant_name():
    clock = Clock()
    limiters = RateLimiter(clock)
    web = limiters.for_tenant("web", Limits(requests_per_minute=5, tokens_per_minute=100))
    for _ in range(5):
        web.admit()
    web.reserve(40)
    again = limiters.for_tenant("web", Limits(requests_per_minute=10, tokens_per_minute=50))
    assert again is web and web.in_flight == 5
    assert web.requests.level() == pytest.approx(5)  # 5 used of the new 10
    assert web.tokens.level() == pytest.approx(10)  # 40 used of the new 50
    limiters.for_tenant("web", Limits(tokens_per_minute=50))
    assert web.requests is None and web.tokens.level() == pytest.approx(10)
    assert limiters.for_tenant("batch", Limits()) is not web


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (0.12, "120ms"), (0.0004, "1ms"), (1, "1s"), (1.5, "1.5s"),
                                          (12.0, "12s"), (59.25, "59.25s"), (360, "6m0s"), (90.5, "1m30.5s"),
                                          (3723, "1h2m3s")])
def test_durations_are_written_as_openai_writes_them(seconds, text):
    assert format_duration(seconds) == text
