"""The engine loop: step cost, waking readers, aborts."""

import asyncio

import pytest

from gateway.capacity.perf import StepCost
from loadtest.sim.config import DEFAULT_STEP_COST
from loadtest.sim.engine import Engine, LiveSequence
from loadtest.sim.scheduler import Scheduler, SchedulerLimits, SeqState, Step


def engine(*, speed: float = 1e6, flush: float = 0.0, ttfts: list[float] | None = None) -> Engine:
    scheduler: Scheduler[LiveSequence] = Scheduler(SchedulerLimits(num_blocks=65))
    record = ttfts.append if ttfts is not None else (lambda _: None)
    return Engine(
        scheduler=scheduler,
        step_cost=DEFAULT_STEP_COST,
        speed=speed,
        flush_interval_s=flush,
        on_first_token=record,
    )


def test_step_time_grows_with_context_and_prefill_and_shrinks_with_speed() -> None:
    slow, fast = engine(speed=1.0), engine(speed=10.0)
    decode_small = Step[LiveSequence](kv_tokens=1_000)
    decode_big = Step[LiveSequence](kv_tokens=100_000)
    prefill = Step[LiveSequence](kv_tokens=1_000, prefill_tokens=1_000)
    assert slow.step_seconds(decode_big) > slow.step_seconds(decode_small)
    assert slow.step_seconds(prefill) - slow.step_seconds(decode_small) == pytest.approx(
        DEFAULT_STEP_COST.prefill_s(1_000)
    )
    assert fast.step_seconds(decode_big) == pytest.approx(slow.step_seconds(decode_big) / 10)


async def drain(seq: LiveSequence) -> int:
    wakes = 0
    while not seq.done:
        await asyncio.wait_for(seq.progress.wait(), timeout=5)
        seq.progress.clear()
        wakes += 1
    return wakes


def test_sequences_run_to_their_length_and_report_first_token_once() -> None:
    ttfts: list[float] = []

    async def main() -> list[LiveSequence]:
        e = engine(ttfts=ttfts)
        task = asyncio.create_task(e.run())
        seqs = [LiveSequence(prompt_tokens=20, max_tokens=30, streaming=s) for s in (True, False)]
        for s in seqs:
            e.submit(s)
        await asyncio.gather(*(drain(s) for s in seqs))
        task.cancel()
        return seqs

    seqs = asyncio.run(main())
    assert [s.generated for s in seqs] == [30, 30]
    assert all(s.state is SeqState.FINISHED for s in seqs)
    assert len(ttfts) == 2 and all(t >= 0 for t in ttfts)


def test_a_long_flush_interval_wakes_a_stream_only_for_its_first_token_and_end() -> None:
    async def main() -> int:
        e = engine(flush=60.0)
        task = asyncio.create_task(e.run())
        seq = LiveSequence(prompt_tokens=20, max_tokens=40, streaming=True)
        e.submit(seq)
        wakes = await drain(seq)
        task.cancel()
        return wakes

    assert 1 <= asyncio.run(main()) <= 2


def test_abort_frees_the_cache_and_wakes_the_reader() -> None:
    async def main() -> tuple[int, SeqState]:
        e = engine(speed=1.0)  # real time: 1,000 tokens take about 8 s
        task = asyncio.create_task(e.run())
        seq = LiveSequence(prompt_tokens=20, max_tokens=1000, streaming=True)
        e.submit(seq)
        await asyncio.wait_for(seq.progress.wait(), timeout=5)  # first token
        seq.progress.clear()
        e.abort(seq)
        await asyncio.wait_for(seq.progress.wait(), timeout=1)
        task.cancel()
        return e.scheduler.used_blocks, seq.state

    assert asyncio.run(main()) == (0, SeqState.ABORTED)


def test_close_aborts_everything_so_every_reader_returns() -> None:
    async def main() -> list[SeqState]:
        e = engine(speed=1.0)
        seqs = [LiveSequence(prompt_tokens=16, max_tokens=500, streaming=False) for _ in range(3)]
        for s in seqs:
            e.submit(s)
        e.close()
        await asyncio.gather(*(drain(s) for s in seqs))
        return [s.state for s in seqs]

    assert asyncio.run(main()) == [SeqState.ABORTED] * 3


class BrokenCost(StepCost):
    def decode_step_s(self, batch_kv_tokens: int) -> float:
        raise ArithmeticError("cost model broke")


def test_a_failing_engine_releases_its_readers_and_refuses_new_work() -> None:
    async def main() -> tuple[SeqState, bool]:
        cost = BrokenCost(**DEFAULT_STEP_COST.__dict__)
        e = Engine(
            scheduler=Scheduler(SchedulerLimits(num_blocks=8)),
            step_cost=cost,
            speed=1.0,
            flush_interval_s=0.0,
            on_first_token=lambda _: None,
        )
        seq = LiveSequence(prompt_tokens=16, max_tokens=4, streaming=True)
        e.submit(seq)
        with pytest.raises(ArithmeticError):
            await e.run()
        with pytest.raises(RuntimeError):
            e.submit(LiveSequence(prompt_tokens=16, max_tokens=4, streaming=True))
        return seq.state, seq.progress.is_set()

    assert asyncio.run(main()) == (SeqState.ABORTED, True)
