"""The engine loop: one asyncio task steps the scheduler in (scaled) real time.

Each step lasts `StepCost.decode_step_s(kv read) + prefill_s(prefill tokens)`, divided by
`speed`. Steps are laid on a timeline, so the loop's own overhead is absorbed while steps
are longer than it; when the loop falls behind it runs steps back to back, yielding to the
event loop every few milliseconds, and readers then pick up several tokens per wake-up.

`hold` stops stepping for a while, as vLLM's engine core stops while it runs a utility call
between two steps (loading a LoRA adapter): the requests in flight stall, and their lost time
is not caught up afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as TokenIds

from starlette.types import Receive

from gateway.capacity.perf import StepCost
from loadtest.sim.asgi import wait_disconnect
from loadtest.sim.config import Adapter
from loadtest.sim.scheduler import Scheduler, SeqState, Sequence, Step

MAX_LAG_S = 0.5  # simulated time owed after a stall is caught up, up to this much
MAX_BURST_S = 0.005  # longest run of back-to-back steps before yielding to the event loop


class EngineStopped(RuntimeError):
    """The engine takes no more sequences: it was closed, or its loop failed."""


class LiveSequence(Sequence):
    """A sequence with a reader waiting on it.

    `progress` is set when the reader has something to do: the end or an abort, and for
    a streaming reader also the first token and new tokens, at most once per flush interval.
    """

    __slots__ = (
        "arrived",
        "finish_reason",
        "first_token_at",
        "next_flush",
        "progress",
        "stop_reason",
        "streaming",
    )

    def __init__(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int,
        streaming: bool,
        answer_tokens: int | None = None,
        finish_reason: str = "length",
        stop_reason: int | None = None,
        prompt_token_ids: TokenIds[int] | None = None,
        adapter: Adapter | None = None,
    ) -> None:
        super().__init__(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            answer_tokens=answer_tokens,
            prompt_token_ids=prompt_token_ids,
            adapter=adapter,
        )
        self.streaming = streaming
        self.finish_reason = finish_reason  # what the last event says
        self.stop_reason = stop_reason
        self.progress = asyncio.Event()
        self.arrived = 0.0
        self.next_flush = 0.0
        self.first_token_at: float | None = None


class Engine:
    def __init__(
        self,
        *,
        scheduler: Scheduler[LiveSequence],
        step_cost: StepCost,
        speed: float,
        flush_interval_s: float,
        on_first_token: Callable[[float], None],
        on_finished: Callable[[int], None] = lambda generated: None,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        """`on_step`, when given, is called after each step, as vLLM records its scheduler
        stats once a step."""
        self.scheduler = scheduler
        self._cost = step_cost
        self._speed = speed
        self._flush_interval = flush_interval_s
        self._on_first_token = on_first_token
        self._on_finished = on_finished
        self._on_step = on_step
        self._wake = asyncio.Event()
        self._held_until = 0.0  # the event loop's time before which no step starts
        self.stopped = False

    def step_seconds(self, step: Step[LiveSequence]) -> float:
        cost = self._cost
        return (cost.decode_step_s(step.kv_tokens) + cost.prefill_s(step.prefill_tokens)) / (
            self._speed
        )

    def submit(self, seq: LiveSequence) -> None:
        if self.stopped:
            raise EngineStopped("the engine loop has stopped")
        seq.arrived = asyncio.get_running_loop().time()
        self.scheduler.add(seq)
        self._wake.set()

    def hold(self, seconds: float) -> None:
        """Start no step for `seconds` from now (a step under way ends first)."""
        until = asyncio.get_running_loop().time() + seconds
        self._held_until = max(self._held_until, until)

    def abort(self, seq: LiveSequence) -> None:
        """Free the sequence's KV now and wake its reader."""
        self.scheduler.abort(seq)
        seq.progress.set()

    @contextlib.asynccontextmanager
    async def serving(self, seqs: list[LiveSequence], receive: Receive) -> AsyncIterator[None]:
        """While an answer to `seqs` is written: they are aborted as soon as its client
        leaves, and when the answer ends without them finished (an error, a cancellation),
        so their KV never outlives the request."""

        def abort_unfinished() -> None:
            for seq in seqs:
                if not seq.done:
                    self.abort(seq)

        async def on_disconnect() -> None:
            await wait_disconnect(receive)
            abort_unfinished()

        watcher = asyncio.create_task(on_disconnect())
        try:
            yield
        finally:
            watcher.cancel()
            abort_unfinished()

    def close(self) -> None:
        """Stop taking sequences and abort everything, so every reader returns; readers
        tell an abort of this kind by `stopped`."""
        self.stopped = True
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self.abort(seq)

    async def run(self) -> None:
        """Step until cancelled; if stepping ever fails, every reader is released first."""
        try:
            await self._run()
        except Exception:
            self.close()
            raise

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        target = yield_at = loop.time()
        while True:
            if not self.scheduler.has_work:
                await self._idle()
                target = yield_at = loop.time()
            if self._held_until > loop.time():
                await asyncio.sleep(self._held_until - loop.time())
                target = yield_at = loop.time()
            step = self.scheduler.schedule()
            if step.empty:
                await self._idle()
                continue
            now = loop.time()
            target = max(target, now - MAX_LAG_S) + self.step_seconds(step)
            if target > now or now >= yield_at:
                await asyncio.sleep(max(target - now, 0.0))
                yield_at = loop.time() + MAX_BURST_S
            self._finish(step, loop.time())

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _finish(self, step: Step[LiveSequence], now: float) -> None:
        finished = self.scheduler.complete(step)
        if self._on_step is not None:
            self._on_step()
        next_flush = now + self._flush_interval
        for seq in step.prefills:
            if seq.first_token_at is None and seq.state is not SeqState.ABORTED:
                seq.first_token_at = now
                self._on_first_token(now - seq.arrived)
                if seq.streaming:
                    seq.next_flush = next_flush
                    seq.progress.set()
        for seq in step.decodes:
            if seq.streaming and seq.next_flush <= now:
                seq.next_flush = next_flush
                seq.progress.set()
        for seq in finished:
            self._on_finished(seq.generated)
            seq.progress.set()
