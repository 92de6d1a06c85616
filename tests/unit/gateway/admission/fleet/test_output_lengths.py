"""The expected output a request reserves: a quantile of real completion lengths."""

import math
import random

from gateway.admission.fleet.output_lengths import (
    WINDOW,
    HeldByStream,
    LengthQuantile,
    LengthSource,
    OutputLengths,
    Reserve,
)
from gateway.config import ReservationSettings


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
    settings = ReservationSettings(
        quantile=0.9, quantile_of="answer", prior_tokens=512, min_samples=10
    )
    lengths = OutputLengths(settings)
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


def test_before_its_own_answers_a_pool_borrows_the_replicas_then_the_backends() -> None:
    settings = ReservationSettings(
        quantile=0.9, quantile_of="answer", prior_tokens=512, min_samples=10
    )
    lengths = OutputLengths(settings)
    assert (lengths.source(), lengths.expected()) == (LengthSource.PRIOR, 512)
    lengths.borrow(LengthSource.BACKENDS, [50] * 9)  # too few to tell anything
    assert lengths.source() == LengthSource.PRIOR
    lengths.borrow(LengthSource.BACKENDS, range(10, 110, 10))
    assert (lengths.source(), lengths.expected()) == (LengthSource.BACKENDS, 90)
    lengths.borrow(LengthSource.REPLICAS, [30] * 20)
    assert (lengths.source("a"), lengths.expected("a")) == (LengthSource.REPLICAS, 30)
    assert lengths.learning()
    for _ in range(10):
        lengths.observe(tenant="a", completion_tokens=7)
    assert (lengths.source(), lengths.expected()) == (LengthSource.ANSWERS, 7)
    assert not lengths.learning()
    # what it observed, once, for the other replicas
    assert lengths.unshared() == [7] * 10
    assert lengths.unshared() == []
    # a borrowed figure that went stale (too few now) is dropped, not kept
    fresh = OutputLengths(settings)
    fresh.borrow(LengthSource.REPLICAS, [30] * 20)
    fresh.borrow(LengthSource.REPLICAS, [30] * 5)
    assert fresh.source() == LengthSource.PRIOR


def test_choices_are_samples_of_their_mean_length() -> None:
    lengths = OutputLengths(ReservationSettings(min_samples=1))
    lengths.observe(tenant="a", completion_tokens=301, choices=3)
    assert lengths.expected("a") == 101


def test_reserved_output_is_the_smaller_of_the_cap_and_the_expected() -> None:
    lengths = OutputLengths(ReservationSettings(prior_tokens=512))
    assert lengths.reserve_output(tenant="a", cap=2048) == Reserve(output=512)
    assert lengths.reserve_output(tenant="a", cap=100) == Reserve(output=100)
    static = OutputLengths(ReservationSettings(mode="max_tokens", prior_tokens=512))
    assert static.reserve_output(tenant="a", cap=2048) == Reserve(output=2048)


def geometric_answers(lengths: OutputLengths, *, mean: float, count: int) -> list[int]:
    rng = random.Random(7)
    answers = [1 + int(rng.expovariate(1 / (mean - 1))) for _ in range(count)]
    for tokens in answers:
        lengths.observe(tenant="a", completion_tokens=tokens)
    return answers


def test_answers_sharing_a_backend_reserve_the_mean_and_their_share_of_the_spread() -> None:
    lengths = OutputLengths(ReservationSettings(quantile=0.9, min_samples=10))
    answers = geometric_answers(lengths, mean=256, count=1000)
    mean = sum(answers) / len(answers)
    sd = math.sqrt(sum((a - mean) ** 2 for a in answers) / len(answers))
    alone = sorted(answers)[899]  # the p90 of one answer
    # 16,000 tokens of room, prompts of 144: about 40 sequences of 144 + mean at once
    at_once = 16_000 // (144 + math.ceil(mean))
    share = lengths.expected("a", room=16_000, prompt_tokens=144)
    assert share == math.ceil(mean + 1.2815515655446004 * sd / math.sqrt(at_once))
    assert mean < share < alone
    # a backend with room for one such answer at a time reserves the answer's own p90
    assert lengths.expected("a", room=400, prompt_tokens=144) == alone
    assert lengths.expected("a") == alone  # room unknown: one answer alone


def test_the_per_answer_quantile_when_asked_for_or_at_q_1() -> None:
    per_answer = OutputLengths(ReservationSettings(quantile_of="answer", min_samples=10))
    answers = geometric_answers(per_answer, mean=256, count=1000)
    assert per_answer.expected("a", room=16_000, prompt_tokens=144) == sorted(answers)[899]
    everything = OutputLengths(ReservationSettings(quantile=1.0, min_samples=10))
    geometric_answers(everything, mean=256, count=1000)
    assert everything.expected("a", room=16_000, prompt_tokens=144) == max(answers)


def test_a_sum_of_answers_stays_within_its_reservations_at_the_quantile() -> None:
    """The shares are what the quantile promises: 40 answers drawn from the same lengths
    outgrow 40 shares together in about a tenth of draws, not in half or in none."""
    lengths = OutputLengths(ReservationSettings(quantile=0.9, min_samples=10))
    answers = geometric_answers(lengths, mean=256, count=1000)
    share = lengths.expected("a", room=40 * (144 + 256), prompt_tokens=144)
    rng = random.Random(11)
    over = sum(sum(rng.choices(answers, k=40)) > 40 * share for _ in range(2000))
    assert 0.05 < over / 2000 < 0.16


def brute_peak(answers: list[int], prompt: int) -> int:
    """(prompt + t) x S(t) at its highest, t over every token count: S(t) the share of
    answers longer than t, in tokens rounded up."""
    n = len(answers)
    return max(-(-(prompt + t) * sum(a > t for a in answers) // n) for t in range(max(answers) + 1))


def test_the_peak_a_stream_holds_is_the_highest_of_prompt_plus_t_times_survival() -> None:
    rng = random.Random(5)
    for _ in range(40):
        answers = [rng.choice([0, 1, rng.randint(1, 40), int(rng.expovariate(1 / 120))])]
        answers += [int(rng.expovariate(1 / 120)) for _ in range(rng.randint(0, 60))]
        held = HeldByStream(sorted(answers))
        for prompt in (0, 1, 16, 144, 600):
            assert held.peak(prompt) == max(prompt, brute_peak(answers, prompt))


def test_the_peak_of_answers_of_one_length_is_the_whole_answer() -> None:
    held = HeldByStream([300] * 50)
    assert held.peak(100) == 100 + 299  # all still running one token before their end


def test_a_stream_reserves_its_expected_peak_and_its_share_of_the_spread() -> None:
    lengths = OutputLengths(ReservationSettings(quantile=0.9, min_samples=10))
    answers = geometric_answers(lengths, mean=256, count=1000)
    mean = sum(answers) / len(answers)
    sd = math.sqrt(sum((a - mean) ** 2 for a in answers) / len(answers))
    peak = brute_peak(answers, 144)
    # geometric answers of mean 256: (144 + t) x exp(-t / 256) is highest at t = 112,
    # 256 x exp(144 / 256 - 1) = 165 tokens, far below the prompt + mean of 400
    assert 150 < peak < 180
    at_once = 16_000 // peak
    margin = math.ceil(1.2815515655446004 * sd / math.sqrt(at_once))
    streamed = lengths.reserve_output(
        tenant="a", cap=2048, room=16_000, prompt_tokens=144, streaming=True
    )
    assert streamed == Reserve(output=peak - 144 + margin, headroom=margin)
    # not streamed: it cannot grow, so it reserves its whole expected answer
    whole = lengths.reserve_output(tenant="a", cap=2048, room=16_000, prompt_tokens=144)
    assert whole.output == lengths.expected("a", room=16_000, prompt_tokens=144)
    assert whole.output > streamed.output and whole.headroom == 0
    # a cap below its peak: the whole cap, with nothing to grow into
    capped = lengths.reserve_output(
        tenant="a", cap=20, room=16_000, prompt_tokens=144, streaming=True
    )
    assert capped == Reserve(output=20)


def test_hold_whole_and_the_prior_reserve_the_whole_expected_answer() -> None:
    whole = OutputLengths(ReservationSettings(hold="whole", min_samples=10))
    geometric_answers(whole, mean=256, count=1000)
    expected = whole.expected("a", room=16_000, prompt_tokens=144)
    streamed = whole.reserve_output(
        tenant="a", cap=2048, room=16_000, prompt_tokens=144, streaming=True
    )
    assert streamed == Reserve(output=expected)
    fresh = OutputLengths(ReservationSettings(prior_tokens=512))
    streamed = fresh.reserve_output(
        tenant="a", cap=2048, room=16_000, prompt_tokens=144, streaming=True
    )
    assert streamed == Reserve(output=512)


def test_streams_admitted_at_their_peak_fit_together_in_nine_draws_of_ten() -> None:
    """What the reservations promise: 60 streams admitted together with their peak
    reservations, each running its own drawn answer, hold more than their reservations
    at once, at any token, in about a tenth of draws or fewer, not in most."""
    lengths = OutputLengths(ReservationSettings(quantile=0.9, min_samples=10))
    answers = geometric_answers(lengths, mean=256, count=1000)
    prompt, streams = 144, 60
    share = (
        prompt
        + lengths.reserve_output(
            tenant="a", cap=2048, room=streams * 200, prompt_tokens=prompt, streaming=True
        ).output
    )
    rng = random.Random(13)
    over = 0
    for _ in range(300):
        drawn = rng.choices(answers, k=streams)
        most = max(sum(prompt + t for a in drawn if a > t) for t in range(0, 1200, 4))
        over += most > streams * share
    assert over / 300 < 0.12
    assert streams * share < streams * (prompt + sum(answers) / len(answers))
