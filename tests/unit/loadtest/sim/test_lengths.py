"""Where a simulated answer ends: a sampled EOS or stop id, capped by max_tokens."""

import random
import statistics

import pytest

from loadtest.percentile import percentile
from loadtest.sim.lengths import (
    AnswerLengths,
    Finish,
    LengthSampler,
    StopRule,
    geometric,
)

SAMPLE = 20_000
IDS = tuple(range(8, 24))  # the 16 stop ids real random-weight vLLM was run with


def lengths(sampler: LengthSampler, *, cap: int = 2048, rule: StopRule | None = None) -> list[int]:
    return [sampler.answer(cap=cap, rule=rule or StopRule()).tokens for _ in range(SAMPLE)]


def test_default_lengths_are_geometric_like_real_vllm_stopping_on_16_of_4096_ids() -> None:
    # real vLLM measured mean 261 / p50 168 / p90 527 with max_tokens 2048; a geometric
    # answer of mean 256 has p50 = 256 ln 2 = 177 and p90 = 256 ln 10 = 589
    sampler = LengthSampler(mode=AnswerLengths.GEOMETRIC, rng=random.Random(7))
    values = lengths(sampler)
    assert statistics.fmean(values) == pytest.approx(256, rel=0.03)
    assert percentile(values, 50) == pytest.approx(177, rel=0.05)
    assert percentile(values, 90) == pytest.approx(589, rel=0.05)
    assert max(values) <= 2048


def test_lognormal_lengths_keep_the_configured_mean() -> None:
    sampler = LengthSampler(
        mode=AnswerLengths.LOGNORMAL, mean_tokens=300, sigma=0.8, rng=random.Random(3)
    )
    values = lengths(sampler, cap=100_000)
    assert statistics.fmean(values) == pytest.approx(300, rel=0.03)


def test_the_cap_ends_an_answer_with_length_and_an_eos_with_stop() -> None:
    sampler = LengthSampler(mode=AnswerLengths.GEOMETRIC, rng=random.Random(1))
    answers = [sampler.answer(cap=100, rule=StopRule()) for _ in range(2000)]
    capped = [a for a in answers if a.finish is Finish.LENGTH]
    stopped = [a for a in answers if a.finish is Finish.STOP]
    assert {a.tokens for a in capped} == {100}
    assert max(a.tokens for a in stopped) < 100
    # P(no EOS in 100 tokens) = (255/256)^100 = 0.68
    assert len(capped) / len(answers) == pytest.approx(0.68, abs=0.03)


def test_ignore_eos_runs_every_answer_to_its_cap() -> None:
    sampler = LengthSampler(mode=AnswerLengths.GEOMETRIC, rng=random.Random(1))
    answers = {sampler.answer(cap=700, rule=StopRule(ignore_eos=True)) for _ in range(500)}
    assert {(a.tokens, a.finish) for a in answers} == {(700, Finish.LENGTH)}


def test_max_tokens_mode_has_no_eos_but_stop_token_ids_still_stop_k_in_v() -> None:
    sampler = LengthSampler(mode=AnswerLengths.MAX_TOKENS, vocab_size=4096, rng=random.Random(5))
    assert {a.tokens for a in (sampler.answer(cap=2048, rule=StopRule()) for _ in range(50))} == {
        2048
    }
    values = lengths(sampler, rule=StopRule(stop_token_ids=IDS))
    assert statistics.fmean(values) == pytest.approx(256, rel=0.03)  # 16 / 4096 = 1 / 256
    # ignore_eos drops the model's EOS, not the request's own stop ids (as vLLM does)
    ignoring = lengths(sampler, rule=StopRule(stop_token_ids=IDS, ignore_eos=True))
    assert statistics.fmean(ignoring) == pytest.approx(256, rel=0.03)


def test_an_answer_a_stop_id_ended_names_that_id_as_its_stop_reason() -> None:
    sampler = LengthSampler(mode=AnswerLengths.MAX_TOKENS, vocab_size=64, rng=random.Random(9))
    answers = [sampler.answer(cap=2048, rule=StopRule(stop_token_ids=(3, 7))) for _ in range(200)]
    assert {a.finish for a in answers} == {Finish.STOP}
    assert {a.stop_reason for a in answers} == {3, 7}
    eos = LengthSampler(mode=AnswerLengths.GEOMETRIC, mean_tokens=2, rng=random.Random(9))
    assert {eos.answer(cap=2048, rule=StopRule()).stop_reason for _ in range(50)} == {None}


def test_stop_token_ids_shorten_sampled_answers() -> None:
    sampler = LengthSampler(mode=AnswerLengths.GEOMETRIC, vocab_size=256, rng=random.Random(2))
    # each token stops with 1/256 (EOS) or 1/256 (one stop id of 256): mean ~128
    values = lengths(sampler, rule=StopRule(stop_token_ids=(5,)))
    assert statistics.fmean(values) == pytest.approx(128, rel=0.04)


def test_a_seed_makes_lengths_reproducible_per_choice() -> None:
    def draw(seed: int, index: int) -> int:
        sampler = LengthSampler(mode=AnswerLengths.GEOMETRIC)  # a fresh, unseeded generator
        return sampler.answer(cap=2048, rule=StopRule(seed=seed), index=index).tokens

    firsts = [draw(seed, 0) for seed in range(20)]
    assert firsts == [draw(seed, 0) for seed in range(20)]
    assert len(set(firsts)) > 10
    assert [draw(4, i) for i in range(5)] != [draw(4, 0)] * 5


def test_min_tokens_come_before_any_end() -> None:
    sampler = LengthSampler(mode=AnswerLengths.GEOMETRIC, mean_tokens=1, rng=random.Random(0))
    answer = sampler.answer(cap=50, rule=StopRule(min_tokens=10))
    assert (answer.tokens, answer.finish) == (11, Finish.STOP)


def test_geometric_counts_the_stopping_token() -> None:
    assert geometric(random.Random(0), 1.0) == 1
    values = [geometric(random.Random(i), 0.5) for i in range(4000)]
    assert min(values) == 1 and statistics.fmean(values) == pytest.approx(2, rel=0.05)


@pytest.mark.parametrize("mode", list(AnswerLengths))
def test_a_continued_answer_ends_where_and_as_the_whole_one_would(mode: AnswerLengths) -> None:
    """An answer cut after `given` tokens and continued with `max_tokens` less those gets
    the rest of the same answer: never past the first request's cap, its finish unchanged."""
    sampler = LengthSampler(mode=mode, mean_tokens=40)
    for seed in range(200):
        rule = StopRule(seed=seed, stop_token_ids=IDS)
        whole = sampler.answer(cap=100, rule=rule)
        for given in range(0, whole.tokens, 7):
            rest = sampler.answer(cap=100 - given, rule=rule, given=given)
            assert (given + rest.tokens, rest.finish, rest.stop_reason) == (
                whole.tokens,
                whole.finish,
                whole.stop_reason,
            )


def test_a_continuation_past_where_the_answer_would_have_ended_stops_at_once() -> None:
    sampler = LengthSampler(mode=AnswerLengths.GEOMETRIC, mean_tokens=1)
    rest = sampler.answer(cap=50, rule=StopRule(seed=1), given=30)
    assert (rest.tokens, rest.finish) == (1, Finish.STOP)
