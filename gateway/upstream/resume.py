"""Continuing a stream on another backend after its own broke off mid-answer.

A backend that dies, restarts or is drained while it streams takes its answers with it.
The client has part of an answer; the pool has other backends serving the same model. So
the stream goes on there: the original request is sent again with what the client already
got as the start of the answer, in vLLM's way, and the new backend's events are relayed
as if they came from the first:

- chat: the messages, then an assistant message holding the text so far, with
  `continue_final_message: true` and `add_generation_prompt: false` (the chat template
  leaves that turn open, and the model continues it);
- completions: the prompt with the text so far appended;
- the output limit the request named, less the tokens the client got; the continuation's
  opening role event dropped, its `id` and `created` the first leg's; its usage told as
  the client's (gateway/upstream/relay.py: the text so far counts as output, once).

Only what can be continued faithfully is: one choice, no log probabilities (the text
so far would come back without them), no structured output (a grammar restarts at the
continuation), no tool call under way, no reasoning (the template would take it for the
answer), no echo; a completion's prompt must be one string. A stream that cannot go on
ends with the SSE error event, as before. The text so far is re-tokenized by the new
backend, so the continuation can differ from what the first backend would have said at
the cut, as any two backends' samples do; with greedy decoding it is the same answer.

Backends whose API has no continuation (TGI's Messages API, for one) belong in pools
with `continue_streams: 0`.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import orjson

from gateway.request import Endpoint, InferenceRequest
from gateway.upstream.answer import event_json

# how a request asks for log probabilities, a grammar, or the prompt back
_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
_STRUCTURED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
# every field that may keep a stream from being continued: most bodies name none of them
_TELLING_FIELDS = frozenset(
    {"best_of", "echo", "suffix", "response_format", *_LOGPROB_FIELDS, *_STRUCTURED_FIELDS}
)
_CREATED = re.compile(rb'"created"\s*:\s*\d+')


def refusal(request: InferenceRequest) -> str | None:
    """Why `request`'s stream could not be continued faithfully, whatever it streams; None
    when it can be (the answer's own events may still refuse it: `Partial.refusal`)."""
    body = request.body
    if request.endpoint is Endpoint.COMPLETIONS:
        if not isinstance(body.get("prompt"), str):
            return "prompt"
    elif request.endpoint is not Endpoint.CHAT:
        return "endpoint"
    if request.n > 1:
        return "choices"
    if _TELLING_FIELDS.isdisjoint(body):  # the request path's usual case: one set lookup
        return None
    if body.get("suffix") and request.endpoint is Endpoint.COMPLETIONS:
        return "suffix"
    if _number(body.get("best_of")) > 1:
        return "choices"
    if any(body.get(key) not in (None, False, 0) for key in _LOGPROB_FIELDS):
        return "logprobs"
    if body.get("echo"):
        return "echo"
    format_ = body.get("response_format")
    if any(body.get(key) is not None for key in _STRUCTURED_FIELDS) or (
        isinstance(format_, dict) and format_.get("type") not in (None, "text")
    ):
        return "structured_output"
    return None


def _number(value: Any) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


class Partial(NamedTuple):
    """What the client got of an answer before its stream broke off (nothing, to start)."""

    text: str = ""
    tokens: int = 0  # its content events: one per token as vLLM streams them
    finished: bool = False  # the answer's finishing event came: nothing is left to continue
    refusal: str | None = None  # why it cannot be continued faithfully; None when it can
    id: bytes | None = None  # the stream's `id` and `created`, as the client saw them
    created: bytes | None = None


NOTHING = Partial()


def read_partial(kept: list[bytes], endpoint: Endpoint, *, before: Partial = NOTHING) -> Partial:
    """The answer so far, from the event batches the client got (after what it got
    `before` them, where that was read already)."""
    text = [before.text]
    _, tokens, finished, why, id_, created = before
    for event in b"".join(kept).split(b"\n\n"):
        payload = event_json(event)
        if payload is None:
            continue
        if id_ is None and isinstance(payload.get("id"), str):
            id_ = orjson.dumps(payload["id"])
            created = orjson.dumps(payload.get("created"))
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            continue
        choice = choices[0]
        if endpoint is Endpoint.CHAT:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = {}
            if delta.get("tool_calls") or delta.get("function_call"):
                why = "tool_call"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                why = "reasoning"
            piece = delta.get("content")
        else:
            piece = choice.get("text")
        if isinstance(piece, str) and piece:
            text.append(piece)
            tokens += 1
        if choice.get("finish_reason"):
            finished = True
    return Partial("".join(text), tokens, finished, why, id_, created)


def continued(request: InferenceRequest, partial: Partial) -> InferenceRequest | None:
    """`request` continuing from `partial`, admitted like any request; None when the
    output limit it named is spent."""
    body = dict(request.body)
    remaining = request.max_output_tokens - partial.tokens
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            if remaining < 1:
                return None
            body[key] = remaining
            break
    if request.endpoint is Endpoint.CHAT:
        body["messages"] = _with_answer(body["messages"], partial.text, body)
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = body["prompt"] + partial.text
    reserve = request.output_reserve
    return request._replace(
        body=body,
        prompt_tokens=request.prompt_tokens + partial.tokens,
        max_output_tokens=max(1, remaining),
        output_reserve=max(1, reserve - partial.tokens) if reserve else 0,
    )


def _with_answer(messages: list[Any], text: str, body: dict[str, Any]) -> list[Any]:
    """The messages with `text` as the open assistant turn: appended to the request's own
    final assistant message where the request was itself a continuation of it."""
    last = messages[-1] if messages else None
    if (
        body.get("continue_final_message") is True
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        return [*messages[:-1], {**last, "content": last["content"] + text}]
    return [*messages, {"role": "assistant", "content": text}]


# what of a chat request its prompt's tokens depend on, besides its messages
_TEMPLATE_FIELDS = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
)


def count_body(request: InferenceRequest, model: str) -> bytes:
    """The body of a `/tokenize` request that counts `request`'s prompt as its endpoint
    would: a continued stream's usage tells the client's prompt, not the continuation's,
    whose re-tokenized text so far need not be as many tokens as were streamed."""
    body = request.body
    count: dict[str, Any] = {"model": model}
    if request.endpoint is Endpoint.CHAT:
        count["messages"] = body.get("messages")
        count.update((key, body[key]) for key in _TEMPLATE_FIELDS if key in body)
    else:
        count["prompt"] = body.get("prompt")
        if "add_special_tokens" in body:
            count["add_special_tokens"] = body["add_special_tokens"]
    return orjson.dumps(count)


class ContinuationLeg:
    """A continuation's events as the client's stream had them: the opening role event
    (a chat stream's first, which the client already had) dropped, and the first leg's
    `id` and `created` in place of the continuation's own."""

    __slots__ = ("_created", "_id", "_opened", "_own_id")

    def __init__(self, partial: Partial) -> None:
        self._id = partial.id
        self._created = None if partial.created is None else b'"created":' + partial.created
        self._own_id: bytes | None = None
        self._opened = False  # its first event that carries the answer has passed

    def rewrite(self, out: bytes) -> bytes:
        if not self._opened:
            out = self._open(out)
        if self._own_id is not None and self._id is not None:
            out = out.replace(self._own_id, self._id)
        if self._created is not None:
            out = _CREATED.sub(self._created, out)
        return out

    def _open(self, out: bytes) -> bytes:
        kept = []
        for event in out.split(b"\n\n"):
            payload = None if self._opened else event_json(event)
            if payload is not None:
                if self._own_id is None and isinstance(payload.get("id"), str):
                    self._own_id = orjson.dumps(payload["id"])
                if _opening(payload):
                    continue
                self._opened = True
            kept.append(event)
        return b"\n\n".join(kept)


def _opening(payload: dict[str, Any]) -> bool:
    """A chat stream's role event: the role, no content, no tool call, no finish."""
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    return (
        isinstance(delta, dict)
        and "role" in delta
        and not delta.get("content")
        and not delta.get("tool_calls")
        and not choice.get("finish_reason")
    )
