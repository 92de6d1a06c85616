"""The simulated provider's requests/min and tokens/min buckets, on a manual clock."""

import pytest

from gateway.clock import ManualClock
from loadtest.sim.ratelimit import ProviderLimits, TokenBucket


def test_bucket_refills_continuously_up_to_capacity() -> None:
    clock = ManualClock()
    bucket = TokenBucket(capacity=60, clock=clock)
    bucket.take(60)
    assert bucket.wait_s(1) == pytest.approx(1.0)
    clock.advance(30)
    assert bucket.level() == pytest.approx(30)
    clock.advance(3600)
    assert bucket.level() == 60


def test_a_request_takes_from_both_buckets_or_from_neither() -> None:
    clock = ManualClock()
    limits = ProviderLimits(requests_per_minute=10, tokens_per_minute=600, clock=clock)
    assert limits.admit(500).allowed
    refused = limits.admit(200)
    assert not refused.allowed and refused.limited_by == "tokens"
    assert refused.retry_after_s == pytest.approx(10.0)  # 100 tokens missing at 10/s
    assert limits.requests.level() == pytest.approx(9)  # the refused one took no request
    clock.advance(10)
    assert limits.admit(200).allowed


def test_requests_per_minute_limit_names_requests() -> None:
    clock = ManualClock()
    limits = ProviderLimits(requests_per_minute=2, tokens_per_minute=10_000, clock=clock)
    assert limits.admit(1).allowed and limits.admit(1).allowed
    refused = limits.admit(1)
    assert refused.limited_by == "requests" and refused.retry_after_s == pytest.approx(30.0)


def test_a_request_larger_than_the_tokens_per_minute_can_never_pass() -> None:
    limits = ProviderLimits(requests_per_minute=2, tokens_per_minute=100, clock=ManualClock())
    verdict = limits.admit(101)
    assert not verdict.allowed and verdict.too_large


def test_headers_report_remaining_capacity() -> None:
    limits = ProviderLimits(requests_per_minute=5, tokens_per_minute=100, clock=ManualClock())
    limits.admit(40)
    headers = dict(limits.headers())
    assert headers[b"x-ratelimit-remaining-requests"] == b"4"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"60"
    limits.refill()
    assert dict(limits.headers())[b"x-ratelimit-remaining-tokens"] == b"100"
