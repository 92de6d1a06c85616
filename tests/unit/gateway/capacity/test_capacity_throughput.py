"""The step-cost model: calibration, the steady state, the KV bound and the knee."""

from __future__ import annotations

import pytest

from gateway.capacity import CapacityError, replica_profile, throughput
from gateway.capacity.throughput import Workload

WORKLOAD = Workload(prompt_tokens=1536, output_tokens=512)


def test_llama_8b_on_one_h100_decodes_about_133_tokens_per_s_at_batch_1() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    for context in (1, 2048):
        tokens_per_s = 1 / profile.step_cost.decode_step_s(context)
        assert 133 * 0.8 <= tokens_per_s <= 133 * 1.2
    assert profile.step_cost.decode_step_s(1) == pytest.approx(7.5e-3, rel=0.05)


def test_decode_step_reads_weights_per_rank_and_the_batch_kv() -> None:
    one = replica_profile(model="llama-3.1-70b", gpu="h100", tp=4, max_model_len=8192)
    cost = one.step_cost
    assert cost.weights_bytes_per_rank == pytest.approx(70.55e9 * 2 / 4, rel=0.001)
    extra = cost.decode_step_s(10_000) - cost.decode_step_s(0)
    assert extra == pytest.approx(10_000 * 2 * 80 * 2 * 128 * 2 / cost.bandwidth_bytes_per_s)


def test_prefill_costs_two_flops_per_active_parameter_per_token() -> None:
    mixtral = replica_profile(model="mixtral-8x7b", gpu="h100", tp=2)
    assert mixtral.step_cost.prefill_flops_per_token == pytest.approx(2 * 12.88e9 / 2, rel=0.01)
    seconds = mixtral.step_cost.prefill_s(2048)
    assert seconds == pytest.approx(2048 * 2 * 12.88e9 / 2 / (989e12 * 0.5), rel=0.01)


def test_sessions_at_the_kv_bound_reserve_every_block_of_prompt_plus_output() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    per_session = -(-WORKLOAD.tokens // 16)
    assert throughput.kv_bound(profile, WORKLOAD) == profile.num_gpu_blocks // per_session
    assert profile.sessions_at_kv_bound(2048) == profile.num_gpu_blocks // 128


def test_steady_state_below_the_bound() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    cost = profile.step_cost
    point = throughput.predict(profile, WORKLOAD, 10)
    step = cost.decode_step_s(10 * (1536 + 256)) + 10 / 512 * cost.prefill_s(1536)
    assert point.running == 10
    assert point.step_s == pytest.approx(step)
    assert point.output_tokens_per_s == pytest.approx(10 / step)
    assert point.ttft_s == pytest.approx(0.9 * step / 2 + cost.prefill_s(1536) + step)


def test_beyond_the_bound_throughput_is_flat_and_ttft_queues() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="l4", max_model_len=8192)
    bound = throughput.kv_bound(profile, WORKLOAD)
    at, past = (
        throughput.predict(profile, WORKLOAD, bound),
        throughput.predict(profile, WORKLOAD, 2 * bound),
    )
    assert past.running == bound
    assert past.output_tokens_per_s == at.output_tokens_per_s
    assert past.ttft_s - at.ttft_s == pytest.approx(512 * at.step_s)  # one slot's turn


def test_ttft_rises_with_concurrency_and_the_knee_is_where_it_doubles() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    points = throughput.curve(profile, WORKLOAD, range(1, 400))
    ttfts = [p.ttft_s for p in points]
    assert ttfts == sorted(ttfts)
    knee = throughput.knee(profile, WORKLOAD)
    single = ttfts[0]
    assert ttfts[knee - 1] <= 2 * single < ttfts[knee]


def test_knee_comes_before_the_kv_bound_when_prefill_dominates() -> None:
    long_prompts = Workload(prompt_tokens=8000, output_tokens=64)
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    assert throughput.knee(profile, long_prompts) < throughput.kv_bound(profile, long_prompts)


def test_sessions_within_a_ttft_slo() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    single = throughput.predict(profile, WORKLOAD, 1).ttft_s
    assert throughput.max_sessions_within(profile, WORKLOAD, ttft_s=single / 2) == 0
    within = throughput.max_sessions_within(profile, WORKLOAD, ttft_s=single * 1.3)
    assert throughput.predict(profile, WORKLOAD, within).ttft_s <= single * 1.3
    assert throughput.predict(profile, WORKLOAD, within + 1).ttft_s > single * 1.3


def test_a_session_longer_than_the_cache_is_refused() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="l4", max_model_len=8192)
    with pytest.raises(CapacityError, match="one session of 40000 tokens needs 2500 blocks"):
        throughput.kv_bound(profile, Workload(prompt_tokens=39000, output_tokens=1000))


def test_max_num_seqs_caps_what_runs_at_once() -> None:
    assert replica_profile(model="llama-3.1-8b", gpu="h100").max_num_seqs == 1024
    assert replica_profile(model="llama-3.1-8b", gpu="a100-80gb").max_num_seqs == 256
    profile = replica_profile(model="llama-3.1-8b", gpu="h100", max_num_seqs=8)
    assert throughput.kv_bound(profile, WORKLOAD) > 8
    assert throughput.running_limit(profile, WORKLOAD) == 8
    point = throughput.predict(profile, WORKLOAD, 100)
    assert point.running == 8 and point.ttft_s > 50 * point.step_s
