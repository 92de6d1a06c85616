"""The simulated replica through the official `openai` client: shapes, usage, errors."""

from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtest.sim.tokens import chat_prompt_tokens
from tests.support.harness import ServerThread
from tests.support.sims import openai_client, quick_sim

MODEL = "sim-8b"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Count the tokens in this sentence, please."},
]


@pytest.fixture(scope="module")
def sim() -> Iterator[ServerThread]:
    with quick_sim(MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(sim: ServerThread) -> Iterator[openai.OpenAI]:
    with openai_client(sim) as c:
        yield c


def test_non_streamed_chat_has_honest_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    choice = reply.choices[0]
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert len((choice.message.content or "").split()) == 12
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == chat_prompt_tokens(MESSAGES)
    assert (reply.usage.completion_tokens, reply.usage.total_tokens) == (
        12,
        reply.usage.prompt_tokens + 12,
    )


def test_streamed_chat_with_include_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) == 20
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == chat_prompt_tokens(MESSAGES)
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True)
    )
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_without_max_tokens_the_answer_stops_at_the_default_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 256


def test_legacy_completions_stream_and_non_stream(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert reply.object == "text_completion" and len(reply.choices[0].text.split()) == 6
    assert reply.usage is not None and reply.usage.prompt_tokens == 4 + 1
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 11


def test_models_lists_the_served_name_with_its_context(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (models.data[0].model_extra or {}).get("max_model_len") == 2048


def test_errors_are_vllms_and_the_openai_client_raises_them(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4000)
    assert too_long.value.status_code == 400
    assert too_long.value.body == {
        "message": "max_tokens=4000 cannot be greater than max_model_len=2048. Please request "
        "fewer output tokens. (parameter=max_tokens, value=4000)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=1)


def test_stream_is_sse_with_vllms_content_type(sim: ServerThread) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.Client(base_url=sim.url, timeout=10, verify=False) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            raw = response.read()
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert http.get("/health").status_code == 200
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2]) and len(events) == 1 + 3 + 2
