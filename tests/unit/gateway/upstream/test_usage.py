"""An answer's usage checked against what its request could have used."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.clock import ManualClock
from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.answer import Usage
from gateway.upstream.usage import (
    FRAMING_EVENTS,
    LOG_EVERY_S,
    PROMPT_FLOOR,
    AnswerFlaws,
    Corrected,
    checked_usage,
)
from tests.support.upstream import chat_request


def request(endpoint: Endpoint = Endpoint.CHAT, *, n: int = 1, **body: Any) -> InferenceRequest:
    """A request of 100 prompt tokens and 50 output tokens a choice, naming a limit in
    `body` or not."""
    return chat_request(max_tokens=50, n=n)._replace(
        endpoint=endpoint, prompt_tokens=100, body=body
    )


NAMED = request(max_tokens=50, n=2)


def check(
    reported: Any, asked: InferenceRequest = NAMED, *, events: int | None = None
) -> tuple[Usage, tuple[str, ...]]:
    """The usage taken, and the flaws corrected (each correction keeps what was told)."""
    usage, corrected = checked_usage(reported, asked, events=events)
    if corrected is None:
        return usage, ()
    assert corrected == Corrected(corrected.flaws, reported) and corrected.flaws
    return usage, corrected.flaws


def told(prompt: Any, completion: Any) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def test_an_honest_usage_is_taken_as_told() -> None:
    assert check(told(120, 80)) == (Usage(120, 80, known=True), ())


def test_no_usage_at_all_leaves_the_charge_standing() -> None:
    assert check(None) == (Usage(), ())


@pytest.mark.parametrize(
    ("completion", "expected", "flaw"),
    [
        (10**18, 100, "completion_too_large"),
        (1e300, 100, "completion_too_large"),
        (-5, 100, "completion_negative"),
        ("lots", 100, "completion_not_a_number"),
        ([5], 100, "completion_not_a_number"),
        (True, 100, "completion_not_a_number"),
        (float("nan"), 100, "completion_not_a_number"),
        (0, 100, "completion_zero"),
        (None, 100, "completion_missing"),
        (7.0, 7, None),
    ],
)
def test_a_completion_past_belief_falls_back_to_the_charge_or_the_limit(
    completion: Any, expected: int, flaw: str | None
) -> None:
    """An answer in one piece: the choices' limit (2 x 50) bounds it, and what cannot be
    believed is what was charged."""
    usage, flaws = check(told(120, completion))
    assert (usage.completion_tokens, flaws) == (expected, (flaw,) if flaw else ())


def test_a_stream_falls_back_to_its_events_and_is_bounded_below_by_them() -> None:
    events = 80
    least = events - 2 * 2 - FRAMING_EVENTS
    assert check(told(120, 0), events=events)[0].completion_tokens == events
    assert check(told(120, 3), events=events) == (
        Usage(120, least, known=True),
        ("completion_too_small",),
    )


@pytest.mark.parametrize(
    ("prompt", "expected", "flaw"),
    [
        (10**18, PROMPT_FLOOR, "prompt_too_large"),
        (0, 100, "prompt_zero"),
        ("x", 100, "prompt_not_a_number"),
    ],
)
def test_a_prompt_is_bounded_by_its_estimate(prompt: Any, expected: int, flaw: str) -> None:
    usage, flaws = check(told(prompt, 10))
    assert (usage.prompt_tokens, flaws) == (expected, (flaw,))


def test_an_unnamed_limit_allows_the_engines_whole_context() -> None:
    assert check(told(100, 60_000), request()) == (Usage(100, 60_000, known=True), ())


def test_embeddings_generate_nothing_whatever_is_said() -> None:
    embeddings = request(Endpoint.EMBEDDINGS)._replace(max_output_tokens=0)  # as parsed
    assert check({"prompt_tokens": 9, "total_tokens": 9}, embeddings) == (
        Usage(9, 0, known=True),
        (),
    )
    assert check(told(9, 5), embeddings)[1] == ("completion_not_zero",)
    assert not checked_usage(told(9, 5), embeddings, events=None)[1].lies  # type: ignore[union-attr]


def test_the_responses_api_names_are_read() -> None:
    usage, flaws = check({"input_tokens": 10, "output_tokens": -1})
    assert (usage, flaws) == (Usage(10, 100, known=True), ("completion_negative",))


def test_a_usage_that_is_no_object_is_corrected_whole() -> None:
    assert check([1, 2]) == (
        Usage(100, 100, known=True),
        ("usage_not_an_object", "prompt_missing", "completion_missing"),
    )


# -- never above what the request could have used


EIGHT = request(max_tokens=8)._replace(max_output_tokens=8)


@pytest.mark.parametrize(
    ("completion", "flaws", "lies"),
    [
        (5, ("completion_past_limit", "completion_too_small"), False),
        (10_000, ("completion_past_limit",), False),
        (10**18, ("completion_past_limit", "completion_too_large"), True),
        (None, ("completion_past_limit", "completion_missing"), False),
    ],
    ids=["told-less", "told-the-events", "told-more", "told-nothing"],
)
def test_a_stream_past_its_limit_is_charged_the_limit_whatever_it_tells(
    completion: Any, flaws: tuple[str, ...], lies: bool
) -> None:
    """max_tokens 8, and a backend that ignored it and streamed 10,000 events: the tenant
    asked for 8 and is charged 8, whatever the usage says (before, a usage of 5 was charged
    9,986 and one of 10**18 was charged 8). A count its events bear out is no lie."""
    usage, corrected = checked_usage(told(120, completion), EIGHT, events=10_000)
    assert corrected is not None
    assert (usage.completion_tokens, corrected.flaws, corrected.lies) == (8, flaws, lies)


def test_a_stream_within_its_limit_is_bounded_below_by_its_events_as_before() -> None:
    usage, corrected = checked_usage(told(120, 1), EIGHT, events=8 + 2 + FRAMING_EVENTS)
    assert (usage.completion_tokens, corrected) == (
        8,
        Corrected(("completion_too_small",), told(120, 1)),
    )
    assert not corrected.lies


# -- the model's context, where the pool knows it


def test_an_unnamed_limit_is_bounded_by_the_models_context_where_known() -> None:
    """No output limit named: a model of 8,192 tokens of context cannot have generated
    60,000 (before, anything up to PROMPT_FLOOR was believed)."""
    known = request()._replace(model_context=8_192)
    assert check(told(100, 8_000), known) == (Usage(100, 8_000, known=True), ())
    assert check(told(100, 60_000), known) == (
        Usage(100, 8_192, known=True),
        ("completion_too_large",),
    )
    # where the context is unknown, PROMPT_FLOOR stands
    assert check(told(100, 60_000), request()) == (Usage(100, 60_000, known=True), ())
    assert check(told(100, PROMPT_FLOOR + 1), request())[0].completion_tokens == PROMPT_FLOOR


def test_a_model_context_longer_than_the_floor_widens_the_prompts_bound() -> None:
    """A million-token model: a prompt of 500,000 tokens is no lie, even if the estimate
    (100) is far off; PROMPT_FLOOR still bounds where the context is shorter or unknown."""
    long = request(max_tokens=50)._replace(model_context=1_000_000)
    assert check(told(500_000, 10), long) == (Usage(500_000, 10, known=True), ())
    assert check(told(500_000, 10), NAMED)[1] == ("prompt_too_large",)
    short = request(max_tokens=50)._replace(model_context=8_192)
    assert check(told(20_000, 10), short) == (Usage(20_000, 10, known=True), ())


# -- which corrections are lies


@pytest.mark.parametrize(
    ("reported", "lies"),
    [
        (told(120, 10**18), True),
        (told(120, -5), True),
        (told(120, "lots"), True),
        (told(-1, 10), True),
        (told(10**18, 10), True),
        ([5], True),
        ("lots", True),
        ({}, False),  # told nothing: some servers never count
        (told(120, 0), False),
        (told(0, 10), False),
        ({"prompt_tokens": 120}, False),
        (told(120, None), False),
    ],
)
def test_only_a_usage_that_cannot_be_true_is_a_lie(reported: Any, lies: bool) -> None:
    """A lie counts against the backend's health: only a count that cannot be true is one,
    never one left out or told as nothing."""
    _, corrected = checked_usage(reported, NAMED, events=None)
    assert corrected is not None
    assert corrected.lies is lies


# -- counted always, logged once a minute per target


def test_a_correction_is_counted_every_time_and_logged_once_a_minute_per_target(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    corrections = Counter("corrections", "", ["target", "reason"], registry=registry)
    not_kept = Counter("not_kept", "", ["target"], registry=registry)
    clock = ManualClock()
    flaws = AnswerFlaws(corrections=corrections, not_kept=not_kept, clock=clock)
    lie = Corrected(("completion_too_large",), told(1, 10**18))

    def logged() -> list[str]:
        return [r.getMessage().split(" ")[0] for r in caplog.records if r.name == "spillgate.usage"]

    with caplog.at_level(logging.WARNING, logger="spillgate.usage"):
        for _ in range(5):
            flaws.corrected("big-0", lie)
        flaws.corrected("big-1", lie)
        clock.advance(LOG_EVERY_S - 0.5)
        flaws.corrected("big-0", lie)
        assert logged() == ["big-0", "big-1"]
        clock.advance(0.5)
        flaws.corrected("big-0", lie)
        flaws.corrected("big-1", lie)
    assert logged() == ["big-0", "big-1", "big-0", "big-1"]
    count = registry.get_sample_value(
        "corrections_total", {"target": "big-0", "reason": "completion_too_large"}
    )
    assert count == 7
