"""Deterministic token counts and filler text for the simulated backends.

The tokenizer is an approximation, the same one everywhere in the simulator:

- text costs ceil(characters / 4) tokens (about right for English under BPE tokenizers);
- a chat message adds 4 tokens of template (role header and separators), and the chat
  prompt adds 3 more for the assistant turn it opens;
- a legacy completion prompt adds 1 token (BOS); a prompt given as token ids costs its length.

Prompts also become token ids, as many as they cost, so that the prefix cache sees the same
blocks for the same text: each 4 characters of text are one id (the same characters, the
same id, in every process), and template tokens are fixed ids of their own.

Generated text is one filler word per token, each with its leading space, like a BPE stream.
The model reads its own words back the same way, one token a word, so a prompt that holds the
start of an answer continues it (vLLM's way of going on with an answer cut short):

- a chat request with `continue_final_message` ends inside its last message, the
  assistant's: no generation prompt, and that message's framing is the assistant turn's
  own, so the prompt costs what the answer's request cost plus the answer so far;
- a completion prompt that ends with the filler's first words (the longest such end)
  costs one token for each of them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import StrEnum
from itertools import accumulate

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
TOKENS_PER_CHAT_PROMPT = 3
TOKENS_PER_COMPLETION_PROMPT = 1

# fmt: off
_WORDS = (
    "the", "fleet", "holds", "every", "token", "in", "flight", "while", "the", "cache",
    "fills", "and", "drains", "in", "steady", "batches", "so", "each", "request", "waits",
    "its", "turn", "then", "streams", "its", "answer", "back", "word", "by", "word",
    "until", "the", "budget", "is", "spent", "and", "the", "next", "sequence", "takes",
    "its", "place",
)
# fmt: on


# template tokens: small negative ids, which a text id (a 64-bit hash) all but never is
BOS, MESSAGE_START, MESSAGE_END, SEPARATOR = -1, -2, -3, -4
ROLE_IDS = {"system": -10, "user": -11, "assistant": -12, "tool": -13, "developer": -14}
OTHER_ROLE = -19


# The filler's words repeat with this period: token i is _WORDS[i % len(_WORDS)].
_CYCLE = "".join(" " + w for w in _WORDS)
# characters of the cycle's first n words -> n, for n in 1..len(_WORDS)
_CYCLE_WORDS = {chars: n for n, chars in enumerate(accumulate(len(w) + 1 for w in _WORDS), start=1)}
# one id a filler word, the same in every process (a tuple of ints hashes alike everywhere)
_CYCLE_IDS = [hash((-100, *map(ord, w))) for w in _WORDS]


class PromptEnd(StrEnum):
    """Where a chat prompt stops: with the assistant's turn opened (vLLM's default), after
    the last message (`add_generation_prompt: false`), or inside the last message, the
    assistant's, which the answer goes on with (`continue_final_message: true`)."""

    NEW_TURN = "new_turn"
    LAST_MESSAGE = "last_message"
    CONTINUED = "continued"


def filler_words(text: str) -> int | None:
    """n where `text` is the filler's first n words (0 for no text), else None."""
    words, chars = filler_end(text)
    return words if chars == len(text) else None


def filler_end(text: str) -> tuple[int, int]:
    """The most words n such that `text` ends with the filler's first n words, and their
    characters; (0, 0) when it ends with none.

    Such an end is whole cycles of the filler's words after the cycle's first
    n % len(_WORDS) words (or all of them): each of those short ends is tried, then
    stretched back a whole cycle at a time while the text before it is one. Linear in the
    text.
    """
    size, best = len(_CYCLE), (0, 0)
    for chars, n in _CYCLE_WORDS.items():
        if not text.endswith(_CYCLE[:chars]):
            continue
        start = len(text) - chars
        while start >= size and text.startswith(_CYCLE, start - size):
            start -= size
            n += len(_WORDS)
        best = max(best, (n, len(text) - start))
    return best


def _words_ids(n: int) -> list[int]:
    """The ids of the filler's first n words: one each."""
    whole, rest = divmod(n, len(_WORDS))
    return _CYCLE_IDS * whole + _CYCLE_IDS[:rest]


def text_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def text_ids(text: str) -> list[int]:
    """One id per 4 characters: the hash of their code points.

    Encoding to UTF-32 and unpacking in one call keeps a 4,000-token prompt under a
    millisecond; tuple hashes of ints are the same in every process.
    """
    text += "\0" * (-len(text) % CHARS_PER_TOKEN)
    data = text.encode("utf-32-le")
    halves = struct.unpack(f"<{len(data) // 8}Q", data)
    return list(map(hash, zip(halves[::2], halves[1::2], strict=True)))


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    return 0


def _continued(
    messages: Sequence[object], end: PromptEnd
) -> tuple[Sequence[object], dict[str, object] | None]:
    """The messages framed whole, and the one the prompt ends inside (None: no such one)."""
    if end is PromptEnd.CONTINUED and messages and isinstance(messages[-1], dict):
        return messages[:-1], messages[-1]
    return messages, None


def chat_prompt_tokens(messages: Sequence[object], *, end: PromptEnd = PromptEnd.NEW_TURN) -> int:
    """Prompt tokens of a chat request: content, per-message template, assistant priming.

    Continued (`PromptEnd.CONTINUED`), the last message costs its content, one token a word
    when it is the filler's start, and the assistant turn's framing in place of its own.
    """
    before, last = _continued(messages, end)
    total = 0 if end is PromptEnd.LAST_MESSAGE else TOKENS_PER_CHAT_PROMPT
    for message in before:
        chars = _content_chars(message.get("content")) if isinstance(message, dict) else 0
        total += -(-chars // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE
    if last is not None:
        text = _content_text(last.get("content"))
        words = filler_words(text)
        total += text_tokens(text) if words is None else words
    return total


def chat_prompt_ids(
    messages: Sequence[object], *, end: PromptEnd = PromptEnd.NEW_TURN
) -> list[int]:
    """The ids of `chat_prompt_tokens`: each message framed by its role, then the assistant
    turn, so a shared system prompt leads every prompt with the same ids. Continued, the
    last message's ids follow the assistant turn's opening: the answer's own prompt leads."""
    before, last = _continued(messages, end)
    ids: list[int] = []
    for message in before:
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        role_id = ROLE_IDS.get(role, OTHER_ROLE) if isinstance(role, str) else OTHER_ROLE
        ids += (MESSAGE_START, role_id, SEPARATOR)
        ids += text_ids(_content_text(content))
        ids.append(MESSAGE_END)
    if end is not PromptEnd.LAST_MESSAGE:
        ids += (MESSAGE_START, ROLE_IDS["assistant"], SEPARATOR)
    if last is not None:
        text = _content_text(last.get("content"))
        words = filler_words(text)
        ids += text_ids(text) if words is None else _words_ids(words)
    return ids


def chat_answer_start(messages: Sequence[object]) -> int:
    """Where an answer that continues the last message starts in the filler: after its
    words when it is the filler's start, else at 0."""
    last = messages[-1] if messages else None
    content = last.get("content") if isinstance(last, dict) else None
    return filler_words(_content_text(content)) or 0


def completion_prompt(
    prompt: str | Sequence[int], *, token_ids: bool
) -> tuple[int, list[int] | None, int]:
    """A completion prompt read once: its tokens (BOS, the text, and a word a token for the
    filler words it ends with; token ids as given), those ids when `token_ids`, and where
    its answer starts in the filler (after those words; 0 for a prompt of ids)."""
    if not isinstance(prompt, str):
        return len(prompt), list(prompt) if token_ids else None, 0
    words, chars = filler_end(prompt)
    text = prompt[: len(prompt) - chars]
    if token_ids:
        ids = [BOS, *text_ids(text), *_words_ids(words)]
        return len(ids), ids, words
    return text_tokens(text) + words + TOKENS_PER_COMPLETION_PROMPT, None, words


def completion_prompt_tokens(prompt: str | Sequence[int]) -> int:
    return completion_prompt(prompt, token_ids=False)[0]


def completion_prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    ids = completion_prompt(prompt, token_ids=True)[1]
    assert ids is not None
    return ids


def completion_answer_start(prompt: str | Sequence[int]) -> int:
    return completion_prompt(prompt, token_ids=False)[2]


class FillerText:
    """Filler where token i is always the same word, served as slices of two precomputed periods.

    Any range of up to `period` tokens is a single slice; longer ones are a few slices.
    """

    def __init__(self, *, period_tokens: int = 4096) -> None:
        cycles = -(-period_tokens // len(_WORDS))
        self.period = cycles * len(_WORDS)
        words = [" " + w for w in _WORDS] * (2 * cycles)
        self._bytes = [w.encode() for w in words]
        offsets = [0]
        for w in words:
            offsets.append(offsets[-1] + len(w))
        self._offsets = offsets
        self._text = "".join(words)

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        pieces = []
        while start < stop:
            base = start % self.period
            take = min(stop - start, 2 * self.period - base)
            pieces.append((base, base + take))
            start += take
        return pieces

    def word_bytes(self, start: int, stop: int) -> list[bytes]:
        """The words of tokens [start, stop), encoded."""
        pieces = self._pieces(start, stop)
        if len(pieces) == 1:
            lo, hi = pieces[0]
            return self._bytes[lo:hi]
        return [b for lo, hi in pieces for b in self._bytes[lo:hi]]

    def text(self, start: int, stop: int) -> str:
        """The text of tokens [start, stop)."""
        offsets = self._offsets
        return "".join(
            self._text[offsets[lo] : offsets[hi]] for lo, hi in self._pieces(start, stop)
        )
