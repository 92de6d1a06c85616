"""Prompt token ids: as many as the prompt costs, and the same text always gives the same ids."""

import subprocess
import sys

import orjson

from loadtest.sim.protocol import Limits, parse_request
from loadtest.sim.tokens import (
    BOS,
    chat_prompt_ids,
    chat_prompt_tokens,
    completion_prompt_ids,
    completion_prompt_tokens,
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
