"""KV-cache arithmetic against vLLM's own start-up logs.

vLLM prints memory in GiB rounded to two decimals but counts blocks from the exact bytes, so
a logged "3.81 GiB" stands for any pool in [3.805, 3.815) GiB. Where a log gives only the
rounded GiB, the tests check that the logged block count is the one our arithmetic gives for
a pool inside that interval, and that the pool of exactly that many blocks prints as the
logged GiB; block counts, tokens and concurrency are then reproduced exactly.
"""

from __future__ import annotations

import pytest

from gateway.capacity import CapacityError, kv, load_catalog
from gateway.capacity.profile import ReplicaOptions, build_profile

CATALOG = load_catalog()
LLAMA_8B = CATALOG.model("llama-3.1-8b")
MISTRAL_7B = CATALOG.model("mistral-7b")
GIB = kv.GIB


def blocks_for_gib(model_name: str, gib: float, *, tp: int = 1, block_size: int = 16) -> int:
    model = CATALOG.model(model_name)
    page = kv.block_bytes_per_layer(model, tp=tp, kv_dtype="auto", block_size=block_size)
    return kv.num_gpu_blocks(kv_cache_bytes=gib * GIB, block_bytes=page, layers=model.layers)


def gib_of_blocks(model_name: str, blocks: int, *, block_size: int = 16) -> float:
    model = CATALOG.model(model_name)
    page = kv.block_bytes_per_layer(model, tp=1, kv_dtype="auto", block_size=block_size)
    return blocks * page * model.layers / GIB


def blocks_in_logged_interval(model_name: str, logged_gib: float) -> range:
    low = blocks_for_gib(model_name, logged_gib - 0.005)
    high = blocks_for_gib(model_name, logged_gib + 0.005 - 1e-12)
    return range(low, high + 1)


def test_llama_8b_kv_bytes_per_token_is_128_kib() -> None:
    # 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert kv.kv_bytes_per_token(LLAMA_8B, tp=1, kv_dtype="auto") == 131072
    assert kv.block_bytes_per_layer(LLAMA_8B, tp=1, kv_dtype="auto", block_size=16) == 65536


@pytest.mark.parametrize(
    ("logged_gib", "blocks", "tokens", "max_len", "concurrency"),
    [
        (3.81, 1952, 31232, 20000, 1.56),  # vLLM issue 10517, Llama-3.1-8B, RTX 3090, 20k
        (2.89, 1478, 23648, 29000, 0.82),  # the same, 29k: the server refuses to start
    ],
)
def test_llama_8b_logs_of_vllm_issue_10517(
    logged_gib: float, blocks: int, tokens: int, max_len: int, concurrency: float
) -> None:
    assert blocks in blocks_in_logged_interval("llama-3.1-8b", logged_gib)
    assert round(gib_of_blocks("llama-3.1-8b", blocks), 2) == logged_gib
    assert blocks_for_gib("llama-3.1-8b", gib_of_blocks("llama-3.1-8b", blocks)) == blocks
    assert blocks * 16 == tokens
    got = kv.max_concurrency(num_blocks=blocks, block_size=16, max_model_len=max_len)
    assert round(got, 2) == concurrency


def test_vllm_issue_10517_memory_split_gives_the_logged_pool() -> None:
    # total_gpu_memory=23.58GiB x 0.90 - peak_torch_memory (weights 14.9888 + activations)
    # - non_torch_memory=0.35GiB = kv_cache_size
    for peak_torch, logged in ((17.06, 3.81), (17.98, 2.89)):
        budget = kv.MemoryBudget(
            total_gib=23.58,
            gpu_memory_utilization=0.90,
            weights_gib=14.9888,
            activation_gib=peak_torch - 14.9888,
            non_torch_gib=0.35,
        )
        assert round(budget.kv_cache_gib, 2) == logged


def test_29k_context_does_not_fit_the_2_89_gib_pool() -> None:
    gpu = CATALOG.gpu("a10g")
    options = ReplicaOptions(kv_cache_gib=gib_of_blocks("llama-3.1-8b", 1478), max_model_len=29000)
    with pytest.raises(CapacityError, match=r"29000 is larger than the 23648 tokens"):
        build_profile(LLAMA_8B, gpu, options)


def test_mistral_7b_102_56_gib_gives_52510_blocks() -> None:
    blocks = blocks_for_gib("mistral-7b", 102.56)
    assert blocks == 52510
    assert blocks * 16 == 840160
    got = kv.max_concurrency(num_blocks=blocks, block_size=16, max_model_len=32768)
    assert round(got, 2) == 25.64


@pytest.mark.parametrize(
    ("blocks", "tokens", "max_len", "concurrency"),
    [
        (127626, 2042016, 2048, 997.08),  # vLLM PR 13596
        (9916, 158656, 32768, 4.84),  # vLLM PR 17122: Llama-3.1-8B on one L40S
        (1381, 22096, 2048, 10.79),  # vLLM PR 12569: Llama-3.1-70B w8a8
    ],
)
def test_tokens_and_concurrency_from_blocks(
    blocks: int, tokens: int, max_len: int, concurrency: float
) -> None:
    assert blocks * 16 == tokens
    got = kv.max_concurrency(num_blocks=blocks, block_size=16, max_model_len=max_len)
    assert round(got, 2) == concurrency


def test_h100_memory_profile_of_vllm_pr_10511() -> None:
    # Llama-3-8B (same shape as 3.1-8B): 79.22 GiB x 0.90 = 71.29; weights 14.96,
    # non_torch 1.79, activation peak 1.26 -> available_kv_cache_memory 53.29 GiB
    budget = kv.estimate_memory(
        LLAMA_8B,
        CATALOG.gpu("h100"),
        tp=1,
        gpu_memory_utilization=0.90,
        activation_override_gib=1.26,
        non_torch_override_gib=1.79,
    )
    # 79.22 is itself rounded: the log's 71.29 is 0.90 x a total a little under 79.22
    assert budget.usable_gib == pytest.approx(71.29, abs=0.01)
    assert round(budget.weights_gib, 2) == 14.96  # the weights estimate matches the log
    assert round(budget.kv_cache_gib, 2) == 53.29


def test_fp8_kv_halves_bytes_per_token_and_doubles_blocks() -> None:
    auto = kv.kv_bytes_per_token(LLAMA_8B, tp=1, kv_dtype="auto")
    fp8 = kv.kv_bytes_per_token(LLAMA_8B, tp=1, kv_dtype="fp8")
    assert fp8 * 2 == auto
    page_fp8 = kv.block_bytes_per_layer(LLAMA_8B, tp=1, kv_dtype="fp8", block_size=16)
    blocks = kv.num_gpu_blocks(kv_cache_bytes=3.8125 * GIB, block_bytes=page_fp8, layers=32)
    assert blocks == 2 * 1952


def test_tensor_parallel_splits_kv_heads_and_replicates_past_them() -> None:
    llama_70b = CATALOG.model("llama-3.1-70b")
    full = kv.kv_bytes_per_token(llama_70b, tp=1, kv_dtype="auto")
    assert full == 2 * 80 * 8 * 128 * 2
    assert kv.kv_bytes_per_token(llama_70b, tp=2, kv_dtype="auto") * 2 == full
    # 8 KV heads over 16 ranks: each rank still holds one whole head
    assert kv.kv_heads_per_rank(llama_70b, 16) == 1
    assert kv.kv_bytes_per_token(llama_70b, tp=16, kv_dtype="auto") == full // 8


def test_mla_caches_one_latent_per_layer_on_every_rank() -> None:
    deepseek = CATALOG.model("deepseek-v3")
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes, not x 2 for K and V
    assert kv.kv_bytes_per_token(deepseek, tp=1, kv_dtype="auto") == 61 * 576 * 2
    assert kv.kv_bytes_per_token(deepseek, tp=8, kv_dtype="auto") == 61 * 576 * 2
    assert kv.kv_bytes_per_token(deepseek, tp=8, kv_dtype="fp8") == 61 * 576


def test_estimated_budget_subtracts_each_term() -> None:
    budget = kv.estimate_memory(LLAMA_8B, CATALOG.gpu("h100"), tp=1, gpu_memory_utilization=0.9)
    expected = 79.22 * 0.9 - budget.weights_gib - budget.activation_gib - budget.non_torch_gib
    assert budget.kv_cache_gib == pytest.approx(expected)
    assert 0.5 < budget.activation_gib < 2.0  # vLLM logs 1.2-1.3 GiB for this model
    given = kv.estimate_memory(
        LLAMA_8B, CATALOG.gpu("h100"), tp=1, gpu_memory_utilization=0.9, kv_cache_override_gib=7
    )
    assert given.kv_cache_gib == 7


def test_unknown_kv_dtype_is_refused() -> None:
    with pytest.raises(CapacityError, match="unknown dtype 'fp7'"):
        kv.kv_bytes_per_token(LLAMA_8B, tp=1, kv_dtype="fp7")
