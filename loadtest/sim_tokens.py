"""Deterministic token counts and filler text for the simulated backends.

The tokenizer is an approximation, the same one everywhere in the simulator:

- text costs ceil(characters / 4) tokens (about right for English under BPE tokenizers);
- a chat message adds 4 tokens of template (role header and separators), and the chat
  prompt adds 3 more for the assistant turn it opens;
- a legacy completion prompt adds 1 token (BOS); a prompt given as token ids costs its length.

Generated text is one filler word per token, each with its leading space, like a BPE stream.
"""

from __future__ import annotations

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


def text_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


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


def completion_prompt_tokens(prompt: str | Sequence[int]) -> int:
    if isinstance(prompt, str):
        return text_tokens(prompt) + TOKENS_PER_COMPLETION_PROMPT
    return len(prompt)


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
