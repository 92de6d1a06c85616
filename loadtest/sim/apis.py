"""The simulated replica's /v1/embeddings, shaped as vLLM answers it, and what the other
APIs share (loadtest/sim/responses.py serves /v1/responses).

Embeddings are deterministic: the same input always gets the same unit vector (seeded by
its text or token ids), and `usage` counts the simulator's tokens. An embedding replica
(`SimConfig.embedding_dim`) serves only /v1/embeddings, a generating one everything else,
with vLLM's 400 for the API a model does not serve.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import time
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from loadtest.sim.asgi import (
    ClientGone,
    read_body,
    send_json,
)
from loadtest.sim.engine import Engine, LiveSequence
from loadtest.sim.protocol import Limits, SimRequestError, resolve_model
from loadtest.sim.scheduler import SeqState
from loadtest.sim.tokens import completion_prompt_tokens


async def api_error(send: Send, exc: SimRequestError, *, error_type: str | None = None) -> None:
    body = {
        "error": {
            "message": exc.message,
            "type": error_type or exc.error_type,
            "param": exc.param,
            "code": exc.status,
        }
    }
    await send_json(send, exc.status, orjson.dumps(body))


async def unsupported(send: Send, api: str) -> None:
    """vLLM's answer to a request for an API its model does not serve."""
    await api_error(send, SimRequestError(f"The model does not support {api}"))


def json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SimRequestError(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise SimRequestError("the request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], limits: Limits) -> None:
    """vLLM's 404 for a `model` the replica does not serve (base or adapter)."""
    resolve_model(body.get("model"), limits)


def unit_vector(seed: bytes, dim: int) -> list[float]:
    """A deterministic unit vector of `dim` components in [-1, 1] before scaling."""
    values: list[float] = []
    counter = 0
    while len(values) < dim:
        block = hashlib.blake2b(seed + counter.to_bytes(4, "little"), digest_size=64).digest()
        values += [b / 127.5 - 1.0 for b in block]
        counter += 1
    values = values[:dim]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return [round(v / norm, 6) for v in values]


class EmbeddingsEndpoint:
    """POST /v1/embeddings on an embedding replica."""

    def __init__(self, *, limits: Limits, dim: int, engine: Engine, no_delay: bool) -> None:
        self._limits = limits
        self._dim = dim
        self._engine = engine
        self._no_delay = no_delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        try:
            answer = self._answer(json_body(raw))
        except SimRequestError as exc:
            await api_error(send, exc)
            return
        if not await self._run(answer["usage"]["prompt_tokens"]):
            await api_error(send, SimRequestError("request aborted", status=503))
            return
        await send_json(send, 200, orjson.dumps(answer))

    async def _run(self, tokens: int) -> bool:
        """The inputs' prefill on the engine (their KV blocks held meanwhile, one pooling
        step for the vectors); False if it was aborted."""
        if self._no_delay:
            stats = self._engine.scheduler.stats
            stats.prompt_tokens += tokens
            stats.finished += 1
            return True
        seq = LiveSequence(prompt_tokens=tokens, max_tokens=1, streaming=False)
        self._engine.submit(seq)
        try:
            while not seq.done:
                await seq.progress.wait()
                seq.progress.clear()
        finally:
            if not seq.done:
                self._engine.abort(seq)
        return seq.state is not SeqState.ABORTED

    def _inputs(self, body: dict[str, Any]) -> list[str | list[int]]:
        value = body.get("input")
        if isinstance(value, str) or (
            isinstance(value, list) and value and isinstance(value[0], int)
        ):
            value = [value]
        if not isinstance(value, list) or not value:
            raise SimRequestError("input must be a string or a non-empty list", param="input")
        for item in value:
            ok = isinstance(item, str) or (
                isinstance(item, list) and item and all(isinstance(t, int) for t in item)
            )
            if not ok:
                raise SimRequestError("each input must be a string or token ids", param="input")
        return value

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        check_model(body, self._limits)
        inputs = self._inputs(body)
        dim = body.get("dimensions")
        if dim is not None and (not isinstance(dim, int) or not 1 <= dim <= self._dim):
            raise SimRequestError(
                f"Dimensions must be between 1 and {self._dim} for this model.",
                param="dimensions",
            )
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise SimRequestError("encoding_format must be 'float' or 'base64'")
        ctx = self._limits.max_model_len
        data: list[dict[str, Any]] = []
        tokens = 0
        for index, item in enumerate(inputs):
            count = completion_prompt_tokens(item)
            if count > ctx:
                raise SimRequestError(
                    f"This model's maximum context length is {ctx} tokens. However, you "
                    f"requested {count} tokens in the input for embedding generation. Please "
                    "reduce the length of the input.",
                )
            tokens += count
            seed = item.encode() if isinstance(item, str) else orjson.dumps(item)
            vector = unit_vector(seed, dim or self._dim)
            embedding: list[float] | str = vector
            if encoding == "base64":
                embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": index, "object": "embedding", "embedding": embedding})
        return {
            "id": "embd-" + os.urandom(8).hex(),
            "object": "list",
            "created": int(time.time()),
            "model": self._limits.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
