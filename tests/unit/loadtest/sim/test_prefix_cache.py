"""Prefix caching in the scheduler: shared leading blocks are reused, counted and evicted LRU."""

from loadtest.sim.blocks import hash_blocks
from loadtest.sim.scheduler import Scheduler, SchedulerLimits, SeqState, Sequence


def make(usable_blocks: int, *, prefix_caching: bool = True) -> Scheduler[Sequence]:
    limits = SchedulerLimits(
        num_blocks=usable_blocks + 1, block_size=16, prefix_caching=prefix_caching
    )
    return Scheduler(limits)


def seq(ids: list[int], out: int) -> Sequence:
    return Sequence(prompt_tokens=len(ids), max_tokens=out, prompt_token_ids=ids)


def run_alone(s: Scheduler[Sequence], x: Sequence) -> None:
    s.add(x)
    while not x.done:
        s.complete(s.schedule())


def cached_blocks(s: Scheduler[Sequence], ids: list[int]) -> list[int]:
    return s.pool.cached_prefix(hash_blocks(ids, 16))


SYSTEM = list(range(1000, 1048))  # three full blocks


def test_a_prompt_sharing_a_running_prompts_blocks_holds_them_too_and_computes_the_rest() -> None:
    s = make(10)
    a = seq(SYSTEM, 10)
    s.add(a)
    s.complete(s.schedule())  # a: 3 blocks, all full, all cached
    b = seq(SYSTEM + list(range(16)), 4)
    s.add(b)
    step = s.schedule()  # a's decode takes a 4th block; b shares a's 3 and adds 1
    assert step.prefills == [b] and step.prefill_tokens == 16 and step.kv_tokens == 49 + 64
    assert b.block_ids[:3] == a.block_ids[:3] and len(b.block_ids) == 4
    assert s.used_blocks == 5
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (48 + 64, 48)


def test_a_finished_prompts_full_blocks_stay_cached_and_make_the_next_prefill_cheaper() -> None:
    s = make(10)
    run_alone(s, seq([*SYSTEM, 1, 2], 3))  # 50 tokens: 3 full blocks cached, 4 blocks freed
    assert s.free_blocks == 10 and s.pool.num_cached == 3
    b = seq(SYSTEM + [7] * 12, 1)
    s.add(b)
    step = s.schedule()
    assert step.prefill_tokens == 12
    assert s.stats.prefix_cache_queries == 50 + 60 and s.stats.prefix_cache_hits == 48
    assert s.used_blocks == 4  # the 3 cached blocks left the free queue; 1 new block


def test_the_last_prompt_token_is_always_computed_even_when_every_block_is_cached() -> None:
    s = make(10)
    run_alone(s, seq(SYSTEM, 1))
    again = seq(SYSTEM, 1)
    s.add(again)
    step = s.schedule()
    # the third block holds the last token: it is computed again, not hit
    assert step.prefill_tokens == 16 and s.stats.prefix_cache_hits == 32


def test_free_cached_blocks_are_evicted_least_recently_used_first() -> None:
    s = make(6)
    first, second, third = ([n] * 32 for n in (1, 2, 3))
    for ids in (first, second, third):
        run_alone(s, seq(ids, 1))  # each leaves 2 cached free blocks
    assert s.free_blocks == 6 and s.pool.num_cached == 6
    run_alone(s, seq([4] * 40, 1))  # 3 new blocks: first's two, then second's last
    assert [len(cached_blocks(s, ids)) for ids in (first, second, third)] == [0, 1, 2]


def test_blocks_a_running_sequence_holds_are_never_evicted() -> None:
    s = make(4)
    old = [5] * 32
    run_alone(s, seq(old, 1))  # blocks 0 and 1 cached and free
    held = [6] * 20
    running = seq(held, 10)
    s.add(running)
    s.complete(s.schedule())  # takes the 2 never-used blocks; caches its one full block
    newcomer = seq([7] * 32, 1)
    s.add(newcomer)
    s.schedule()  # takes the last 2 free blocks: the old prompt's
    assert cached_blocks(s, old) == [] and cached_blocks(s, held) == running.block_ids[:1]
    late = seq([8] * 16, 1)
    s.add(late)
    s.schedule()
    assert late.state is SeqState.WAITING and s.free_blocks == 0
    assert cached_blocks(s, held) == running.block_ids[:1]


def test_a_preempted_sequence_reuses_its_cached_prompt_but_is_not_counted_again() -> None:
    s = make(4)
    a = seq(SYSTEM[:20], 20)  # 20 prompt tokens: 1 full block cached, 2 blocks held
    b = seq(list(range(20)), 20)
    s.add(a)
    s.add(b)
    s.complete(s.schedule())  # both prefilled: the 4 blocks are held
    while b.state is SeqState.RUNNING:
        s.complete(s.schedule())  # a crossing into a third block preempts the newest: b
    assert b.preemptions == 1 and s.stats.prefix_cache_queries == 40
    while a.state is SeqState.RUNNING:
        s.complete(s.schedule())
    step = s.schedule()  # b back: prompt + generated recomputed but its first block hit
    assert step.prefills == [b] and (b.context_tokens, step.prefill_tokens) == (33, 17)
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (40, 0)


def test_with_prefix_caching_off_nothing_is_looked_up_or_hit() -> None:
    s = make(10, prefix_caching=False)
    run_alone(s, seq([*SYSTEM, 1, 2], 3))
    b = seq(SYSTEM + [7] * 12, 1)
    s.add(b)
    step = s.schedule()
    assert step.prefill_tokens == 60 and s.pool.num_cached == 0
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (0, 0)


def test_a_prompt_without_token_ids_is_looked_up_and_never_hits() -> None:
    s = make(10)
    run_alone(s, Sequence(prompt_tokens=48, max_tokens=1))
    run_alone(s, Sequence(prompt_tokens=48, max_tokens=1))
    assert (s.stats.prefix_cache_queries, s.stats.prefix_cache_hits) == (96, 0)
