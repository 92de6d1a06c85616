"""The pure parts of `spillgate measure`: metrics parsing, percentiles, the steady window."""

from __future__ import annotations

import pytest

from gateway.capacity import replica_profile, throughput
from loadtest.measure import (
    EndpointKv,
    Sample,
    endpoint_kv,
    percentile,
    prompt_ids,
    running_now,
    steady_tokens_per_s,
)
from loadtest.measure_report import Prediction, endpoint_sessions

# Lines as a vLLM 0.32 server exports them (labels trimmed to the ones read here and a few).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",\
gpu_memory_utilization="0.92",kv_cache_size_tokens="1048576",num_gpu_blocks="8192",\
sliding_window="None"} 1.0
"""


def test_endpoint_kv_and_running_from_vllm_metrics() -> None:
    assert endpoint_kv(VLLM_METRICS) == EndpointKv(num_gpu_blocks=8192, block_size=128)
    assert running_now(VLLM_METRICS) == 5
    assert endpoint_kv("# nothing here\n") is None and running_now("") is None


def test_endpoint_sessions_count_whole_blocks_per_session() -> None:
    kv = EndpointKv(num_gpu_blocks=1719, block_size=16)
    workload = throughput.Workload(prompt_tokens=2000, output_tokens=32)
    assert endpoint_sessions(kv, workload) == 1719 // 127
    assert endpoint_sessions(None, workload) is None


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


def test_prompts_are_distinct_from_the_first_token() -> None:
    first = {prompt_ids(i, 64)[0] for i in range(100)}
    assert len(first) == 100
    assert len(prompt_ids(3, 64)) == 64 and prompt_ids(3, 64) == prompt_ids(3, 64)
    assert all(1000 <= t < 32000 for t in prompt_ids(5, 500))


def test_steady_window_counts_tokens_while_every_client_is_busy() -> None:
    # client A streams 1 token every 0.1 s from t=0 to 3; client B starts at t=1
    def stream(start: float, requests: int) -> list[Sample]:
        out = []
        for r in range(requests):
            t0 = start + r
            out.append(Sample(started=t0, chunks=[t0 + 0.1 * k for k in range(1, 11)],
                              completion_tokens=10, ended=t0 + 1.0))  # fmt: skip
        return out

    workers = [stream(0.0, 3), stream(1.0, 3)]
    # window [1, 3]: both busy, 10 tokens/s each
    assert steady_tokens_per_s(workers) == pytest.approx(20.0, rel=0.06)


def test_itl_divides_gaps_by_tokens_per_chunk() -> None:
    sample = Sample(started=0.0, chunks=[0.1, 0.3, 0.5], completion_tokens=6, ended=0.5)
    assert sample.ttft_s == pytest.approx(0.1)
    assert sample.itls_s() == pytest.approx([0.1, 0.1])


def test_prediction_scales_with_the_simulator_speed() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    workload = throughput.Workload(prompt_tokens=512, output_tokens=128)
    real = Prediction(profile=profile, workload=workload).at(8)
    fast = Prediction(profile=profile, workload=workload, speed=10).at(8)
    assert fast.output_tokens_per_s == pytest.approx(10 * real.output_tokens_per_s)
    assert fast.ttft_s == pytest.approx(real.ttft_s / 10)
