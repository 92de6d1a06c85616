"""An answer's usage checked against what its request could have used."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.answer import Usage
from gateway.upstream.usage import FRAMING_EVENTS, PROMPT_FLOOR, Corrected, checked_usage
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
    assert check(told(9, 5), embeddings)[1] == ("completion_too_large",)


def test_the_responses_api_names_are_read() -> None:
    usage, flaws = check({"input_tokens": 10, "output_tokens": -1})
    assert (usage, flaws) == (Usage(10, 100, known=True), ("completion_negative",))


def test_a_usage_that_is_no_object_is_corrected_whole() -> None:
    assert check([1, 2]) == (
        Usage(100, 100, known=True),
        ("usage_not_an_object", "prompt_missing", "completion_missing"),
    )
