"""The x-ratelimit-* headers, formatted the way OpenAI sends them."""

import pytest

from gateway.ratelimit import Decision, format_duration


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-3.0, "0s"),
        (0.0001, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (0.9999, "1s"),
        (1.0, "1s"),
        (8.64, "8.64s"),
        (59.5, "59.5s"),
        (60.0, "1m0s"),
        (61.5, "1m1.5s"),
        (360.0, "6m0s"),
        (3723.0, "1h2m3s"),
        (3600.0, "1h0m0s"),
    ],
)
def test_durations_read_like_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_headers_carry_limits_remaining_and_resets() -> None:
    decision = Decision(
        allowed=True,
        reason="",
        retry_after_s=0.0,
        limit_requests=60,
        limit_tokens=150_000,
        remaining_requests=59,
        remaining_tokens=149_984,
        reset_requests_s=1.0,
        reset_tokens_s=0.0064,
    )
    assert decision.headers() == [
        (b"x-ratelimit-limit-requests", b"60"),
        (b"x-ratelimit-limit-tokens", b"150000"),
        (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-remaining-tokens", b"149984"),
        (b"x-ratelimit-reset-requests", b"1s"),
        (b"x-ratelimit-reset-tokens", b"7ms"),
    ]
