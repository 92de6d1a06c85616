"""A request's prompt as the engine's token ids: the model's own tokenizer and chat template.

The KV-events index (gateway/admission/routing/kv_index.py) matches a prompt's blocks of token ids
against those the engine reports cached, so the prompt must be tokenized exactly as the
engine does it. vLLM renders a chat with the model's Jinja chat template (in a sandbox, with
`trim_blocks` and `lstrip_blocks`, as Hugging Face's `apply_chat_template`) and tokenizes the
text without adding special tokens (the template writes them); a completion's prompt string
is tokenized with them; a prompt of token ids is taken as it is.

The files are a Hugging Face model directory's (a pool's `tokenizer` setting names it):
`tokenizer.json` (the `tokenizers` library's format) and `tokenizer_config.json` (its
`chat_template`, `bos_token`, `eos_token`; or the template in `chat_template.jinja`). In a
fleet they come with the model: baked into the gateway's image beside the served model's
name, or the same volume the engines load the model from mounted read-only.

Cost. A rendered chat is split by the tokenizer at its special tokens and each piece between
them is tokenized on its own, so the pieces' ids joined are the whole text's. Pieces are
cached (most recently used kept): a tenant's system prompt, or a chat's earlier turns, is
tokenized once, and a request pays for its new text only. Tokenizing costs about a
microsecond a character, so new text past OFF_LOOP_CHARS is tokenized in a worker thread
(`prompt_token_ids`): the tokenizer releases the GIL while it encodes a batch, and the event
loop goes on serving other requests meanwhile. Rendering, splitting and the cache stay on
the loop, which alone touches the cache.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

PIECES_CACHED = 4096  # rendered pieces kept tokenized
PIECE_MIN_CHARS = 64  # shorter pieces are tokenized again: cheaper than the cache's upkeep
# new text past this many characters (about 0.3 ms of tokenizing) is tokenized off the loop
OFF_LOOP_CHARS = 384


class TokenizerFilesError(ValueError):
    """The tokenizer directory lacks a file or holds one that cannot be read."""


@dataclass(slots=True)
class Split:
    """Rendered text in its pieces: the ids of each (a special token's, a cached piece's),
    and the pieces not yet tokenized, by their place."""

    parts: list[list[int]] = field(default_factory=list)
    missing: list[tuple[int, str]] = field(default_factory=list)  # (place in parts, text)

    @property
    def missing_chars(self) -> int:
        return sum(len(text) for _, text in self.missing)


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class PromptTokenizer:
    """Token ids of chats and completion prompts, as one model's engine makes them."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        try:
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config_file = path / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (OSError, ValueError, Exception) as exc:
            raise TokenizerFilesError(f"{path}: {exc}") from None
        self._bos = _token_text(config.get("bos_token"))
        self._eos = _token_text(config.get("eos_token"))
        source = _chat_template(path, config)
        self._template = None if source is None else _environment().from_string(source)
        self._specials: dict[str, int] = {}
        for token in self._tokenizer.get_added_tokens_decoder().values():
            found = self._tokenizer.token_to_id(token.content) if token.content else None
            if found is not None:
                self._specials[token.content] = found
        longest_first = sorted(self._specials, key=len, reverse=True)
        pattern = "(" + "|".join(map(re.escape, longest_first)) + ")"
        self._split = re.compile(pattern) if longest_first else None
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        """The ids of a chat request's prompt, or None when the template cannot render it."""
        text = self.render(body)
        return None if text is None else self.text(text)

    def render(self, body: dict[str, Any]) -> str | None:
        """A chat request's prompt as the template writes it, or None when it cannot."""
        if self._template is None:
            return None
        continued = body.get("continue_final_message") is True
        try:
            text = self._template.render(
                messages=body.get("messages"),
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True) and not continued,
                bos_token=self._bos,
                eos_token=self._eos,
                **(body.get("chat_template_kwargs") or {}),
            )
        except (TemplateError, TypeError, ValueError):
            return None
        return text

    def completion(self, prompt: object) -> list[int] | None:
        """The ids of a completion's prompt: a string (with the tokenizer's special tokens)
        or a list of ids; None for anything else (several prompts)."""
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):  # a batch, to encode without holding the GIL
            return list(self._tokenizer.encode_batch([prompt], add_special_tokens=True)[0].ids)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        return None

    def text(self, text: str) -> list[int]:
        """The ids of rendered text, without special tokens added around it."""
        split = self.split(text)
        return self.finish(split, self.encode([piece for _, piece in split.missing]))

    def split(self, text: str) -> Split:
        """`text` in pieces at its special tokens, those already tokenized with their ids."""
        split = Split()
        pieces = [text] if self._split is None else self._split.split(text)
        for i, piece in enumerate(pieces):
            if i % 2:  # a special token
                split.parts.append([self._specials[piece]])
            elif piece:
                cached = self._pieces.get(piece) if len(piece) >= PIECE_MIN_CHARS else None
                if cached is None:
                    split.missing.append((len(split.parts), piece))
                else:
                    self._pieces.move_to_end(piece)
                split.parts.append(cached or [])
        return split

    def encode(self, pieces: Sequence[str]) -> list[list[int]]:
        """The ids of each piece, holding the GIL: for a few short pieces."""
        return [self._tokenizer.encode(p, add_special_tokens=False).ids for p in pieces]

    def encode_batch(self, pieces: Sequence[str]) -> list[list[int]]:
        """The ids of each piece, encoded without holding the GIL. Touches no cache, so a
        worker thread may call it."""
        batch = self._tokenizer.encode_batch(list(pieces), add_special_tokens=False)
        return [e.ids for e in batch]

    def finish(self, split: Split, encoded: Sequence[list[int]]) -> list[int]:
        """The whole text's ids, from `split` and the ids of its missing pieces; those long
        enough are cached."""
        for (place, piece), ids in zip(split.missing, encoded, strict=True):
            split.parts[place] = ids
            if len(piece) >= PIECE_MIN_CHARS:
                self._pieces[piece] = ids
                if len(self._pieces) > PIECES_CACHED:
                    self._pieces.popitem(last=False)
        joined: list[int] = []
        for part in split.parts:
            joined += part  # in place: a tenth of a comprehension's time over 8k ids
        return joined


def _environment() -> ImmutableSandboxedEnvironment:
    """Jinja as Hugging Face's `apply_chat_template` sets it up."""

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: object, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


async def prompt_token_ids(
    body: dict[str, Any], tokenizer: PromptTokenizer | None
) -> tuple[int, ...]:
    """A chat's or a completion's prompt as the engine's token ids; () when there is no
    tokenizer or the prompt cannot be tokenized as the engine would. New text past
    OFF_LOOP_CHARS is tokenized in a worker thread."""
    if tokenizer is None:
        return ()
    if "messages" not in body:
        return await _completion_ids(body.get("prompt"), tokenizer)
    text = tokenizer.render(body)
    if text is None:
        return ()
    split = tokenizer.split(text)
    missing = [piece for _, piece in split.missing]
    if split.missing_chars > OFF_LOOP_CHARS:
        encoded = await asyncio.to_thread(tokenizer.encode_batch, missing)
    else:
        encoded = tokenizer.encode(missing)
    return tuple(tokenizer.finish(split, encoded))


async def _completion_ids(prompt: object, tokenizer: PromptTokenizer) -> tuple[int, ...]:
    long = isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS
    ids = (
        await asyncio.to_thread(tokenizer.completion, prompt)
        if long
        else tokenizer.completion(prompt)
    )
    return () if ids is None else tuple(ids)
