"""A request's prompt as the engine's token ids: the model's own tokenizer and chat template.

The KV-events index (gateway/admission/kv_index.py) matches a prompt's blocks of token ids
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
tokenized once, and a request pays for its new text only.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

PIECES_CACHED = 4096  # rendered pieces kept tokenized
PIECE_MIN_CHARS = 64  # shorter pieces are tokenized again: cheaper than the cache's upkeep


class TokenizerFilesError(ValueError):
    """The tokenizer directory lacks a file or holds one that cannot be read."""


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
        return self.text(text)

    def completion(self, prompt: object) -> list[int] | None:
        """The ids of a completion's prompt: a string (with the tokenizer's special tokens)
        or a list of ids; None for anything else (several prompts)."""
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        return None

    def text(self, text: str) -> list[int]:
        """The ids of rendered text, without special tokens added around it."""
        if self._split is None:
            return self._encode(text)
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # a special token
                ids.append(self._specials[piece])
            elif piece:
                ids += self._piece(piece)
        return ids

    def _piece(self, piece: str) -> list[int]:
        if len(piece) < PIECE_MIN_CHARS:
            return self._encode(piece)
        cached = self._pieces.get(piece)
        if cached is not None:
            self._pieces.move_to_end(piece)
            return cached
        ids = self._pieces[piece] = self._encode(piece)
        if len(self._pieces) > PIECES_CACHED:
            self._pieces.popitem(last=False)
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


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


def prompt_token_ids(body: dict[str, Any], tokenizer: PromptTokenizer | None) -> tuple[int, ...]:
    """A chat's or a completion's prompt as the engine's token ids; () when there is no
    tokenizer or the prompt cannot be tokenized as the engine would."""
    if tokenizer is None:
        return ()
    chat = "messages" in body
    ids = tokenizer.chat(body) if chat else tokenizer.completion(body.get("prompt"))
    return () if ids is None else tuple(ids)
