"""Prompt token ids: as many as the prompt costs, and the same text always gives the same ids;
the simulator's own words read back one token a word."""

import subprocess
import sys
import time

import orjson

from loadtest.sim.protocol import Limits, parse_request
from loadtest.sim.tokens import (
    BOS,
    FillerText,
    PromptEnd,
    chat_answer_start,
    chat_prompt_ids,
    chat_prompt_tokens,
    completion_answer_start,
    completion_prompt_ids,
    completion_prompt_tokens,
    filler_end,
    filler_words,
    text_ids,
)
from loadtest.sim.wire import Kind

SYSTEM = {"role": "system", "content": "You answer in one word. " * 10}


def test_chat_ids_are_as_many_as_the_prompt_costs() -> None:
    parts = [{"type": "text", "text": "abc"}, {"type": "text", "text": "defgh"}]
    messages = [SYSTEM, {"role": "user", "content": parts}, {"role": "bot", "content": "x"}]
    assert len(chat_prompt_ids(messages)) == chat_prompt_tokens(messages) == 3 + 64 + 6 + 5
    assert chat_prompt_ids([{"role": "user", "content": "abcdefgh"}])[3:5] == text_ids("abcdefgh")


def test_the_same_system_prompt_leads_two_chats_with_the_same_ids() -> None:
    one = chat_prompt_ids([SYSTEM, {"role": "user", "content": "What is KV cache?"}])
    two = chat_prompt_ids([SYSTEM, {"role": "user", "content": "Why batch requests?"}])
    shared = 4 + 60  # the system message, framed
    assert one[:shared] == two[:shared] and one[shared:] != two[shared:]


def test_the_role_is_part_of_the_ids() -> None:
    as_user = chat_prompt_ids([{"role": "user", "content": "same words"}])
    as_system = chat_prompt_ids([{"role": "system", "content": "same words"}])
    assert as_user != as_system and as_user[2:] == as_system[2:]


def test_text_ids_take_four_characters_each_and_differ_with_them() -> None:
    ids = text_ids("abcdabcdabce")
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2]
    assert len(text_ids("abcde")) == 2 and text_ids("") == []


def test_text_ids_are_the_same_in_another_process() -> None:
    code = "from loadtest.sim.tokens import text_ids; print(text_ids('shared system prompt'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(text_ids("shared system prompt"))


def test_completion_ids_are_bos_and_the_text_or_the_ids_given() -> None:
    assert completion_prompt_ids("hello") == [BOS, *text_ids("hello")]
    assert len(completion_prompt_ids("hello")) == completion_prompt_tokens("hello") == 3
    assert completion_prompt_ids([5, 6, 7]) == [5, 6, 7]


def test_parsing_gives_ids_only_when_asked() -> None:
    limits = Limits(model=None, max_model_len=2048, default_max_tokens=16)
    raw = orjson.dumps({"messages": [SYSTEM]})
    plain = parse_request(Kind.CHAT, raw, limits)
    with_ids = parse_request(Kind.CHAT, raw, limits, token_ids=True)
    assert plain.prompt_token_ids is None and plain.prompt_tokens == 67
    assert with_ids.prompt_token_ids == chat_prompt_ids([SYSTEM]) and with_ids.prompt_tokens == 67


def test_the_filler_is_read_back_one_token_a_word() -> None:
    filler = FillerText()
    for n in (0, 1, 2, 41, 42, 43, 500, 4200):
        assert filler_words(filler.text(0, n)) == n
    assert filler_words(filler.text(1, 5)) is None  # not the filler's start
    assert filler_words(filler.text(0, 5) + " ") is None
    assert filler_words("the fleet") is None  # each word has its leading space


def test_a_prompt_ending_with_the_filler_s_start_ends_with_its_longest() -> None:
    filler = FillerText()
    assert filler_end("Once upon a time") == (0, 0)
    for n in (1, 9, 41, 42, 43, 85, 3000):
        text = filler.text(0, n)
        assert filler_end("Once upon a time" + text) == (n, len(text))
        # " the" is word 0, 8, 31 and 36: the longest start is found, not the nearest
        assert filler_end(filler.text(0, 9) + text) == (n, len(text))
    assert filler_end(filler.text(0, 42) + filler.text(0, 42)) == (84, 2 * len(filler.text(0, 42)))


def test_reading_the_filler_back_is_linear_in_the_prompt() -> None:
    prompts = [" the" * 50_000, FillerText().text(0, 41) * 2_000, "x" * 200_000]
    started = time.perf_counter()
    for prompt in prompts:
        filler_end(prompt)
    assert time.perf_counter() - started < 0.5


def test_a_continued_chat_costs_its_answer_s_prompt_and_a_token_a_word() -> None:
    filler = FillerText()
    asked = [SYSTEM, {"role": "user", "content": "Count the tokens, please."}]
    for n in (0, 1, 60):
        continued = [*asked, {"role": "assistant", "content": filler.text(0, n)}]
        tokens = chat_prompt_tokens(continued, end=PromptEnd.CONTINUED)
        ids = chat_prompt_ids(continued, end=PromptEnd.CONTINUED)
        assert tokens == len(ids) == chat_prompt_tokens(asked) + n
        assert ids[: chat_prompt_tokens(asked)] == chat_prompt_ids(asked)  # its prefix cached
        assert chat_answer_start(continued) == n
    other = [*asked, {"role": "assistant", "content": "Twelve"}]
    assert chat_prompt_tokens(other, end=PromptEnd.CONTINUED) == chat_prompt_tokens(asked) + 2
    assert chat_answer_start(other) == 0
    assert chat_prompt_tokens(asked, end=PromptEnd.LAST_MESSAGE) == chat_prompt_tokens(asked) - 3


def test_a_completion_prompt_ending_with_the_answer_so_far_costs_a_token_a_word() -> None:
    filler = FillerText()
    for prompt in ("Once upon a time", "The fleet"):
        for n in (1, 12, 100):
            continued = prompt + filler.text(0, n)
            assert completion_prompt_tokens(continued) == completion_prompt_tokens(prompt) + n
            assert len(completion_prompt_ids(continued)) == completion_prompt_tokens(continued)
            asked = completion_prompt_ids(prompt)
            assert completion_prompt_ids(continued)[: len(asked)] == asked
            assert completion_answer_start(continued) == n
    assert completion_answer_start([1, 2, 3]) == 0
