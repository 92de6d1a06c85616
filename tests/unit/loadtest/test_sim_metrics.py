"""The replica's KV usage reads as vLLM's: used blocks over the blocks sequences may hold."""

from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim_config import SimConfig, resolve
from loadtest.sim_metrics import SimMetrics
from loadtest.sim_scheduler import Scheduler, SchedulerLimits, Sequence


def usage(scheduler: Scheduler[Sequence], config: SimConfig) -> float:
    metrics = SimMetrics(config=config, resolved=resolve(config), scheduler=scheduler)
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name == "vllm:kv_cache_usage_perc":
            return float(family.samples[0].value)
    raise AssertionError("no vllm:kv_cache_usage_perc")


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
