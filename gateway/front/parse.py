"""An OpenAI request body parsed into an immutable `InferenceRequest`, one parser per API;
bad input stops here, as an OpenAI-shaped 400."""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from gateway.config import Priority
from gateway.errors import InvalidRequest
from gateway.request import KV_TRANSFER_FIELD, Endpoint, InferenceRequest

MAX_TOKENS_CEILING = 1_000_000
MAX_CHOICES = 128  # `n`: each choice is a sequence of its own on the backend
MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request, as OpenAI allows
MAX_JSON_DEPTH = 64  # arrays and objects inside each other; orjson writes at most 254
OUTPUT_LIMITS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
NUMBER = (int, float)  # built once: `int | float` in isinstance makes a new union per call
NUMBER_FIELD_ORDER = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
NUMBER_FIELDS = frozenset(NUMBER_FIELD_ORDER)


def decode_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    # nesting is bounded by the number of brackets: most bodies need no walk at all
    openers = raw.count(b"{") + raw.count(b"[")
    if openers > MAX_JSON_DEPTH and _depth_over(body, MAX_JSON_DEPTH):
        raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    # where an engine loads a prompt's KV from (a host and port it connects to) is the
    # gateway's to say, on a decode leg it sends itself (gateway/front/prefill.py)
    body.pop(KV_TRANSFER_FIELD, None)
    return body


def _depth_over(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels deep (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _content_chars(content: Any, i: int) -> int:
    """The characters of message `i`'s content that is not a plain string."""
    if content is None:
        return 0
    param = f"messages[{i}].content"
    if isinstance(content, list):
        total = 0
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise InvalidRequest("Each content part must be an object.", param=f"{param}[{j}]")
            text = part.get("text")
            if isinstance(text, str):
                total += len(text)
        return total
    raise InvalidRequest("content must be a string or a list of parts.", param=param)


def _chat_prompt_chars(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("Missing required parameter: 'messages'.", param="messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest("Each message must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequest("Each message needs a string 'role'.", param=f"messages[{i}].role")
        content = message.get("content")
        # 16 for the role and the chat template's markers around each message
        total += (len(content) if isinstance(content, str) else _content_chars(content, i)) + 16
    return total


def _completion_prompt_chars(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest("Missing required parameter: 'prompt'.", param="prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt) and prompt:
        return sum(len(p) for p in prompt)
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt) and prompt:
        return 4 * len(prompt)
    raise InvalidRequest("'prompt' must be a string or an array of strings.", param="prompt")


def _max_tokens(body: dict[str, Any], default: int) -> int:
    """max_completion_tokens, else max_tokens (its older name), else the pool's default."""
    key = "max_completion_tokens"
    value = body.get(key)
    if value is None:
        key = "max_tokens"
        value = body.get(key)
        if value is None:
            return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{key}' must be an integer.", param=key)
    if value < 1 or value > MAX_TOKENS_CEILING:
        raise InvalidRequest(
            f"'{key}' must be between 1 and {MAX_TOKENS_CEILING}; got {value}.", param=key
        )
    return value


def names_max_tokens(body: dict[str, Any]) -> bool:
    """Whether the request bounds its output itself (else the backend may generate up to
    its context length): `max_completion_tokens` or `max_tokens`, or the Responses API's
    `max_output_tokens`."""
    return any(body.get(key) is not None for key in OUTPUT_LIMITS)


def _choices(body: dict[str, Any]) -> int:
    """`n`, the number of choices; 1 when absent."""
    value = body.get("n")
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise InvalidRequest(f"'n' must be an integer between 1 and {MAX_CHOICES}.", param="n")
    return value


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{key}' must be a boolean.", param=key)
    return value


def requested_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("Missing required parameter: 'model'.", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string.", param="model")
    return model


def parse_request(
    body: dict[str, Any],
    *,
    endpoint: Endpoint,
    tenant: str,
    pool: str,
    priority: Priority,
    default_max_tokens: int,
    max_model_len: int,
    chars_per_token: float,
    model_context: int | None = None,
) -> InferenceRequest:
    """`body` as the gateway's request. `max_model_len` is what a request is checked against
    (a fallback where the pool knows none); `model_context` the model's context where the
    pool knows it, which bounds what an answer's usage may say."""
    if endpoint is Endpoint.EMBEDDINGS or endpoint is Endpoint.RESPONSES:
        parse = _parse_embeddings if endpoint is Endpoint.EMBEDDINGS else _parse_responses
        return parse(
            body,
            Terms(
                tenant,
                pool,
                priority,
                default_max_tokens,
                max_model_len,
                chars_per_token,
                model_context,
            ),
        )
    chars = (
        _chat_prompt_chars(body) if endpoint is Endpoint.CHAT else _completion_prompt_chars(body)
    )
    max_output = _max_tokens(body, default_max_tokens)
    prompt_tokens = max(1, int(chars / chars_per_token) + 1)
    _check_context(prompt_tokens, max_output, max_model_len=max_model_len, param="max_tokens")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    wants_usage = bool(stream and options and options.get("include_usage") is True)
    if not NUMBER_FIELDS.isdisjoint(body):  # most bodies set none of them
        for key in NUMBER_FIELD_ORDER:
            value = body.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, NUMBER)):
                raise InvalidRequest(f"'{key}' must be a number.", param=key)
    n = _choices(body)
    return InferenceRequest(
        endpoint=endpoint,
        tenant=tenant,
        pool=pool,
        priority=priority,
        stream=stream,
        client_wants_usage=wants_usage,
        prompt_chars=chars,
        prompt_tokens=prompt_tokens,
        max_output_tokens=max_output,
        body=body,
        n=n,
        model_context=model_context,
    )


def _embedding_input_tokens(
    body: dict[str, Any], *, chars_per_token: float
) -> tuple[int, list[int]]:
    """The characters of an embeddings request's text inputs, and each input's tokens
    (counted for token ids, estimated for text)."""
    value = body.get("input")
    if value is None:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input")
    inputs = value if isinstance(value, list) and value and not _is_token(value[0]) else [value]
    if not 1 <= len(inputs) <= MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(
            f"'input' must hold between 1 and {MAX_EMBEDDING_INPUTS} inputs.", param="input"
        )
    chars = 0
    tokens: list[int] = []
    for item in inputs:
        if isinstance(item, str):
            chars += len(item)
            tokens.append(max(1, int(len(item) / chars_per_token) + 1))
        elif isinstance(item, list) and item and all(_is_token(t) for t in item):
            tokens.append(len(item))
        else:
            raise InvalidRequest(
                "'input' must be a string, an array of strings, an array of token ids, or an "
                "array of token-id arrays; none of them empty.",
                param="input",
            )
    return chars, tokens


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Terms(NamedTuple):
    """What the request's tenant and pool set for parsing it (`parse_request`'s arguments)."""

    tenant: str
    pool: str
    priority: Priority
    default_max_tokens: int
    max_model_len: int
    chars_per_token: float
    model_context: int | None = None


def _parse_embeddings(body: dict[str, Any], terms: Terms) -> InferenceRequest:
    """/v1/embeddings: the inputs' tokens are the whole reservation (nothing is generated)."""
    chars, tokens = _embedding_input_tokens(body, chars_per_token=terms.chars_per_token)
    longest = max(tokens)
    if longest > terms.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {terms.max_model_len} tokens; an input has "
            f"about {longest} tokens. Please reduce the length of the input.",
            param="input",
            code="context_length_exceeded",
        )
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise InvalidRequest(
            "'encoding_format' must be 'float' or 'base64'.", param="encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_token(dimensions) or dimensions < 1):
        raise InvalidRequest("'dimensions' must be a positive integer.", param="dimensions")
    # token-id inputs have no characters: they teach the estimator nothing (prompt_chars 0)
    return InferenceRequest(
        endpoint=Endpoint.EMBEDDINGS,
        tenant=terms.tenant,
        pool=terms.pool,
        priority=terms.priority,
        stream=False,
        client_wants_usage=True,
        prompt_chars=chars,
        prompt_tokens=sum(tokens),
        max_output_tokens=0,
        body=body,
    )


def _item_chars(item: Any, param: str) -> int:
    """The characters of one Responses API input item: a message's content (a string, or
    parts with text), or the text fields of another kind of item (a tool call's output)."""
    if not isinstance(item, dict):
        raise InvalidRequest("Each input item must be an object.", param=param)
    total = 16  # the role and the chat template's markers around each message
    for key in ("content", "text", "output", "arguments"):
        value = item.get(key)
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):
            for part in value:
                text = part.get("text") if isinstance(part, dict) else part
                total += len(text) if isinstance(text, str) else 0
    return total


def _parse_responses(body: dict[str, Any], terms: Terms) -> InferenceRequest:
    """/v1/responses: the prompt is `instructions` and `input`; the output `max_output_tokens`."""
    value = body.get("input")
    if value is None:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input")
    if isinstance(value, str):
        chars = len(value)
    elif isinstance(value, list) and value:
        chars = sum(_item_chars(item, f"input[{i}]") for i, item in enumerate(value))
    else:
        raise InvalidRequest(
            "'input' must be a string or a non-empty array of items.", param="input"
        )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string.", param="instructions")
    chars += len(instructions or "")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidRequest(
            "'previous_response_id' must be a non-empty string.", param="previous_response_id"
        )
    max_output = _max_output_tokens(body, terms.default_max_tokens)
    prompt_tokens = max(1, int(chars / terms.chars_per_token) + 1)
    _check_context(
        prompt_tokens, max_output, max_model_len=terms.max_model_len, param="max_output_tokens"
    )
    stream = _flag(body, "stream")
    # a continued conversation's prompt holds earlier turns the gateway cannot see: its
    # characters would mislead the pool's estimator (prompt_chars 0 teaches it nothing)
    prompt_chars = 0 if previous is not None else chars
    return InferenceRequest(
        endpoint=Endpoint.RESPONSES,
        tenant=terms.tenant,
        pool=terms.pool,
        priority=terms.priority,
        stream=stream,
        client_wants_usage=True,
        prompt_chars=prompt_chars,
        prompt_tokens=prompt_tokens,
        max_output_tokens=max_output,
        body=body,
        model_context=terms.model_context,
    )


def _max_output_tokens(body: dict[str, Any], default: int) -> int:
    value = body.get("max_output_tokens")
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= MAX_TOKENS_CEILING
    ):
        raise InvalidRequest(
            f"'max_output_tokens' must be an integer between 1 and {MAX_TOKENS_CEILING}.",
            param="max_output_tokens",
        )
    return value


def _check_context(prompt_tokens: int, max_output: int, *, max_model_len: int, param: str) -> None:
    if prompt_tokens + max_output > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the request asks "
            f"for about {prompt_tokens} prompt tokens and {max_output} output tokens.",
            param=param,
            code="context_length_exceeded",
        )
