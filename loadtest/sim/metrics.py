"""The simulated replica's /metrics: vLLM's own names and labels, plus a few simulator extras.

Engine state is read at scrape time by a collector, so stepping costs nothing here; only
time-to-first-token is a live histogram. With LoRA, `vllm:lora_requests_info` is set at each
step as vLLM 0.32 sets it: a gauge whose value is the time of the last step that saw its
labels, one series per set of active adapters ever seen (never removed; the newest is the
present), both adapter labels holding the same names (vLLM fills them from one table), and
no series before the engine has stepped (a step of base-model requests only adds the series
of no adapter). Names starting `sim_` are not vLLM metrics: they let tests and drills prove
the backend was never over-filled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loadtest.sim.config import ResolvedSim, SimConfig
from loadtest.sim.scheduler import Scheduler

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LABELS = ("engine", "model_name")
EXTRA = "Simulator extra, not a vLLM metric: "


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's buckets for its token-count histograms: 1, 2, 5, 10, 20, 50, ... while under
    the context length."""
    buckets: list[float] = []
    magnitude = 1
    while True:
        for step in (1, 2, 5):
            if step * magnitude > max_model_len:
                return buckets
            buckets.append(float(step * magnitude))
        magnitude *= 10


class LoraInfo(Collector):
    """`vllm:lora_requests_info`: a series per set of active adapters, its value the time
    of the last step that saw that set."""

    LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")

    def __init__(
        self,
        *,
        scheduler: Scheduler[Any],
        max_loras: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._active = scheduler.active_adapters
        self._max_lora = str(max_loras)
        self._clock = clock
        self._seen: dict[str, float] = {}  # the adapters' names joined -> last step's time

    def observe_step(self) -> None:
        self._seen[",".join(self._active)] = self._clock()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.", labels=self.LABELS
        )
        for names, at in self._seen.items():
            family.add_metric([self._max_lora, names, names], at)
        yield family


class _EngineCollector(Collector):
    def __init__(
        self, *, scheduler: Scheduler[Any], labels: list[str], cache_info: dict[str, str]
    ) -> None:
        self._scheduler = scheduler
        self._labels = labels
        self._cache_info = cache_info

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self._scheduler
        stats, limits = s.stats, s.limits
        yield from (
            self._gauge(
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                len(s.running),
            ),
            self._gauge(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                len(s.waiting),
            ),
            self._gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                # vLLM's block pool leaves its null block out of the count, so a full
                # cache reads 1.0
                s.used_blocks / limits.usable_blocks,
            ),
            self._counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_cache_queries,
            ),
            self._counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_cache_hits,
            ),
            self._counter(
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                stats.preemptions,
            ),
            self._counter(
                "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
            ),
            self._counter(
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                stats.generation_tokens,
            ),
        )
        # vLLM exports these with or without a KV connector: 0 without
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            stats.external_prefix_cache_queries,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            stats.external_prefix_cache_hits,
        )
        yield self._prompt_sources()
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_info),
        )
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info
        yield from self._extras()

    def _prompt_sources(self) -> CounterMetricFamily:
        stats = self._scheduler.stats
        family = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*LABELS, "source"],
        )
        for source, value in (
            ("local_compute", stats.prompt_tokens_local_compute),
            ("local_cache_hit", stats.prompt_tokens_local_cache_hit),
            ("external_kv_transfer", stats.prompt_tokens_external),
        ):
            family.add_metric([*self._labels, source], value)
        return family

    def _extras(self) -> Iterator[Metric]:
        s = self._scheduler
        stats, bs = s.stats, s.limits.block_size
        gauges = {
            "sim_kv_capacity_tokens": ("KV cache size in tokens.", s.limits.num_blocks * bs),
            "sim_peak_kv_tokens": (
                "most KV tokens (whole blocks) ever allocated.",
                stats.peak_kv_blocks * bs,
            ),
            "sim_peak_running": ("most requests ever running at once.", stats.peak_running),
            "sim_peak_waiting": ("most requests ever waiting at once.", stats.peak_waiting),
            "sim_reserved_tokens": (
                "prompt + max_tokens of the requests present now.",
                s.reserved_tokens,
            ),
            "sim_peak_reserved_tokens": (
                "most prompt + max_tokens ever present at once.",
                stats.peak_reserved_tokens,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield self._gauge(name, EXTRA + doc, value)
        yield self._counter(
            "sim_requests_finished", EXTRA + "requests run to their end.", stats.finished
        )
        yield self._counter("sim_requests_aborted", EXTRA + "requests aborted.", stats.aborted)


class SimMetrics:
    def __init__(
        self, *, config: SimConfig, resolved: ResolvedSim, scheduler: Scheduler[Any]
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["0", config.model]
        cache_info = {
            "block_size": str(resolved.block_size),
            "cache_dtype": config.kv_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "kv_cache_size_tokens": str(resolved.kv_tokens),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(resolved.num_blocks),
        }
        self.registry.register(
            _EngineCollector(scheduler=scheduler, labels=labels, cache_info=cache_info)
        )
        self.lora: LoraInfo | None = None
        if config.enable_lora:
            self.lora = LoraInfo(scheduler=scheduler, max_loras=config.max_loras)
            self.registry.register(self.lora)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*labels)
        self._generated = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labelnames=LABELS,
            buckets=token_buckets(resolved.max_model_len),
            registry=self.registry,
        ).labels(*labels)

    def observe_generated(self, tokens: int) -> None:
        """A request finished, having generated `tokens` (vLLM counts each when it ends)."""
        self._generated.observe(tokens)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
