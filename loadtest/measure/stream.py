"""One measured stream of `spillgate measure`: its prompt, and its tokens timed as they arrive.

Prompts are text, so any tokenizer takes them (token ids beyond a small vocabulary are
refused, by vLLM in the middle of a 200 stream). Words are drawn per request, so prompts
differ from their first words and no prefix cache shortens a prefill; the number of words
is calibrated on the endpoint's own count of the first prompt's tokens.

Inter-token latency is the time a token took to arrive after the one before it. Tokens
reach the client in network reads, one SSE event per engine output (usually one token,
several when the server falls behind), and one read often carries several events: the
tokens of one read share the time since the read before. Each read is timed once, when
it arrives, not each event as it is parsed, which would time the parser.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson


class MeasureError(RuntimeError):
    pass


# Common words that are one token in the usual BPE vocabularies; five characters with their
# space, so the simulator's four characters a token counts them evenly too.
WORDS = (
    "that", "with", "have", "this", "from", "they", "will", "your", "what", "when",
    "make", "like", "time", "just", "know", "take", "into", "year", "good", "some",
    "them", "than", "then", "look", "only", "come", "over", "also", "back", "work",
    "well", "even", "want", "give", "most", "very", "find", "here", "long", "each",
)  # fmt: skip


def prompt_text(index: int, words: int) -> str:
    """Request `index`'s prompt of `words` words; the same index gives the same prompt."""
    rng = random.Random(index)
    return " ".join(rng.choice(WORDS) for _ in range(max(1, words)))


def calibrated_words(*, target_tokens: int, words: int, tokens: int) -> int:
    """Words for `target_tokens` prompt tokens, where `words` words counted `tokens`."""
    if tokens <= 0:
        return words
    return max(1, round(words * target_tokens / tokens))


@dataclass(frozen=True, kw_only=True)
class Arrival:
    at: float
    events: int  # generation events the read completed


@dataclass(kw_only=True)
class Sample:
    started: float
    arrivals: list[Arrival] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    ended: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0].at - self.started

    @property
    def tokens_per_event(self) -> float:
        events = sum(a.events for a in self.arrivals)
        return self.completion_tokens / events if events else 0.0

    def tokens_in(self, arrival: Arrival) -> float:
        return arrival.events * self.tokens_per_event

    def itls_s(self) -> list[float]:
        """One gap per token after the first read (its own tokens have no earlier one)."""
        out: list[float] = []
        for before, now in itertools.pairwise(self.arrivals):
            tokens = self.tokens_in(now)
            out += [(now.at - before.at) / tokens] * max(1, round(tokens))
        return out


def error_message(data: Any) -> str | None:
    """The message of an OpenAI-shaped error body, nested (`{"error": {...}}`) or flat."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if error:
        return str(error)
    if data.get("object") == "error":
        return str(data.get("message"))
    return None


def _payloads(block: bytes) -> Iterator[bytes]:
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            yield line[5:].strip()


class StreamReader:
    """Folds a streamed completion's reads into a Sample, one arrival per read with tokens."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.done = False
        self._buffer = b""

    def feed(self, data: bytes, now: float) -> None:
        """Raises MeasureError for an error event: the message is the endpoint's."""
        head, sep, rest = (self._buffer + data).replace(b"\r\n", b"\n").rpartition(b"\n\n")
        if not sep:
            self._buffer = rest
            return
        self._buffer = rest
        events = sum(self._event(p) for block in head.split(b"\n\n") for p in _payloads(block))
        if events:
            self.sample.arrivals.append(Arrival(at=now, events=events))

    def _event(self, payload: bytes) -> int:
        if payload == b"[DONE]":
            self.done = True
            return 0
        data = orjson.loads(payload)
        message = error_message(data)
        if message is not None:
            raise MeasureError(f"the stream carried an error: {message}")
        usage = data.get("usage")
        if usage:
            self.sample.completion_tokens = int(usage.get("completion_tokens") or 0)
            self.sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        return 1 if data.get("choices") else 0
