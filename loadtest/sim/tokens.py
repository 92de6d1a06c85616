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
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

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


def chat_prompt_tokens(messages: Sequence[object]) -> int:
    """Prompt tokens of a chat request: content, per-message template, assistant priming."""
    total = TOKENS_PER_CHAT_PROMPT
    for message in messages:
        chars = _content_chars(message.get("content")) if isinstance(message, dict) else 0
        total += -(-chars // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE
    return total


def chat_prompt_ids(messages: Sequence[object]) -> list[int]:
    """The ids of `chat_prompt_tokens`: each message framed by its role, then the assistant
    turn, so a shared system prompt leads every prompt with the same ids."""
    ids: list[int] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        role_id = ROLE_IDS.get(role, OTHER_ROLE) if isinstance(role, str) else OTHER_ROLE
        ids += (MESSAGE_START, role_id, SEPARATOR)
        ids += text_ids(_content_text(content))
        ids.append(MESSAGE_END)
    ids += (MESSAGE_START, ROLE_IDS["assistant"], SEPARATOR)
    return ids


def completion_prompt_tokens(prompt: str | Sequence[int]) -> int:
    if isinstance(prompt, str):
        return text_tokens(prompt) + TOKENS_PER_COMPLETION_PROMPT
    return len(prompt)


def completion_prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    """The ids of `completion_prompt_tokens`: BOS then the text's, or the ids as given."""
    if isinstance(prompt, str):
        return [BOS, *text_ids(prompt)]
    return list(prompt)


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
