"""Prefill and decode engines sized apart: each rule against figures worked by hand.

The replica here is made up so the arithmetic stays round: a decode step reads 1 GB of
weights plus 10 kB a token at 100 GB/s (10 ms + 0.1 µs a token), a prefill computes 1 GFLOP
a token at 10 TFLOPS (0.1 ms a token); 1,200 blocks of 100 tokens. Sessions of 1,000 prompt
and 200 output tokens hold 12 blocks (100 at the KV bound) and 1,100 tokens on average.
"""

from __future__ import annotations

import pytest

from gateway.capacity import CapacityError, replica_profile, throughput
from gateway.capacity.catalog import load_catalog
from gateway.capacity.disaggregated import (
    first_step_s,
    kv_transfer,
    make_disaggregated_plan,
    md1_wait_s,
    size_decode,
    size_prefill,
    utilization_for_wait,
)
from gateway.capacity.perf import ReplicaProfile, StepCost
from gateway.capacity.plan import Demand, Plan, make_plan
from gateway.capacity.profile import ReplicaOptions
from gateway.capacity.throughput import Workload

COST = StepCost(
    weights_bytes_per_rank=1e9,
    kv_bytes_per_token_per_rank=1e4,
    bandwidth_bytes_per_s=1e11,
    prefill_flops_per_token=1e9,
    flops_per_s=1e13,
)
PROFILE = ReplicaProfile(
    model="made-up", gpu="made-up", tp=1, block_size=100, num_gpu_blocks=1200, step_cost=COST
)
WORKLOAD = Workload(prompt_tokens=1000, output_tokens=200)


def test_md1_wait_and_its_inverse() -> None:
    # half busy, 100 ms a prompt: 0.5 x 0.1 / (2 x 0.5) = 50 ms
    assert md1_wait_s(utilization=0.5, service_s=0.1) == pytest.approx(0.05)
    assert md1_wait_s(utilization=0.9, service_s=0.1) == pytest.approx(0.45)
    assert utilization_for_wait(wait_s=0.05, service_s=0.1) == pytest.approx(0.5)
    assert utilization_for_wait(wait_s=0.025, service_s=0.1) == pytest.approx(1 / 3)


def test_a_decode_only_step_has_no_prefill_in_it() -> None:
    # 10 ms + 50 sessions x 1,100 tokens x 0.1 µs
    assert throughput.decode_only_step_s(PROFILE, WORKLOAD, 50) == pytest.approx(0.0155)
    # the unified step adds 50 / 200 of a 100 ms prefill
    assert throughput.step_s(PROFILE, WORKLOAD, 50) == pytest.approx(0.0155 + 0.025)


def test_itl_bounds_the_batch_on_each_kind_of_engine() -> None:
    # decode only: 10 ms + 0.11 ms a session <= 16.5 ms holds 59 sessions
    decode = throughput.max_sessions_within_itl(
        PROFILE, WORKLOAD, itl_s=0.0165, step=throughput.decode_only_step_s
    )
    assert decode == 59
    # unified: 10 ms + (0.11 + 0.5) ms a session <= 16.5 ms holds 10
    assert throughput.max_sessions_within_itl(PROFILE, WORKLOAD, itl_s=0.0165) == 10
    assert throughput.max_sessions_within_itl(PROFILE, WORKLOAD, itl_s=0.009) == 0


def test_decode_engines_at_target_fill() -> None:
    sized = size_decode(PROFILE, WORKLOAD, Demand(rps=100), requests_per_s=100)
    # 90 sessions (0.9 x 100), a step of 10 + 9.9 ms: 4,523 tokens/s an engine, and
    # 100 req/s x 200 tokens = 20,000 tokens/s needs 4.4 of them
    assert (sized.running_limit, sized.itl_sessions, sized.sessions) == (100, None, 90)
    assert sized.step_s == pytest.approx(0.0199)
    assert sized.replicas == 5


def test_a_tight_itl_objective_adds_decode_engines() -> None:
    demand = Demand(rps=100, itl_slo_s=0.0156)
    sized = size_decode(PROFILE, WORKLOAD, demand, requests_per_s=100)
    # 10 ms + 0.11 ms a session <= 15.6 ms: 50 sessions, 15.5 ms a step, 3,226 tokens/s;
    # 20,000 ÷ 3,226 = 6.2
    assert (sized.itl_sessions, sized.sessions) == (50, 50)
    assert sized.step_s == pytest.approx(0.0155)
    assert sized.replicas == 7


def test_first_decode_step_is_the_rest_of_one_and_one_more() -> None:
    sized = size_decode(PROFILE, WORKLOAD, Demand(rps=100), requests_per_s=100)
    assert first_step_s(sized) == pytest.approx((1 - 1 / 90) * 0.0199 / 2 + 0.0199)


def test_prefill_engines_at_target_fill() -> None:
    # 100 prompts/s of 100 ms each is 10 engines' compute; at 90 %, 12 engines, each
    # 83 % busy, a prompt waiting 0.833 x 0.1 / (2 x 0.167) = 250 ms
    sized = size_prefill(PROFILE, WORKLOAD, Demand(rps=100), requests_per_s=100, fixed_s=0.05)
    assert sized.prefill_s == pytest.approx(0.1)
    assert sized.utilization_cap == pytest.approx(0.9)
    assert sized.replicas == 12
    assert sized.utilization == pytest.approx(10 / 12)
    assert sized.wait_s == pytest.approx(0.25)


def test_a_ttft_objective_leaves_queueing_headroom() -> None:
    # 200 ms less 100 ms of prefill and 50 ms outside the engine leaves 50 ms of wait:
    # utilization 0.5, so 20 engines
    demand = Demand(rps=100, ttft_slo_s=0.2)
    sized = size_prefill(PROFILE, WORKLOAD, demand, requests_per_s=100, fixed_s=0.05)
    assert sized.utilization_cap == pytest.approx(0.5)
    assert sized.replicas == 20
    assert sized.wait_s == pytest.approx(0.05)
    assert sized.ttft_reachable
    # 175 ms leaves 25 ms: utilization 1/3, 30 engines
    tighter = Demand(rps=100, ttft_slo_s=0.175)
    assert size_prefill(PROFILE, WORKLOAD, tighter, requests_per_s=100, fixed_s=0.05).replicas == 30


def test_an_unreachable_ttft_objective_sizes_at_target_fill() -> None:
    demand = Demand(rps=100, ttft_slo_s=0.12)
    sized = size_prefill(PROFILE, WORKLOAD, demand, requests_per_s=100, fixed_s=0.05)
    assert not sized.ttft_reachable
    assert sized.replicas == 12


def test_kv_transfer_moves_every_ranks_share_of_the_prompt() -> None:
    two_ranks = ReplicaProfile(
        model="made-up", gpu="made-up", tp=2, block_size=100, num_gpu_blocks=1200, step_cost=COST
    )
    moved = kv_transfer(two_ranks, WORKLOAD, requests_per_s=100, link_gbps=100, prefill_gpus=4)
    # 10 kB a token a rank x 1,000 tokens x 2 ranks; at 100 req/s, 2 GB/s = 16 Gbit/s;
    # a rank's 10 MB over 12.5 GB/s takes 0.8 ms; four 12.5 GB/s links carry 2 GB/s at 4 %
    assert moved.bytes_per_request == 20_000_000
    assert moved.bytes_per_s == pytest.approx(2e9)
    assert moved.gbps_needed == pytest.approx(16)
    assert moved.transfer_s == pytest.approx(0.0008)
    assert moved.link_load == pytest.approx(0.04)


def _llama_plan(demand: Demand) -> Plan:
    catalog = load_catalog()
    return make_plan(
        catalog.model("llama-3.1-8b"),
        catalog.gpu("h100"),
        options=ReplicaOptions(),
        workload=Workload(prompt_tokens=1536, output_tokens=512),
        demand=demand,
    )


def test_the_plan_adds_its_parts_and_compares_with_unified() -> None:
    plan = _llama_plan(Demand(rps=40, burst=2))
    split = make_disaggregated_plan(plan, kv_transfer_gbps=400)
    assert split.requests_per_s == 80
    assert split.gpus == split.prefill.replicas + split.decode.replicas
    assert split.unified_gpus == plan.gpus_needed
    assert split.cheaper == (
        "equal"
        if split.gpus == split.unified_gpus
        else "disaggregated"
        if split.gpus < split.unified_gpus
        else "unified"
    )
    # 131,072 bytes a token x 1,536 tokens, a rank's share over 50 GB/s
    assert split.transfer.bytes_per_request == 131_072 * 1536
    assert split.transfer.transfer_s == pytest.approx(131_072 * 1536 / 50e9)
    ttft = (
        split.prefill.wait_s
        + split.prefill.prefill_s
        + split.transfer.transfer_s
        + first_step_s(split.decode)
    )
    assert split.ttft_s == pytest.approx(ttft)


def test_tensor_parallel_engines_count_their_gpus() -> None:
    catalog = load_catalog()
    plan = make_plan(
        catalog.model("llama-3.1-70b"),
        catalog.gpu("h100"),
        options=ReplicaOptions(tp=4, max_model_len=8192),
        workload=Workload(prompt_tokens=1536, output_tokens=512),
        demand=Demand(rps=10),
    )
    split = make_disaggregated_plan(plan)
    assert split.prefill_gpus == 4 * split.prefill.replicas
    assert split.decode_gpus == 4 * split.decode.replicas
    # every rank moves its share: 8 KV heads over 4 ranks hold the whole KV between them
    assert split.transfer.bytes_per_request == 2 * 80 * 8 * 128 * 2 * 1536


def test_needs_a_rate() -> None:
    with pytest.raises(CapacityError, match="give --rps"):
        make_disaggregated_plan(_llama_plan(Demand(sessions=100)))
    with pytest.raises(CapacityError, match="--kv-transfer-gbps"):
        make_disaggregated_plan(_llama_plan(Demand(rps=1)), kv_transfer_gbps=0)


def test_objectives_must_be_positive() -> None:
    with pytest.raises(CapacityError, match="--itl-slo-ms"):
        Demand(rps=1, itl_slo_s=0)


def test_llama_8b_decode_only_step_is_the_calibrated_decode() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    step = throughput.decode_only_step_s(profile, WORKLOAD, 1)
    assert step == pytest.approx(profile.step_cost.decode_step_s(1100))
