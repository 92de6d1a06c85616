"""Parse an OpenAI request into what the simulated engine needs, with vLLM's 4xx errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import orjson

from gateway.admission.prompt_tokens import PromptTokenizer
from loadtest.sim.config import Adapter
from loadtest.sim.lengths import StopRule
from loadtest.sim.tokens import (
    PromptEnd,
    chat_answer_start,
    chat_prompt_ids,
    chat_prompt_tokens,
    completion_prompt,
)
from loadtest.sim.wire import Kind


class SimRequestError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        """`error_type`: the body's `type`; by default vLLM's for the status."""
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self._error_type = error_type

    @property
    def error_type(self) -> str:
        if self._error_type is not None:
            return self._error_type
        return "NotFoundError" if self.status == 404 else "BadRequestError"


class AdapterLookup(Protocol):
    """The LoRA adapters a replica serves (loadtest/sim/lora.py)."""

    def resolve(self, model: str) -> Adapter | None:
        """The adapter named `model`, or None when none is loaded under that name."""
        ...


@dataclass(frozen=True, kw_only=True)
class SimRequest:
    kind: Kind
    model: str | None
    prompt_tokens: int
    max_tokens: int  # the cap: the request's, or the default when it sent none
    finish_reason: str  # an answer that reaches the cap: "length", or "stop" for a default
    stream: bool
    include_usage: bool
    n: int = 1  # choices: one sequence each, as vLLM runs them
    stop: StopRule = field(default_factory=StopRule)
    prompt_token_ids: list[int] | None = None  # when asked for: what the prefix cache hashes
    # the answer's first word in the filler: the words of it the prompt already holds, when
    # it continues an answer (loadtest/sim/tokens.py), else 0
    answer_start: int = 0
    adapter: Adapter | None = None  # the LoRA adapter `model` names; None: the base model
    # what a disaggregated leg brings for the KV connector (loadtest/sim/kv_transfer.py)
    kv_transfer_params: dict[str, object] | None = None

    @property
    def served_model(self) -> str | None:
        """The name the answer's `model` says: the adapter's, else None (the replica's)."""
        return None if self.adapter is None else self.adapter.name


@dataclass(frozen=True, kw_only=True)
class Limits:
    model: str | None  # the one served name; None accepts any name
    max_model_len: int
    default_max_tokens: int | None  # None: vLLM's, the room left after the prompt
    # a real model's tokenizer and chat template (`--tokenizer`): prompts become the ids a
    # real engine would see, so a gateway that tokenizes alike matches the blocks the KV
    # events tell of; None: the simulator's own ids (loadtest/sim/tokens.py)
    tokenizer: PromptTokenizer | None = None
    adapters: AdapterLookup | None = None  # with LoRA enabled: `model` may name one


def resolve_model(model: object, limits: Limits) -> Adapter | None:
    """The adapter a request's `model` names, None for the base model (or no name), and
    vLLM's 404 for any other name."""
    if model is None or limits.model is None or model == limits.model:
        return None
    adapter = None
    if isinstance(model, str) and limits.adapters is not None:
        adapter = limits.adapters.resolve(model)
    if adapter is None:
        raise SimRequestError(
            f"The model `{model}` does not exist. Valid aliases: {limits.model}.",
            status=404,
            param="model",
        )
    return adapter


@dataclass(frozen=True, kw_only=True)
class _Prompt:
    tokens: int
    ids: list[int] | None  # when asked for
    answer_start: int


def _prompt(kind: Kind, body: dict[str, object], *, token_ids: bool) -> _Prompt:
    """The prompt's token ids when `token_ids`, else only how many there are: counting is
    cheaper, and a replica without a prefix cache needs nothing more."""
    if kind is Kind.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimRequestError("messages must be a non-empty list", param="messages")
        end = _chat_prompt_end(body, messages)
        start = chat_answer_start(messages) if end is PromptEnd.CONTINUED else 0
        if token_ids:
            ids = chat_prompt_ids(messages, end=end)
            return _Prompt(tokens=len(ids), ids=ids, answer_start=start)
        return _Prompt(tokens=chat_prompt_tokens(messages, end=end), ids=None, answer_start=start)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        count, ids, start = completion_prompt(prompt, token_ids=token_ids)
        return _Prompt(tokens=count, ids=ids, answer_start=start)
    raise SimRequestError(
        "prompt must be a string or a list of token ids (one prompt per request)",
        param="prompt",
    )


def _tokenized(
    kind: Kind, body: dict[str, object], tokenizer: PromptTokenizer, own: _Prompt
) -> _Prompt:
    """The prompt as the real tokenizer makes it, where it can (else the simulator's own)."""
    chat = kind is Kind.CHAT
    ids = tokenizer.chat(body) if chat else tokenizer.completion(body.get("prompt"))
    if not ids:
        return own
    return _Prompt(tokens=len(ids), ids=ids, answer_start=own.answer_start)


def tokenized(body: dict[str, object]) -> list[int]:
    """vLLM's `POST /tokenize`: the token ids of a chat's prompt (`messages`) or a
    completion's (`prompt`), as the engine would count them."""
    kind = Kind.CHAT if "messages" in body else Kind.COMPLETION
    ids = _prompt(kind, body, token_ids=True).ids
    assert ids is not None
    return ids


def _chat_prompt_end(body: dict[str, object], messages: list[object]) -> PromptEnd:
    """Where the chat template stops, with vLLM's refusals of what cannot be rendered.

    `add_generation_prompt` is true unless sent false, so `continue_final_message` needs it
    sent false; vLLM's own check names both when both are sent true, and the chat template
    refuses the default. A last message not the assistant's is refused with the words vLLM
    uses for Mistral tokenizers (with a Hugging Face chat template, vLLM continues whatever
    message comes last, under its role).
    """
    continued = body.get("continue_final_message")
    generation = body.get("add_generation_prompt", True)
    if not continued:
        return PromptEnd.LAST_MESSAGE if generation is False else PromptEnd.NEW_TURN
    if body.get("add_generation_prompt"):
        raise SimRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    if generation:
        raise SimRequestError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, "
            "and add_generation_prompt when you want to add a header that will prompt it to "
            "start a new assistant message instead."
        )
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise SimRequestError(
            "Cannot set `continue_final_message` to True when the last message is not from "
            "the assistant."
        )
    return PromptEnd.CONTINUED


def _requested_max_tokens(body: dict[str, object]) -> int | None:
    value = body.get("max_tokens")
    if value is None:
        value = body.get("max_completion_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SimRequestError("max_tokens must be a positive integer", param="max_tokens")
    return value


def _check_length(prompt_tokens: int, max_tokens: int | None, limits: Limits) -> None:
    ctx = limits.max_model_len
    if max_tokens is not None and max_tokens > ctx:
        raise SimRequestError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={ctx}. "
            f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    if prompt_tokens >= ctx:
        raise SimRequestError(
            f"This model's maximum context length is {ctx} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="messages",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > ctx:
        raise SimRequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {ctx} tokens and your request has {prompt_tokens} "
            f"input tokens ({max_tokens} > {ctx} - {prompt_tokens}).",
            param="max_tokens",
        )


def parse_request(kind: Kind, raw: bytes, limits: Limits, *, token_ids: bool = False) -> SimRequest:
    """The request as the engine runs it; with `token_ids`, its prompt's ids too."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SimRequestError(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise SimRequestError("the request body must be a JSON object")
    model = body.get("model")
    adapter = resolve_model(model, limits)
    n = body.get("n")
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SimRequestError("n must be at least 1.", param="n")
    prompt = _prompt(kind, body, token_ids=token_ids)
    if limits.tokenizer is not None:
        prompt = _tokenized(kind, body, limits.tokenizer, prompt)
    prompt_tokens = prompt.tokens
    requested = _requested_max_tokens(body)
    _check_length(prompt_tokens, requested, limits)
    room = limits.max_model_len - prompt_tokens
    # left uncapped, the model ends its answer by itself, continued or not
    uncapped = (
        None
        if limits.default_max_tokens is None
        else max(1, limits.default_max_tokens - prompt.answer_start)
    )
    if requested is not None:
        max_tokens, finish_reason = requested, "length"
    elif uncapped is not None and uncapped <= room:
        max_tokens, finish_reason = uncapped, "stop"
    else:
        max_tokens, finish_reason = room, "length"
    stop = _stop_rule(body)
    if stop.min_tokens > max_tokens:
        raise SimRequestError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {stop.min_tokens}.",
            param="min_tokens",
        )
    options = body.get("stream_options")
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise SimRequestError(
            "kv_transfer_params must be an object or null", param="kv_transfer_params"
        )
    return SimRequest(
        kind=kind,
        model=model if isinstance(model, str) else None,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        finish_reason=finish_reason,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        n=n,
        stop=stop,
        prompt_token_ids=prompt.ids,
        answer_start=prompt.answer_start,
        adapter=adapter,
        kv_transfer_params=kv_params,
    )


def _int_field(body: dict[str, object], name: str, *, least: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise SimRequestError(f"{name} must be an integer of at least {least}", param=name)
    return value


def _stop_rule(body: dict[str, object]) -> StopRule:
    """`ignore_eos`, `stop_token_ids`, `min_tokens` and `seed`. `stop` strings are checked
    for shape only: the filler text is no model's, so matching it would end nothing real."""
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise SimRequestError(
            "stop_token_ids must be a list of non-negative integers", param="stop_token_ids"
        )
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise SimRequestError("stop must be a string or a list of strings", param="stop")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise SimRequestError("ignore_eos must be a boolean", param="ignore_eos")
    return StopRule(
        ignore_eos=ignore_eos is True,
        stop_token_ids=tuple(dict.fromkeys(ids)),
        min_tokens=_int_field(body, "min_tokens", least=0) or 0,
        seed=_int_field(body, "seed", least=-(2**63)),
    )


def out_of_vocabulary(raw: bytes, vocab_size: int) -> str | None:
    """vLLM's refusal of a prompt holding a token id its vocabulary lacks, or None."""
    prompt = orjson.loads(raw).get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    ids = [t for t in prompt if isinstance(t, int)] if isinstance(prompt, list) else []
    if ids and max(ids) >= vocab_size:
        return f"Token id {max(ids)} is out of vocabulary"
    return None
