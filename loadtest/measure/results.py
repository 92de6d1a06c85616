"""What `spillgate measure` finds: each level's figures, the endpoint's KV pool read from its
metrics text, and the run as a whole (what the report prints and charts)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.fleet.metrics_text import samples, total
from loadtest.measure.stream import Sample


@dataclass(frozen=True, kw_only=True)
class Level:
    concurrency: int
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens_per_s: float
    peak_running: int | None
    prompt_tokens: float  # the endpoint's own count, the mean of the level's requests
    first_error: str | None = None


@dataclass(frozen=True, kw_only=True)
class EndpointKv:
    num_gpu_blocks: int
    block_size: int


def endpoint_kv(text: str) -> EndpointKv | None:
    for sample in samples(text, ("vllm:cache_config_info",)):
        labels = sample.labels
        if labels.get("num_gpu_blocks", "").isdigit():
            return EndpointKv(
                num_gpu_blocks=int(labels["num_gpu_blocks"]), block_size=int(labels["block_size"])
            )
    return None


RUNNING = "vllm:num_requests_running"


def running_now(text: str) -> int | None:
    running = total(samples(text, (RUNNING,)), RUNNING)
    return None if running is None else round(running)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    levels: list[Level]
    kv: EndpointKv | None
    max_model_len: int | None


def steady_tokens_per_s(workers: list[list[Sample]]) -> float:
    """Tokens streamed while every client was busy, over that window."""
    busy = [w for w in workers if w]
    start = max(w[0].started for w in busy)
    end = min(w[-1].ended for w in busy)
    samples = [s for w in busy for s in w]
    if end - start <= 0 or len(busy[0]) < 2:
        wall = max(s.ended for s in samples) - min(s.started for s in samples)
        return sum(s.completion_tokens for s in samples) / wall
    tokens = sum(s.tokens_in(a) for s in samples for a in s.arrivals if start <= a.at <= end)
    return tokens / (end - start)
