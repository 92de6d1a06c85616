"""Continuing a cut stream: which requests can be continued, what the client got before the
cut, the continuation's request, and its events rewritten as the client's stream."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.resume import (
    ContinuationLeg,
    Partial,
    continued,
    read_partial,
    refusal,
)
from tests.support.upstream import chat_request


def request(endpoint: Endpoint = Endpoint.CHAT, **body: Any) -> InferenceRequest:
    """A streamed request of `endpoint` (4 prompt tokens, 40 reserved for output) whose body
    holds `body` too."""
    asked = chat_request(stream=True, output_reserve=40)
    if endpoint is not Endpoint.CHAT:
        asked = asked._replace(
            endpoint=endpoint, body={"model": "big", "stream": True, "prompt": "Once upon a time"}
        )
    return asked._replace(
        body={**asked.body, **body},
        max_output_tokens=body.get("max_completion_tokens", body.get("max_tokens", 256)),
        n=body.get("n", 1),
    )


def chunk(delta: dict[str, Any] | None = None, *, text: str | None = None, **choice: Any) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-a", "created": 17, "model": "big"}
    if text is not None:
        body["choices"] = [{"index": 0, "text": text, **choice}]
    else:
        body["choices"] = [{"index": 0, "delta": delta or {}, **choice}]
    return b"data: " + orjson.dumps(body) + b"\n\n"


@pytest.mark.parametrize(
    ("endpoint", "body", "why"),
    [
        (Endpoint.CHAT, {}, None),
        (Endpoint.CHAT, {"n": 2}, "choices"),
        (Endpoint.CHAT, {"logprobs": True}, "logprobs"),
        (Endpoint.CHAT, {"logprobs": False}, None),
        (Endpoint.CHAT, {"response_format": {"type": "json_object"}}, "structured_output"),
        (Endpoint.CHAT, {"response_format": {"type": "text"}}, None),
        (Endpoint.CHAT, {"guided_regex": "a+"}, "structured_output"),
        (Endpoint.COMPLETIONS, {}, None),
        (Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (Endpoint.COMPLETIONS, {"echo": True}, "echo"),
        (Endpoint.COMPLETIONS, {"logprobs": 2}, "logprobs"),
        (Endpoint.COMPLETIONS, {"best_of": 3}, "choices"),
        (Endpoint.COMPLETIONS, {"suffix": "end"}, "suffix"),
        (Endpoint.EMBEDDINGS, {}, "endpoint"),
    ],
)
def test_only_what_can_be_continued_faithfully_is(
    endpoint: Endpoint, body: dict[str, Any], why: str | None
) -> None:
    assert refusal(request(endpoint, **body)) == why


def test_the_partial_is_the_text_the_client_got_in_order() -> None:
    kept = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": " the"}) + chunk({"content": " fleet"}),
        chunk({"content": " holds"}),
    ]
    partial = read_partial(kept, Endpoint.CHAT)
    assert partial == Partial(" the fleet holds", 3, False, None, b'"chatcmpl-a"', b"17")


def test_a_finishing_event_or_a_tool_call_is_seen_in_the_partial() -> None:
    done = read_partial([chunk({"content": " x"}, finish_reason="length")], Endpoint.CHAT)
    assert done.finished
    call = {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]}
    assert read_partial([chunk(call)], Endpoint.CHAT).refusal == "tool_call"
    thought = read_partial([chunk({"reasoning_content": "hmm"})], Endpoint.CHAT)
    assert thought.refusal == "reasoning"


def test_a_completions_partial_reads_the_text_field() -> None:
    kept = [chunk(text=" a"), chunk(text=" b") + b"data: [DONE]\n\n"]
    assert read_partial(kept, Endpoint.COMPLETIONS).text == " a b"


def test_a_chat_continuation_opens_the_assistant_turn_with_the_text_so_far() -> None:
    original = request(max_tokens=100)
    partial = Partial(" the fleet", 2, False, None, None, None)
    follow = continued(original, partial)
    assert follow is not None
    assert follow.body["messages"][-1] == {"role": "assistant", "content": " the fleet"}
    assert follow.body["messages"][:-1] == original.body["messages"]
    assert follow.body["continue_final_message"] is True
    assert follow.body["add_generation_prompt"] is False
    assert follow.body["max_tokens"] == 98 and follow.max_output_tokens == 98
    assert follow.prompt_tokens == 6 and follow.output_reserve == 38
    assert original.body["messages"][-1]["role"] == "user"  # the original is untouched


def test_a_request_that_continued_its_own_assistant_turn_gets_it_extended() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure,"}]
    original = request(messages=messages, continue_final_message=True)
    follow = continued(original, Partial(" here", 1, False, None, None, None))
    assert follow is not None
    assert follow.body["messages"] == [messages[0], {"role": "assistant", "content": "Sure, here"}]


def test_a_completion_continuation_appends_the_text_to_the_prompt() -> None:
    original = request(Endpoint.COMPLETIONS, max_completion_tokens=50)
    follow = continued(original, Partial(" there was", 2, False, None, None, None))
    assert follow is not None
    assert follow.body["prompt"] == "Once upon a time there was"
    assert follow.body["max_completion_tokens"] == 48 and "max_tokens" not in follow.body


def test_no_named_limit_stays_unnamed_and_a_spent_one_ends_it() -> None:
    follow = continued(request(), Partial(" a", 1, False, None, None, None))
    assert follow is not None and "max_tokens" not in follow.body
    assert continued(request(max_tokens=3), Partial(" a b c", 3, False, None, None, None)) is None


def test_the_continuation_leg_drops_its_role_event_and_takes_the_first_legs_id() -> None:
    leg = ContinuationLeg(Partial(" a", 1, False, None, b'"chatcmpl-a"', b"17"))
    own = b'data: {"id":"chatcmpl-b","created":99,"choices":[{"index":0,'
    opening = own + b'"delta":{"role":"assistant","content":""}}]}\n\n'
    word = own + b'"delta":{"content":" b"}}]}\n\n'
    out = leg.rewrite(opening + word)
    assert out == word.replace(b"chatcmpl-b", b"chatcmpl-a").replace(b"99", b"17")
    later = leg.rewrite(word)  # past its opening, a word that carries a role stays
    assert later == out
    assert leg.rewrite(opening) == opening.replace(b"chatcmpl-b", b"chatcmpl-a").replace(
        b"99", b"17"
    )
