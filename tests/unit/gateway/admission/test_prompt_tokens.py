"""A prompt tokenized as the engine does: piece by piece between special tokens, the pieces
cached, and new text past OFF_LOOP_CHARS tokenized in a worker thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gateway.admission.prompt_tokens import OFF_LOOP_CHARS, PromptTokenizer, prompt_token_ids
from loadtest.sim.tokenizer_files import write

SYSTEM = "You are a helpful assistant for tenant seven. " * 40  # well past OFF_LOOP_CHARS


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("tokenizer"))


def chat(user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


class Threads:
    """The threads that called encode_batch, the tokenizer's GIL-free path."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.seen: list[int] = []
        encode_batch = tokenizer.encode_batch

        def spy(pieces):  # type: ignore[no-untyped-def]
            self.seen.append(threading.get_ident())
            return encode_batch(pieces)

        tokenizer.encode_batch = spy  # type: ignore[method-assign]


def test_the_pieces_joined_are_the_whole_texts_ids(directory: Path) -> None:
    tokenizer = PromptTokenizer(directory)
    body = chat("What is a KV cache? " * 3)
    text = tokenizer.render(body)
    assert text is not None and text.startswith("<s><|system|>\n")
    whole = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(
        text, add_special_tokens=False
    )
    assert tokenizer.chat(body) == whole.ids
    assert asyncio.run(prompt_token_ids(body, tokenizer)) == tuple(whole.ids)


def test_new_long_text_is_tokenized_off_the_loop_and_then_cached(directory: Path) -> None:
    assert len(SYSTEM) > OFF_LOOP_CHARS
    tokenizer = PromptTokenizer(directory)
    threads = Threads(tokenizer)
    expected = PromptTokenizer(directory).chat(chat("first question"))

    async def two() -> tuple[tuple[int, ...], tuple[int, ...]]:
        first = await prompt_token_ids(chat("first question"), tokenizer)
        second = await prompt_token_ids(chat("second question"), tokenizer)
        return first, second

    first, second = asyncio.run(two())
    assert first == tuple(expected or ())
    assert len(threads.seen) == 1 and threads.seen[0] != threading.get_ident()
    # the second request's system prompt came from the cache; its user message is short
    assert second == tuple(PromptTokenizer(directory).chat(chat("second question")) or ())
    assert len(threads.seen) == 1


def test_a_short_prompt_stays_on_the_loop(directory: Path) -> None:
    tokenizer = PromptTokenizer(directory)
    threads = Threads(tokenizer)
    body = {"messages": [{"role": "user", "content": "hello"}]}
    ids = asyncio.run(prompt_token_ids(body, tokenizer))
    assert ids == tuple(tokenizer.chat(body) or ())
    assert threads.seen == []


def test_a_completion_prompt_keeps_its_special_tokens_and_ids_pass_through(
    directory: Path,
) -> None:
    tokenizer = PromptTokenizer(directory)
    whole = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(SYSTEM)
    assert asyncio.run(prompt_token_ids({"prompt": SYSTEM}, tokenizer)) == tuple(whole.ids)
    assert asyncio.run(prompt_token_ids({"prompt": [5, 6, 7]}, tokenizer)) == (5, 6, 7)
    assert asyncio.run(prompt_token_ids({"prompt": ["a", "b"]}, tokenizer)) == ()
    assert asyncio.run(prompt_token_ids({"prompt": "x"}, None)) == ()
