"""Workload to replicas and GPUs, and the errors a plan can end in."""

from __future__ import annotations

import math

import pytest

from gateway.capacity import CapacityError, load_catalog, throughput
from gateway.capacity.plan import Demand, Plan, make_plan, plan_json
from gateway.capacity.profile import ReplicaOptions

CATALOG = load_catalog()
WORKLOAD = throughput.Workload(prompt_tokens=1536, output_tokens=512)


def plan(model: str = "llama-3.1-8b", gpu: str = "h100", *, tp: int = 1, **demand: float) -> Plan:
    return make_plan(
        CATALOG.model(model),
        CATALOG.gpu(gpu),
        options=ReplicaOptions(tp=tp, max_model_len=8192),
        workload=WORKLOAD,
        demand=Demand(**demand),  # type: ignore[arg-type]
    )


def test_three_requests_per_second_of_2k_tokens_fit_one_h100() -> None:
    p = plan(rps=3)
    assert p.peak_tokens_per_s == 3 * 2048
    assert p.sessions_at_fill == math.floor(p.sessions_per_replica * 0.9)
    assert p.replicas_needed == 1 and p.gpus_needed == 1


def test_replicas_are_peak_tokens_over_one_replica_at_target_fill() -> None:
    p = plan(rps=40, burst=1.5)
    at_fill = throughput.predict(p.profile, WORKLOAD, p.sessions_at_fill)
    replica_tokens_per_s = at_fill.output_tokens_per_s * 2048 / 512
    assert p.replica_tokens_per_s == pytest.approx(replica_tokens_per_s)
    assert p.peak_tokens_per_s == pytest.approx(40 * 2048 * 1.5)
    assert p.replicas_needed == math.ceil(40 * 2048 * 1.5 / replica_tokens_per_s)
    assert p.replicas_needed > 1


def test_sessions_demand_divides_by_sessions_at_fill() -> None:
    p = plan(sessions=1000, burst=1.2)
    assert p.replicas_needed == math.ceil(1200 / p.sessions_at_fill)


def test_lower_target_fill_needs_more_replicas() -> None:
    assert plan(rps=40, target_fill=0.3).replicas_needed > plan(rps=40).replicas_needed  # type: ignore[operator]


def test_gpus_are_replicas_times_tp() -> None:
    p = plan("llama-3.1-70b", tp=4, rps=20)
    assert p.replicas_needed is not None and p.gpus_needed == 4 * p.replicas_needed


def test_ttft_slo_caps_the_sessions_each_replica_runs() -> None:
    free = plan(rps=40)
    slo = free.at_fill.ttft_s * 0.9
    capped = plan(rps=40, ttft_slo_s=slo)
    assert capped.slo_sessions is not None and capped.sessions_at_fill == capped.slo_sessions
    assert capped.at_fill.ttft_s <= slo
    assert capped.replicas_needed >= free.replicas_needed  # type: ignore[operator]


def test_an_unmeetable_slo_is_said_plainly() -> None:
    p = plan(rps=1, ttft_slo_s=0.001)
    assert p.slo_sessions == 0 and p.sessions_at_fill == 1
    assert any("misses the TTFT SLO" in w for w in p.warnings)


def test_no_demand_leaves_replicas_open() -> None:
    p = plan()
    assert p.replicas_needed is None and p.gpus_needed is None


def test_json_has_the_keys_the_issue_names() -> None:
    out = plan_json(plan(rps=3))
    for key in (
        "kv_bytes_per_token", "kv_cache_gib", "num_gpu_blocks", "kv_cache_tokens",
        "max_concurrency", "sessions_per_replica", "decode_tokens_per_s", "ttft_ms",
        "replicas_needed", "gpus_needed",
    ):  # fmt: skip
        assert out[key] is not None, key
    assert out["kv_bytes_per_token"] == 131072
    assert out["kv_cache_tokens"] == 16 * out["num_gpu_blocks"]  # type: ignore[operator]


def test_hybrid_models_carry_a_warning() -> None:
    p = plan("gemma-2-9b", rps=1)
    assert any("sliding-window" in w and "full attention" in w for w in p.warnings)


@pytest.mark.parametrize(
    ("model", "gpu", "tp"), [("llama-3.1-405b", "h100", 1), ("deepseek-v3", "h100", 8)]
)
def test_a_model_that_does_not_fit_says_why(model: str, gpu: str, tp: int) -> None:
    with pytest.raises(CapacityError, match=r"does not fit on .* weights take"):
        plan(model, gpu, tp=tp)


def test_deepseek_v3_fits_eight_h200s() -> None:
    p = plan("deepseek-v3", "h200", tp=8, rps=1)
    assert p.kv_bytes_per_token == 61 * 576 * 2 and p.sessions_per_replica > 100


def test_bad_demand_is_refused() -> None:
    with pytest.raises(CapacityError, match="not both"):
        Demand(rps=1, sessions=2)
    with pytest.raises(CapacityError, match="target-fill"):
        Demand(target_fill=1.5)
