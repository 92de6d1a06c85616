"""Continuous batching over a block KV cache: admission, growth, preemption, abort."""

import pytest

from loadtest.sim.scheduler import Scheduler, SchedulerLimits, SeqState, Sequence


def make(usable_blocks: int, **kw: int) -> Scheduler[Sequence]:
    """A scheduler whose sequences may hold `usable_blocks`: vLLM keeps one more back."""
    return Scheduler(SchedulerLimits(num_blocks=usable_blocks + 1, block_size=16, **kw))


def seq(prompt: int, out: int) -> Sequence:
    return Sequence(prompt_tokens=prompt, max_tokens=out)


def run_step(s: Scheduler[Sequence]) -> list[Sequence]:
    return s.complete(s.schedule())


def test_prefill_allocates_whole_blocks_for_the_prompt() -> None:
    s = make(10)
    a = seq(17, 4)
    s.add(a)
    step = s.schedule()
    assert step.prefills == [a] and step.prefill_tokens == 17
    assert a.blocks == 2 and s.free_blocks == 8
    s.complete(step)
    assert a.generated == 1 and s.stats.prompt_tokens == 17


def test_a_running_sequence_takes_a_new_block_only_when_it_crosses_a_boundary() -> None:
    s = make(10)
    a = seq(15, 10)
    s.add(a)
    run_step(s)  # prefill: 15 tokens in 1 block, first token sampled
    assert a.blocks == 1
    run_step(s)  # computes token 16: still one block
    assert a.blocks == 1 and a.generated == 2
    run_step(s)  # token 17 needs a second block
    assert a.blocks == 2 and s.free_blocks == 8


def test_finished_sequence_frees_its_blocks_at_once() -> None:
    s = make(4)
    a = seq(16, 3)
    s.add(a)
    finished = []
    for _ in range(3):
        finished += run_step(s)
    assert finished == [a] and a.state is SeqState.FINISHED
    assert s.free_blocks == 4 and s.running == [] and s.stats.generation_tokens == 3


def test_requests_wait_in_fifo_order_while_the_cache_is_full() -> None:
    s = make(4)
    first, second, third = seq(30, 2), seq(30, 2), seq(16, 2)
    for x in (first, second, third):
        s.add(x)
    step = s.schedule()
    assert step.prefills == [first, second]
    assert list(s.waiting) == [third]  # third would fit in no block: the cache is full
    s.complete(step)
    run_step(s)  # both finish
    step = s.schedule()
    assert step.prefills == [third]


def test_a_large_head_of_line_request_is_not_overtaken() -> None:
    s = make(4)
    small_running = seq(32, 5)
    s.add(small_running)
    run_step(s)
    big, small = seq(48, 2), seq(16, 2)
    s.add(big)
    s.add(small)
    step = s.schedule()
    assert step.prefills == []  # big does not fit; small would, but waits behind it
    assert list(s.waiting) == [big, small]


def test_newest_running_sequence_is_preempted_and_goes_back_to_the_front() -> None:
    s = make(3)
    old, mid, new = seq(16, 17), seq(8, 9), seq(8, 9)
    for x in (old, mid, new):
        s.add(x)
    run_step(s)  # all three admitted, one block each: the cache is full
    late = seq(8, 2)
    s.add(late)
    step = s.schedule()  # old crosses into a second block: the newest is evicted for it
    assert new.state is SeqState.WAITING and new.blocks == 0 and new.preemptions == 1
    assert list(s.waiting) == [new, late]
    assert step.decodes == [old, mid] and step.prefills == []  # no admission after preemption
    assert s.stats.preemptions == 1 and old.blocks == 2


def test_preemption_goes_on_until_the_needy_sequence_fits_even_if_it_is_evicted_itself() -> None:
    s = make(3)
    old, mid, new = seq(16, 17), seq(16, 17), seq(16, 17)
    for x in (old, mid, new):
        s.add(x)
    run_step(s)
    step = s.schedule()  # old evicts new; then mid needs a block and is itself the newest
    assert step.decodes == [old]
    assert list(s.waiting) == [mid, new] and s.stats.preemptions == 2
    assert s.used_blocks == 2


def test_preempted_sequence_recomputes_its_prompt_and_output_and_keeps_its_tokens() -> None:
    s = make(3)
    a, b = seq(16, 30), seq(16, 30)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)  # a and b both grow into a second block: 4 blocks > 3, b is evicted
    assert b.state is SeqState.WAITING and b.generated == 1
    while a.state is not SeqState.FINISHED:
        run_step(s)
    step = s.schedule()
    assert step.prefills == [b] and step.prefill_tokens == 16 + 1
    s.complete(step)
    assert b.generated == 2
    assert s.stats.prompt_tokens == 32  # the recompute is not counted as new prompt


def test_abort_frees_blocks_wherever_the_sequence_is() -> None:
    s = make(2)
    running, waiting = seq(30, 2), seq(16, 5)
    s.add(running)
    s.add(waiting)
    run_step(s)
    assert s.free_blocks == 0
    s.abort(running)
    assert s.free_blocks == 2 and running.state is SeqState.ABORTED and s.running == []
    s.abort(waiting)
    assert not s.waiting and s.stats.aborted == 2 and s.reserved_tokens == 0
    s.abort(waiting)  # twice is harmless
    assert s.stats.aborted == 2


def test_aborted_during_a_step_gains_no_token() -> None:
    s = make(4)
    a = seq(16, 5)
    s.add(a)
    step = s.schedule()
    s.abort(a)
    assert s.complete(step) == [] and a.generated == 0 and s.stats.generation_tokens == 0


def test_max_num_seqs_caps_the_batch() -> None:
    s = make(100, max_num_seqs=2)
    for _ in range(3):
        s.add(seq(16, 5))
    step = s.schedule()
    assert len(step.prefills) == 2 and len(s.waiting) == 1


def test_the_step_token_budget_limits_prefills_but_always_admits_one() -> None:
    s = make(100, max_num_batched_tokens=40)
    huge, a, b = seq(64, 2), seq(24, 2), seq(24, 2)
    for x in (huge, a, b):
        s.add(x)
    assert s.schedule().prefills == [huge]  # over the budget alone, admitted as the first
    step = s.schedule()  # 1 decode leaves 39: a takes 24, b would need 24 of the 15 left
    assert step.prefills == [a] and list(s.waiting) == [b]


def test_reserved_tokens_and_peaks_track_what_a_gateway_would_have_reserved() -> None:
    s = make(10)
    a, b = seq(20, 10), seq(30, 5)
    s.add(a)
    s.add(b)
    assert s.reserved_tokens == 65 and s.stats.peak_reserved_tokens == 65
    for _ in range(10):
        run_step(s)
    assert s.reserved_tokens == 0 and s.stats.peak_reserved_tokens == 65
    assert s.stats.peak_running == 2 and s.stats.peak_kv_blocks == 5  # b grows to 3 blocks


def test_a_sequence_that_could_never_fit_is_refused() -> None:
    s = make(2)
    with pytest.raises(ValueError):
        s.add(seq(30, 10))
    with pytest.raises(ValueError):
        seq(0, 1)


def test_one_block_is_kept_back_as_vllm_does() -> None:
    s = Scheduler(SchedulerLimits(num_blocks=32, block_size=128))
    assert s.free_blocks == 31 and s.used_blocks == 0
    with pytest.raises(ValueError):
        s.add(seq(3900, 100))  # 32 blocks' worth: fits the pool, not its usable part
    with pytest.raises(ValueError):
        SchedulerLimits(num_blocks=1)


def test_seven_sequences_under_a_token_limit_need_more_blocks_than_vllm_has() -> None:
    # the real server's case: 7 x (106 + 412) = 3,626 tokens fit a 3,686-token limit
    # (4,096 x 0.9), but each sequence grows to 5 blocks of 128: 35 blocks of 31
    s = Scheduler(SchedulerLimits(num_blocks=32, block_size=128))
    seqs = [seq(106, 412) for _ in range(7)]
    for sq in seqs:
        s.add(sq)
    while s.has_work:
        run_step(s)
    assert s.stats.preemptions > 0 and s.stats.finished == 7
    five = Scheduler(SchedulerLimits(num_blocks=32, block_size=128))
    for _ in range(6):  # 6 x 5 = 30 blocks: never preempted
        five.add(seq(106, 412))
    while five.has_work:
        run_step(five)
    assert five.stats.preemptions == 0 and five.stats.finished == 6
