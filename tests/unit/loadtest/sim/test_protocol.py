"""Request parsing: honest token counts, vLLM's length errors, default answer length."""

import orjson
import pytest

from loadtest.sim.protocol import Limits, SimRequestError, out_of_vocabulary, parse_request
from loadtest.sim.tokens import FillerText, chat_prompt_tokens, completion_prompt_tokens
from loadtest.sim.wire import Kind

LIMITS = Limits(model="tiny", max_model_len=2048, default_max_tokens=256)


def chat(**body: object) -> bytes:
    return orjson.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * 40}]} | body
    )


def test_chat_prompt_tokens_count_content_and_template() -> None:
    messages = [{"role": "system", "content": "a" * 9}, {"role": "user", "content": "Hello!"}]
    # ceil(9/4)=3 and ceil(6/4)=2 content, 4 per message, 3 for the assistant turn
    assert chat_prompt_tokens(messages) == 3 + 2 + 2 * 4 + 3
    parts = [{"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image"}]}]
    assert chat_prompt_tokens(parts) == 1 + 4 + 3


def test_completion_prompt_tokens_are_text_plus_bos_or_the_token_ids() -> None:
    assert completion_prompt_tokens("abcde") == 2 + 1
    assert completion_prompt_tokens([5, 6, 7]) == 3


def test_requested_max_tokens_is_generated_and_finishes_on_length() -> None:
    req = parse_request(Kind.CHAT, chat(max_tokens=7, stream=True), LIMITS)
    assert (req.prompt_tokens, req.max_tokens, req.finish_reason) == (10 + 4 + 3, 7, "length")
    assert req.stream and not req.include_usage and req.model == "tiny"


def test_max_completion_tokens_and_include_usage_are_read() -> None:
    body = chat(max_completion_tokens=3, stream_options={"include_usage": True})
    req = parse_request(Kind.CHAT, body, LIMITS)
    assert req.max_tokens == 3 and req.include_usage and not req.stream


def test_without_max_tokens_the_answer_stops_by_itself_at_the_default_length() -> None:
    req = parse_request(Kind.CHAT, chat(), LIMITS)
    assert (req.max_tokens, req.finish_reason) == (256, "stop")


def test_without_max_tokens_the_answer_is_cut_at_the_context_length() -> None:
    limits = Limits(model="tiny", max_model_len=100, default_max_tokens=256)
    req = parse_request(Kind.CHAT, chat(), limits)
    assert (req.max_tokens, req.finish_reason) == (100 - 17, "length")


def test_max_tokens_over_the_context_is_vllms_400() -> None:
    with pytest.raises(SimRequestError) as err:
        parse_request(Kind.CHAT, chat(max_tokens=4000), LIMITS)
    assert err.value.status == 400 and err.value.param == "max_tokens"
    assert err.value.message.startswith("max_tokens=4000 cannot be greater than max_model_len=2048")
    assert err.value.error_type == "BadRequestError"


def test_prompt_plus_max_tokens_over_the_context_is_a_400() -> None:
    with pytest.raises(SimRequestError) as err:
        parse_request(Kind.CHAT, chat(max_tokens=2040), LIMITS)
    assert err.value.status == 400 and "(2040 > 2048 - 17)" in err.value.message


def test_prompt_alone_over_the_context_is_a_400() -> None:
    with pytest.raises(SimRequestError) as err:
        parse_request(Kind.COMPLETION, orjson.dumps({"prompt": "y" * 9000}), LIMITS)
    assert err.value.status == 400 and "2251 input tokens" in err.value.message


def test_unknown_model_is_vllms_404() -> None:
    with pytest.raises(SimRequestError) as err:
        parse_request(Kind.CHAT, chat(model="nope"), LIMITS)
    assert err.value.status == 404 and err.value.error_type == "NotFoundError"
    assert err.value.message == "The model `nope` does not exist. Valid aliases: tiny."


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1, 2]",
        orjson.dumps({"messages": []}),
        orjson.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        orjson.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}),
    ],
)
def test_malformed_chat_requests_are_400(raw: bytes) -> None:
    with pytest.raises(SimRequestError) as err:
        parse_request(Kind.CHAT, raw, LIMITS)
    assert err.value.status == 400


def test_completion_accepts_one_prompt_only() -> None:
    assert (
        parse_request(Kind.COMPLETION, orjson.dumps({"prompt": ["abcd"]}), LIMITS).prompt_tokens
        == 2
    )
    with pytest.raises(SimRequestError):
        parse_request(Kind.COMPLETION, orjson.dumps({"prompt": ["a", "b"]}), LIMITS)


def test_filler_is_one_word_per_token_across_period_boundaries() -> None:
    filler = FillerText(period_tokens=50)
    start, stop = filler.period - 3, 3 * filler.period + 5
    words = filler.word_bytes(start, stop)
    assert len(words) == stop - start
    assert words[3] == filler.word_bytes(0, 1)[0]  # token `period` is token 0 again
    assert filler.text(start, stop) == b"".join(words).decode()
    assert all(w.startswith(b" ") and w.count(b" ") == 1 for w in words)
    assert filler.text(0, 0) == "" and filler.word_bytes(5, 5) == []


def test_n_choices_are_read() -> None:
    assert parse_request(Kind.CHAT, chat(max_tokens=3, n=4), LIMITS).n == 4
    assert parse_request(Kind.CHAT, chat(max_tokens=3), LIMITS).n == 1


def test_prompt_ids_beyond_the_vocabulary_are_refused_as_vllm_words_it() -> None:
    assert out_of_vocabulary(b'{"prompt": [5, 31000, 4095]}', 4096) == (
        "Token id 31000 is out of vocabulary"
    )
    assert out_of_vocabulary(b'{"prompt": [[4096]]}', 4096) == "Token id 4096 is out of vocabulary"
    assert out_of_vocabulary(b'{"prompt": [0, 4095]}', 4096) is None
    assert out_of_vocabulary(b'{"prompt": "text has no ids"}', 4096) is None
    assert out_of_vocabulary(b'{"messages": [{"role": "user", "content": "hi"}]}', 4096) is None
