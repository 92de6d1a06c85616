"""The simulated replica's /v1/chat/completions and /v1/completions on the engine: JSON or
SSE, vLLM's finish reasons and usage, and its refusals.

Plain ASGI callables (no Request/Response objects): the gateway benchmark pushes
thousands of requests per second through them.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Receive, Scope, Send

from loadtest.sim.asgi import (
    ClientGone,
    read_body,
    send_chunk,
    send_json,
    start_sse,
)
from loadtest.sim.config import KvLoadFailurePolicy, SimConfig
from loadtest.sim.engine import Engine, EngineStopped, LiveSequence
from loadtest.sim.kv_transfer import KvConnector, KvLoadError
from loadtest.sim.lengths import Finish, LengthSampler
from loadtest.sim.protocol import (
    Limits,
    SimRequest,
    SimRequestError,
    out_of_vocabulary,
    parse_request,
)
from loadtest.sim.scheduler import SeqState
from loadtest.sim.shutdown import ENGINE_DEAD_BODY, ENGINE_DEAD_EVENT
from loadtest.sim.tokens import FillerText
from loadtest.sim.wire import (
    DONE,
    Kind,
    StreamFrame,
    error_body,
    full_response_of,
    new_id,
)


async def send_error(send: Send, exc: SimRequestError) -> None:
    body = error_body(
        message=exc.message, error_type=exc.error_type, param=exc.param, code=exc.status
    )
    await send_json(send, exc.status, body)


async def refuse_in_stream(send: Send, message: str, *, stream: bool) -> None:
    """What vLLM does with a request its engine refuses after the stream began: a 200 that
    carries one error event and [DONE]; unstreamed, a 400."""
    if not stream:
        await send_error(send, SimRequestError(message))
        return
    body = error_body(message=message, error_type="BadRequestError", param=None, code=400)
    await start_sse(send)
    await send_chunk(send, b"data: " + body + b"\n\n" + DONE, last=True)


class CompletionsEndpoint:
    """POST /v1/chat/completions or /v1/completions."""

    def __init__(
        self,
        *,
        kind: Kind,
        config: SimConfig,
        limits: Limits,
        engine: Engine,
        filler: FillerText,
        lengths: LengthSampler,
        connector: KvConnector | None = None,
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        """`connector`: the replica's KV connector, if any; `on_fatal` kills the replica,
        as a failed KV load kills vLLM's engine under `kv_load_failure_policy` fail."""
        self._kind = kind
        self._config = config
        self._limits = limits
        self._engine = engine
        self._filler = filler
        self._lengths = lengths
        self._connector = connector
        self._on_fatal = on_fatal
        # only a prefix cache or a connector needs the prompt's ids, not just their count
        self._token_ids = (
            config.enable_prefix_caching or connector is not None
        ) and not config.no_delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        try:
            req = parse_request(self._kind, raw, self._limits, token_ids=self._token_ids)
        except SimRequestError as exc:
            await send_error(send, exc)
            return
        if self._config.vocab_size is not None:
            refused = out_of_vocabulary(raw, self._config.vocab_size)
            if refused is not None:
                await refuse_in_stream(send, refused, stream=req.stream)
                return
        seqs = self._sequences(req)
        if self._config.no_delay:
            await self._answer_now(req, seqs, send)
            return
        if self._connector is not None and not await self._load(req, seqs, send):
            return
        try:
            self._submit(seqs)
        except EngineStopped:  # stopping (loadtest/sim/shutdown.py)
            await send_json(send, 500, ENGINE_DEAD_BODY)
            return
        except ValueError as exc:  # an answer longer than the whole KV cache
            await send_error(send, SimRequestError(str(exc)))
            return
        async with self._engine.serving(seqs, receive):
            if req.stream:
                await self._stream(req, seqs, send, scope)
            else:
                await self._complete(req, seqs, send, scope)

    async def _load(self, req: SimRequest, seqs: list[LiveSequence], send: Send) -> bool:
        """Ask the connector what the prompt may load; False when the load failed and
        killed the engine (the answer is then sent)."""
        assert self._connector is not None
        try:
            loaded = await self._connector.matched_tokens(
                params=req.kv_transfer_params,
                token_ids=req.prompt_token_ids,
                prompt=req.prompt_tokens,
            )
        except KvLoadError:
            if self._config.kv_load_failure_policy is KvLoadFailurePolicy.RECOMPUTE:
                return True
            self._on_fatal()
            # vLLM's stream has begun when its engine dies: the error comes as an event
            if req.stream:
                await start_sse(send)
                await send_chunk(send, ENGINE_DEAD_EVENT, last=True)
            else:
                await send_json(send, 500, ENGINE_DEAD_BODY)
            return False
        for seq in seqs:
            seq.external_tokens = loaded
        return True

    def _finished(
        self, req: SimRequest, seqs: list[LiveSequence], scope: Scope
    ) -> dict[str, object] | None:
        """The answer's `kv_transfer_params`, once its sequences have run."""
        if self._connector is None:
            return None
        server = scope.get("server")
        return self._connector.request_finished(
            params=req.kv_transfer_params,
            seq=seqs[0],
            token_ids=req.prompt_token_ids,
            server=None if server is None else (str(server[0]), int(server[1])),
        )

    def _sequences(self, req: SimRequest) -> list[LiveSequence]:
        """One sequence per choice, as vLLM runs `n`, each ending at its own sampled EOS;
        they share one progress event, so one reader follows them all."""
        seqs = []
        for index in range(req.n):
            answer = self._lengths.answer(
                cap=req.max_tokens, rule=req.stop, index=index, given=req.answer_start
            )
            reason = req.finish_reason if answer.finish is Finish.LENGTH else answer.finish
            seqs.append(
                LiveSequence(
                    prompt_tokens=req.prompt_tokens,
                    max_tokens=req.max_tokens,
                    answer_tokens=answer.tokens,
                    finish_reason=reason,
                    stop_reason=answer.stop_reason,
                    streaming=req.stream,
                    prompt_token_ids=req.prompt_token_ids,
                    adapter=req.adapter,
                )
            )
        for seq in seqs[1:]:
            seq.progress = seqs[0].progress
        return seqs

    def _submit(self, seqs: list[LiveSequence]) -> None:
        submitted: list[LiveSequence] = []
        try:
            for seq in seqs:
                self._engine.submit(seq)
                submitted.append(seq)
        except ValueError:
            for seq in submitted:
                self._engine.abort(seq)
            raise

    def _frames(self, req: SimRequest) -> list[StreamFrame]:
        response_id = new_id(self._kind)
        return [
            StreamFrame(
                kind=self._kind,
                model=req.served_model or self._config.model,
                filler=self._filler,
                include_usage=req.include_usage,
                index=index,
                response_id=response_id,
            )
            for index in range(req.n)
        ]

    async def _stream(
        self, req: SimRequest, seqs: list[LiveSequence], send: Send, scope: Scope
    ) -> None:
        frames = self._frames(req)
        progress = seqs[0].progress
        start = req.answer_start
        sent = [0] * len(seqs)
        started = False
        while True:
            await progress.wait()
            progress.clear()
            if any(seq.state is SeqState.ABORTED for seq in seqs):
                if self._engine.stopped:  # vLLM's headers went out with the request
                    if not started:
                        await start_sse(send)
                    await send_chunk(send, ENGINE_DEAD_EVENT, last=True)
                elif started:  # the client is gone: writes are dropped
                    await send_chunk(send, b"", last=True)
                else:
                    await send_error(send, _aborted())
                return
            parts = []
            if not started:
                await start_sse(send)
                started = True
                if self._kind is Kind.CHAT:
                    parts += [frame.role_chunk() for frame in frames]
            for i, seq in enumerate(seqs):
                generated = seq.generated
                if generated > sent[i]:
                    last = seq.state is SeqState.FINISHED
                    parts.append(
                        frames[i].tokens(
                            start + sent[i],
                            start + generated,
                            finish_reason=seq.finish_reason if last else None,
                            stop_reason=seq.stop_reason,
                        )
                    )
                    sent[i] = generated
            finished = all(seq.state is SeqState.FINISHED for seq in seqs)
            if finished:
                end = frames[0].end(prompt_tokens=req.prompt_tokens, completion_tokens=sum(sent))
                parts.append(end)
                self._finished(req, seqs, scope)
            await send_chunk(send, b"".join(parts), last=finished)
            if finished:
                return

    async def _complete(
        self, req: SimRequest, seqs: list[LiveSequence], send: Send, scope: Scope
    ) -> None:
        progress = seqs[0].progress
        while not all(seq.done for seq in seqs):
            await progress.wait()
            progress.clear()
        if any(seq.state is SeqState.ABORTED for seq in seqs):
            if self._engine.stopped:
                await send_json(send, 500, ENGINE_DEAD_BODY)
            else:
                await send_error(send, _aborted())
            return
        params = self._finished(req, seqs, scope)
        await send_json(send, 200, self._full(req, seqs, kv_transfer_params=params))

    def _full(
        self,
        req: SimRequest,
        seqs: list[LiveSequence],
        *,
        kv_transfer_params: dict[str, object] | None = None,
    ) -> bytes:
        return full_response_of(
            kind=self._kind,
            model=req.served_model or self._config.model,
            answers=[
                (
                    self._filler.text(req.answer_start, req.answer_start + seq.answer_tokens),
                    seq.finish_reason,
                    seq.stop_reason,
                )
                for seq in seqs
            ],
            prompt_tokens=req.prompt_tokens,
            completion_tokens=sum(seq.answer_tokens for seq in seqs),
            kv_transfer_params=kv_transfer_params,
        )

    async def _answer_now(self, req: SimRequest, seqs: list[LiveSequence], send: Send) -> None:
        stats = self._engine.scheduler.stats
        completion_tokens = sum(seq.answer_tokens for seq in seqs)
        stats.prompt_tokens += req.prompt_tokens
        stats.generation_tokens += completion_tokens
        stats.finished += 1
        if not req.stream:
            await send_json(send, 200, self._full(req, seqs))
            return
        frames = self._frames(req)
        head = b"".join(f.role_chunk() for f in frames) if self._kind is Kind.CHAT else b""
        start = req.answer_start
        tokens = b"".join(
            f.tokens(
                start,
                start + seq.answer_tokens,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for f, seq in zip(frames, seqs, strict=True)
        )
        end = frames[0].end(prompt_tokens=req.prompt_tokens, completion_tokens=completion_tokens)
        await start_sse(send)
        await send_chunk(send, head + tokens + end, last=True)


def _aborted() -> SimRequestError:
    """For a client that has left: it never reads this."""
    return SimRequestError("request aborted", status=503)
