"""The expected output a request reserves: a quantile of real completion lengths."""

from gateway.config import ReservationSettings
from gateway.output_lengths import WINDOW, LengthQuantile, OutputLengths


def test_quantile_is_the_nearest_rank_rounded_up() -> None:
    q = LengthQuantile(0.9)
    for tokens in range(1, 101):  # 1..100
        q.observe(tokens)
    assert q.value() == 90
    median = LengthQuantile(0.5)
    for tokens in (10, 20, 30):
        median.observe(tokens)
    assert median.value() == 20


def test_quantile_follows_the_last_window_of_answers() -> None:
    q = LengthQuantile(0.9)
    for _ in range(WINDOW):
        q.observe(1000)
    assert q.value() == 1000
    for _ in range(WINDOW):
        q.observe(100)
    assert len(q) == WINDOW
    assert q.value() == 100


def test_the_prior_until_min_samples_then_the_pool_then_the_tenants_own() -> None:
    lengths = OutputLengths(ReservationSettings(quantile=0.9, prior_tokens=512, min_samples=10))
    assert lengths.expected("a") == 512
    for tokens in range(1, 10):  # 9 answers of tenant b: not enough yet
        lengths.observe(tenant="b", completion_tokens=tokens * 10)
    assert lengths.expected("a") == 512
    lengths.observe(tenant="b", completion_tokens=100)  # the 10th: the pool's figure now
    assert lengths.expected("a") == 90  # a has none of its own: the pool's p90
    assert lengths.expected("b") == 90  # b's own, the same answers
    for _ in range(10):
        lengths.observe(tenant="a", completion_tokens=7)
    assert lengths.expected("a") == 7  # its own figure, once it has min_samples
    assert lengths.expected("b") == 90


def test_choices_are_samples_of_their_mean_length() -> None:
    lengths = OutputLengths(ReservationSettings(min_samples=1))
    lengths.observe(tenant="a", completion_tokens=301, choices=3)
    assert lengths.expected("a") == 101


def test_reserved_output_is_the_smaller_of_the_cap_and_the_expected() -> None:
    lengths = OutputLengths(ReservationSettings(prior_tokens=512))
    assert lengths.reserve_output(tenant="a", cap=2048) == 512
    assert lengths.reserve_output(tenant="a", cap=100) == 100
    static = OutputLengths(ReservationSettings(mode="max_tokens", prior_tokens=512))
    assert static.reserve_output(tenant="a", cap=2048) == 2048
