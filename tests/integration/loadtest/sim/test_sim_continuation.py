"""The simulated replica continues an answer as a deterministic model would, in vLLM's way:
a chat whose last message, the assistant's, holds the answer so far
(`continue_final_message`), or a completion prompt that ends with it. Through the official
`openai` client: the text goes on from the last word given, usage counts the words given as
prompt, and the answer ends where and as the uncut one would have."""

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.admission.fleet.metrics_text import samples
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.lengths import AnswerLengths
from loadtest.sim.tokens import FillerText, chat_prompt_tokens, completion_prompt_tokens
from tests.support.harness import ServerThread
from tests.support.metrics import metrics_text
from tests.support.sims import openai_client, quick_sim

MODEL = "sim-8b"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the fleet."},
]
PROMPT = "Once upon a time"
MAX_TOKENS = 40
GIVEN = 13  # words of the answer the client saw before its stream was cut
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
FILLER = FillerText()


@pytest.fixture(scope="module")
def sim() -> Iterator[ServerThread]:
    with quick_sim(MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(sim: ServerThread) -> Iterator[openai.OpenAI]:
    with openai_client(sim) as c:
        yield c


def continued(given: int = GIVEN) -> list[dict[str, str]]:
    return [*MESSAGES, {"role": "assistant", "content": FILLER.text(0, given)}]


def test_a_continued_chat_goes_on_from_the_last_word_given(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=continued(),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS - GIVEN,
        extra_body=CONTINUE,
    )
    choice = reply.choices[0]
    assert FILLER.text(0, GIVEN) + (choice.message.content or "") == FILLER.text(0, MAX_TOKENS)
    assert (choice.finish_reason, choice.message.role) == ("length", "assistant")
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == chat_prompt_tokens(MESSAGES) + GIVEN
    assert reply.usage.completion_tokens == MAX_TOKENS - GIVEN


def test_a_continued_chat_stream_opens_with_the_role_then_one_word_an_event(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=continued(),  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS - GIVEN,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=CONTINUE,
        )
    )
    # as vLLM: a role-only chunk first, even when the answer goes on an assistant message
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == (
        "assistant",
        "",
    )
    words = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert len(words) == MAX_TOKENS - GIVEN
    assert FILLER.text(0, GIVEN) + "".join(w or "" for w in words) == FILLER.text(0, MAX_TOKENS)
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        chat_prompt_tokens(MESSAGES) + GIVEN,
        MAX_TOKENS - GIVEN,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_prompt_ending_with_the_answer_so_far_goes_on(
    client: openai.OpenAI, stream: bool
) -> None:
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS - GIVEN}
    prompt = PROMPT + FILLER.text(0, GIVEN)
    if stream:
        chunks = list(
            client.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **asked
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        reply = client.completions.create(prompt=prompt, **asked)
        text, finish, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
    assert FILLER.text(0, GIVEN) + text == FILLER.text(0, MAX_TOKENS)
    assert finish == "length"
    assert usage is not None
    assert usage.prompt_tokens == completion_prompt_tokens(PROMPT) + GIVEN
    assert usage.completion_tokens == MAX_TOKENS - GIVEN


def test_an_assistant_message_not_of_the_filler_is_continued_from_the_first_word(
    client: openai.OpenAI,
) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Twelve ships"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
        extra_body=CONTINUE,
    )
    assert reply.choices[0].message.content == FILLER.text(0, 5)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == chat_prompt_tokens(MESSAGES) + 3  # 12 characters


def test_an_answer_that_ends_by_itself_ends_as_the_uncut_one_would() -> None:
    """Sampled lengths: a seeded answer continued from any word ends on the same word, with
    `stop`; one continued past its end stops at once; the cap still ends with `length`."""
    config = SimConfig(
        model=MODEL,
        kv_tokens=4096,
        speed=200.0,
        answer_lengths=AnswerLengths.GEOMETRIC,
        answer_mean_tokens=30,
    )
    body = {"model": MODEL, "max_tokens": 400, "seed": 1}  # an answer of 39 words
    with ServerThread(create_sim_app(config)) as sim, httpx.Client(base_url=sim.url) as http:
        whole = http.post("/v1/chat/completions", json={**body, "messages": MESSAGES}).json()
        ended = whole["usage"]["completion_tokens"]
        assert (whole["choices"][0]["finish_reason"], ended) == ("stop", 39)

        def rest(given: int, **extra: Any) -> dict[str, Any]:
            sent = {**body, "max_tokens": 400 - given, **CONTINUE, **extra}
            reply = http.post("/v1/chat/completions", json={**sent, "messages": continued(given)})
            answer: dict[str, Any] = reply.json()
            return answer

        for given in (1, ended // 2, ended - 1):
            answer = rest(given)
            text = FILLER.text(0, given) + answer["choices"][0]["message"]["content"]
            assert text == whole["choices"][0]["message"]["content"] == FILLER.text(0, ended)
            assert answer["choices"][0]["finish_reason"] == "stop"
            assert answer["usage"]["completion_tokens"] == ended - given
        past = rest(ended + 5)
        assert (past["usage"]["completion_tokens"], past["choices"][0]["finish_reason"]) == (
            1,
            "stop",
        )
        capped = rest(ended // 2, max_tokens=2)
        assert (capped["usage"]["completion_tokens"], capped["choices"][0]["finish_reason"]) == (
            2,
            "length",
        )


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        (
            {"continue_final_message": True},
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, "
            "and add_generation_prompt when you want to add a header that will prompt it to "
            "start a new assistant message instead.",
        ),
    ],
)
def test_continuing_with_a_generation_prompt_is_refused_in_vllms_words(
    client: openai.OpenAI, sent: dict[str, bool], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=continued(),  # type: ignore[arg-type]
            max_tokens=3,
            extra_body=sent,
        )
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


def test_continuing_a_message_not_the_assistants_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=3,
            extra_body=CONTINUE,
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["message"] == (
        "Cannot set `continue_final_message` to True when the last message is not from the "
        "assistant."
    )


def test_a_continuation_finds_its_answers_prompt_in_the_prefix_cache() -> None:
    asked = [{"role": "user", "content": "Go on. " * 57}]  # 100 + 4 + 3 tokens: 6 full blocks
    config = SimConfig(model=MODEL, kv_tokens=2048, speed=200.0)
    with ServerThread(create_sim_app(config)) as sim, httpx.Client(base_url=sim.url) as http:
        first = {"model": MODEL, "messages": asked, "max_tokens": 30}
        assert http.post("/v1/chat/completions", json=first).json()["usage"]["prompt_tokens"] == 107
        messages = [*asked, {"role": "assistant", "content": FILLER.text(0, 20)}]
        again = {**first, "messages": messages, "max_tokens": 10, **CONTINUE}
        assert http.post("/v1/chat/completions", json=again).json()["usage"]["prompt_tokens"] == 127
        hits = [
            s.value
            for s in samples(metrics_text(sim.url))
            if s.name == "vllm:prefix_cache_hits_total"
        ]
    assert hits == [96]


def test_tokenize_counts_a_prompt_as_the_engine_does(sim: ServerThread) -> None:
    """vLLM's `POST /tokenize`, which the gateway asks for a continued stream's prompt."""
    chat = httpx.post(f"{sim.url}/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert chat.status_code == 200
    assert chat.json()["count"] == chat_prompt_tokens(MESSAGES) == len(chat.json()["tokens"])
    text = httpx.post(f"{sim.url}/tokenize", json={"model": MODEL, "prompt": PROMPT})
    assert text.json()["count"] == completion_prompt_tokens(PROMPT)
    bad = httpx.post(f"{sim.url}/tokenize", json={"model": MODEL, "messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
