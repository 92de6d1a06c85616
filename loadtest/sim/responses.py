"""The simulated replica's /v1/responses, shaped as vLLM answers it.

Responses run on the engine like completions and stream the typed events vLLM emits
(`response.created`, `response.in_progress`, the output item and content part opening,
`response.output_text.delta` per flush, their closing, `response.completed` with usage).
A replica keeps the responses it produced (the most recent, bounded), so a continuation
(`previous_response_id`) is answered only by the replica that produced its predecessor:
any other answers 404, as a vLLM server does.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from loadtest.sim.apis import api_error, json_body
from loadtest.sim.asgi import (
    ClientGone,
    read_body,
    send_chunk,
    send_json,
    start_sse,
)
from loadtest.sim.engine import Engine, LiveSequence
from loadtest.sim.protocol import Limits, SimRequestError, resolve_model
from loadtest.sim.scheduler import SeqState
from loadtest.sim.tokens import FillerText, chat_prompt_tokens

KEPT_RESPONSES = 10_000


class ResponsesEndpoint:
    """POST /v1/responses on a generating replica."""

    def __init__(self, *, limits: Limits, engine: Engine, filler: FillerText) -> None:
        self._limits = limits
        self._engine = engine
        self._filler = filler
        # response id → the conversation's tokens so far (prompt and answer): a continuation's
        # prompt holds them all
        self._kept: OrderedDict[str, int] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        try:
            body = json_body(raw)
            adapter = resolve_model(body.get("model"), self._limits)
            prompt_tokens, max_tokens = self._parse(body)
        except SimRequestError as exc:
            error_type = "invalid_request_error" if exc.status == 404 else None
            await api_error(send, exc, error_type=error_type)
            return
        seq = LiveSequence(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            streaming=body.get("stream") is True,
            adapter=adapter,
        )
        self._engine.submit(seq)
        model = self._limits.model if adapter is None else adapter.name
        writer = _ResponseWriter(
            body=body, model=model, prompt_tokens=prompt_tokens, filler=self._filler
        )
        async with self._engine.serving([seq], receive):
            if seq.streaming:
                await self._stream(seq, writer, send)
            else:
                await self._complete(seq, writer, send)

    def _parse(self, body: dict[str, Any]) -> tuple[int, int]:
        value = body.get("input")
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        if not isinstance(value, list) or not value:
            raise SimRequestError("input must be a string or a non-empty list", param="input")
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            value = [{"role": "system", "content": instructions}, *value]
        prompt_tokens = chat_prompt_tokens(value)
        previous = body.get("previous_response_id")
        if previous is not None:
            earlier = self._kept.get(previous)
            if earlier is None:
                raise SimRequestError(
                    f"Response with id '{previous}' not found.", status=404, param=None
                )
            prompt_tokens += earlier
        max_tokens = body.get("max_output_tokens")
        room = self._limits.max_model_len - prompt_tokens
        if max_tokens is None:
            default = self._limits.default_max_tokens
            max_tokens = room if default is None else min(default, room)
        if not isinstance(max_tokens, int) or max_tokens < 1 or max_tokens > room:
            raise SimRequestError(
                f"This model's maximum context length is {self._limits.max_model_len} tokens "
                f"and your request has {prompt_tokens} input tokens; max_output_tokens "
                f"{max_tokens} does not fit.",
                param="max_output_tokens",
            )
        return prompt_tokens, max_tokens

    def _keep(self, writer: _ResponseWriter, generated: int) -> None:
        self._kept[writer.id] = writer.prompt_tokens + generated
        while len(self._kept) > KEPT_RESPONSES:
            self._kept.popitem(last=False)

    async def _complete(self, seq: LiveSequence, writer: _ResponseWriter, send: Send) -> None:
        while not seq.done:
            await seq.progress.wait()
            seq.progress.clear()
        if seq.state is SeqState.ABORTED:
            await api_error(send, SimRequestError("request aborted", status=503))
            return
        self._keep(writer, seq.generated)
        await send_json(send, 200, orjson.dumps(writer.response("completed", seq.generated)))

    async def _stream(self, seq: LiveSequence, writer: _ResponseWriter, send: Send) -> None:
        sent = 0
        started = False
        while True:
            await seq.progress.wait()
            seq.progress.clear()
            if seq.state is SeqState.ABORTED:
                if started:
                    await send_chunk(send, b"", last=True)
                return
            parts: list[bytes] = []
            if not started:
                await start_sse(send)
                started = True
                parts += writer.opening()
            if seq.generated > sent:
                parts.append(writer.delta(sent, seq.generated))
                sent = seq.generated
            finished = seq.state is SeqState.FINISHED
            if finished:
                self._keep(writer, sent)
                parts += writer.closing(sent)
            await send_chunk(send, b"".join(parts), last=finished)
            if finished:
                return


class _ResponseWriter:
    """The events and the whole object of one response."""

    def __init__(
        self, *, body: dict[str, Any], model: str | None, prompt_tokens: int, filler: FillerText
    ) -> None:
        self.id = "resp_" + os.urandom(12).hex()
        self._item = "msg_" + os.urandom(12).hex()
        self._body = body
        self._model = model or str(body.get("model"))
        self.prompt_tokens = prompt_tokens
        self._filler = filler
        self._created = int(time.time())
        self._sequence = 0

    def response(self, status: str, generated: int | None) -> dict[str, Any]:
        body = self._body
        output = [] if generated is None else [self._message(generated)]
        usage = None
        if generated is not None:
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + generated,
            }
        return {
            "id": self.id,
            "created_at": self._created,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self._model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": True,
            "temperature": body.get("temperature", 1.0),
            "tool_choice": "auto",
            "tools": [],
            "top_p": body.get("top_p", 1.0),
            "background": False,
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "status": status,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
            "user": None,
        }

    def _text_part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message(self, generated: int, *, status: str = "completed") -> dict[str, Any]:
        content = (
            [self._text_part(self._filler.text(0, generated))] if status == "completed" else []
        )
        return {
            "id": self._item,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def opening(self) -> list[bytes]:
        where = {"item_id": self._item, "output_index": 0, "content_index": 0}
        return [
            self._event("response.created", response=self.response("in_progress", None)),
            self._event("response.in_progress", response=self.response("in_progress", None)),
            self._event(
                "response.output_item.added",
                output_index=0,
                item=self._message(0, status="in_progress"),
            ),
            self._event("response.content_part.added", **where, part=self._text_part("")),
        ]

    def delta(self, start: int, stop: int) -> bytes:
        return self._event(
            "response.output_text.delta",
            item_id=self._item,
            output_index=0,
            content_index=0,
            delta=self._filler.text(start, stop),
            logprobs=[],
        )

    def closing(self, generated: int) -> list[bytes]:
        where = {"item_id": self._item, "output_index": 0, "content_index": 0}
        text = self._filler.text(0, generated)
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=self._text_part(text)),
            self._event("response.output_item.done", output_index=0, item=self._message(generated)),
            self._event("response.completed", response=self.response("completed", generated)),
        ]
