"""Sizing a simulated replica: explicit budget, built-in 8B-on-H100 default, or the catalog."""

import argparse

import pytest

from gateway.capacity import replica_profile
from loadtest.sim.cli import add_arguments, sim_config
from loadtest.sim.config import (
    DEFAULT_STEP_COST,
    KvLoadFailurePolicy,
    KvTransfer,
    SimConfig,
    resolve,
)


def test_explicit_kv_tokens_are_rounded_down_to_whole_blocks() -> None:
    resolved = resolve(SimConfig(kv_tokens=1000, block_size=16))
    assert resolved.num_blocks == 62 and resolved.kv_tokens == 992
    assert resolved.max_model_len == 992  # the default 8192 cannot exceed the cache


def test_default_replica_is_an_8b_model_on_an_80_gib_gpu() -> None:
    resolved = resolve(SimConfig())
    free = 80 * 1024**3 * 0.9 - 16e9 - 1024**3
    assert resolved.num_blocks == int(free // (128 * 1024 * 16))
    assert resolved.step_cost == DEFAULT_STEP_COST and resolved.max_model_len == 8192
    # one decode step at batch 1 reads the weights: about 8 ms at 2 TB/s effective
    assert DEFAULT_STEP_COST.decode_step_s(0) == pytest.approx(16e9 / 2.01e12)


def test_catalog_sizes_the_cache_and_step_cost_like_the_planner() -> None:
    config = SimConfig(model="served", catalog_model="llama-3.1-8b", gpu="h100", max_model_len=8192)
    profile = replica_profile(model="llama-3.1-8b", gpu="h100", max_model_len=8192)
    resolved = resolve(config)
    assert resolved.num_blocks == profile.num_gpu_blocks
    assert resolved.step_cost == profile.step_cost and resolved.max_model_len == 8192


def test_catalog_with_an_explicit_budget_keeps_the_step_cost() -> None:
    config = SimConfig(model="llama-3.1-8b", gpu="h100", kv_tokens=4096, max_model_len=2048)
    resolved = resolve(config)
    assert resolved.kv_tokens == 4096
    assert resolved.step_cost == replica_profile(model="llama-3.1-8b", gpu="h100").step_cost


def test_a_context_longer_than_the_cache_is_refused_like_vllm_at_start_up() -> None:
    with pytest.raises(ValueError, match="max_model_len=4096"):
        resolve(SimConfig(kv_tokens=1024, max_model_len=4096))


@pytest.mark.parametrize(
    "bad",
    [{"speed": 0}, {"block_size": 0}, {"kv_tokens": 8}, {"flush_interval_s": -1}],
)
def test_invalid_configs_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "enabled"),
    [([], True), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)],
)
def test_prefix_caching_is_on_unless_turned_off_with_vllms_flag(
    flags: list[str], enabled: bool
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert sim_config(parser.parse_args(flags)).enable_prefix_caching is enabled


def test_kv_transfer_names_become_enums_and_a_shared_folder_goes_with_shared() -> None:
    config = SimConfig(
        kv_transfer="shared", kv_shared_path="/tmp/kv", kv_load_failure_policy="recompute"
    )
    assert config.kv_transfer is KvTransfer.SHARED
    assert config.kv_load_failure_policy is KvLoadFailurePolicy.RECOMPUTE
    for wrong in (
        {"kv_transfer": "shared"},
        {"kv_transfer": "params", "kv_shared_path": "/tmp/kv"},
        {"kv_transfer": "params", "no_delay": True},
        {"kv_transfer": "nixl"},
    ):
        with pytest.raises(ValueError):
            SimConfig(**wrong)  # type: ignore[arg-type]


def test_the_kv_transfer_flags_make_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--kv-transfer", "params", "--engine-id", "p0", "--kv-load-failure-policy", "recompute"]
    )
    config = sim_config(args)
    assert (config.kv_transfer, config.engine_id) == (KvTransfer.PARAMS, "p0")
    assert config.kv_load_failure_policy is KvLoadFailurePolicy.RECOMPUTE
    assert sim_config(parser.parse_args([])).kv_transfer is None
