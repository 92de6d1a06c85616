"""The replica's KV usage reads as vLLM's: used blocks over the blocks sequences may hold."""

from pathlib import Path

from gateway.admission.fleet.metrics_text import samples, values
from loadtest.sim.config import SimConfig, resolve
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.scheduler import Scheduler, SchedulerLimits, SeqState, Sequence
from loadtest.sim.tokens import chat_prompt_ids


def usage(scheduler: Scheduler[Sequence], config: SimConfig) -> float:
    metrics = SimMetrics(config=config, resolved=resolve(config), scheduler=scheduler)
    found = values(samples(metrics.render().decode()), "vllm:kv_cache_usage_perc")
    assert found, "no vllm:kv_cache_usage_perc"
    return found[0]


def test_kv_usage_leaves_the_null_block_out_so_a_full_cache_reads_one() -> None:
    config = SimConfig(kv_tokens=32 * 16, block_size=16)  # 32 blocks, 31 usable
    scheduler: Scheduler[Sequence] = Scheduler(SchedulerLimits(num_blocks=32, block_size=16))
    assert usage(scheduler, config) == 0.0
    scheduler.add(Sequence(prompt_tokens=150, max_tokens=8))  # 10 whole blocks
    scheduler.schedule()
    assert scheduler.used_blocks == 10
    assert usage(scheduler, config) == 10 / 31
    scheduler.add(Sequence(prompt_tokens=21 * 16, max_tokens=1))  # the 21 blocks left
    scheduler.schedule()
    assert scheduler.free_blocks == 0 and usage(scheduler, config) == 1.0


FIXTURE = Path(__file__).parents[3] / "fixtures" / "vllm-0.32-metrics.txt"


def described(text: str, name: str) -> list[str]:
    return [
        line for line in text.splitlines() if line.startswith(("# HELP " + name, "# TYPE " + name))
    ]


def test_prefix_cache_counters_are_named_and_described_as_real_vllms() -> None:
    config = SimConfig(kv_tokens=32 * 16, block_size=16, model="tiny")
    scheduler: Scheduler[Sequence] = Scheduler(SchedulerLimits(num_blocks=32, block_size=16))
    scheduler.stats.prefix_cache_queries, scheduler.stats.prefix_cache_hits = 160, 48
    ours = SimMetrics(config=config, resolved=resolve(config), scheduler=scheduler).render()
    real = FIXTURE.read_text()
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert described(ours.decode(), name) == described(real, name) != []
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 160.0' in ours.decode()
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 48.0' in ours.decode()


def test_cached_blocks_nobody_holds_count_as_free_in_kv_usage() -> None:
    config = SimConfig(kv_tokens=32 * 16, block_size=16)
    scheduler: Scheduler[Sequence] = Scheduler(SchedulerLimits(num_blocks=32, block_size=16))
    seq = Sequence(prompt_tokens=64, max_tokens=1, prompt_token_ids=list(range(64)))
    scheduler.add(seq)
    scheduler.complete(scheduler.schedule())
    assert seq.state is SeqState.FINISHED and scheduler.pool.num_cached == 4
    assert usage(scheduler, config) == 0.0


def test_a_prefix_ten_running_chats_share_is_counted_once_in_kv_usage() -> None:
    """As vLLM's block pool does: the system message's full blocks are held once, with a
    reference each, and every chat adds only the blocks of its own tail."""
    config = SimConfig(kv_tokens=64 * 16, block_size=16)  # 63 usable blocks
    scheduler: Scheduler[Sequence] = Scheduler(SchedulerLimits(num_blocks=64, block_size=16))
    system = {"role": "system", "content": "the fleet holds every token " * 45}
    chats = [
        chat_prompt_ids([system, {"role": "user", "content": f"question {i} " * 3}])
        for i in range(10)
    ]
    common = next(i for i, ids in enumerate(zip(*chats, strict=False)) if len(set(ids)) > 1)
    shared = common // 16
    own = [-(-len(ids) // 16) - shared for ids in chats]
    assert shared == 20 and own == [1] * 10  # unshared: 210 blocks, more than the cache
    seqs = [Sequence(prompt_tokens=len(ids), max_tokens=4, prompt_token_ids=ids) for ids in chats]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.complete(scheduler.schedule())
    assert all(seq.state is SeqState.RUNNING for seq in seqs)
    assert scheduler.used_blocks == shared + sum(own) == 30
    assert usage(scheduler, config) == 30 / 63
    while scheduler.has_work:
        scheduler.complete(scheduler.schedule())
    assert usage(scheduler, config) == 0.0
