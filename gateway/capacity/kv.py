"""KV-cache arithmetic the way vLLM does it: bytes per token, the memory pool, blocks, concurrency.

Everything here is per GPU (per tensor-parallel rank): each rank holds its share of every
block, so a replica holds as many blocks, and as many tokens, as one of its ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.capacity.catalog import CapacityError, GpuSpec, ModelSpec

GIB = 1024**3

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
    "int4": 0.5,
}

# vLLM's profile run pushes max_num_batched_tokens through the model (8192 is the V1 default
# for the OpenAI server on data-centre GPUs) and samples max_num_seqs (256) rows of logits.
PROFILE_BATCHED_TOKENS = 8192
PROFILE_SAMPLED_SEQS = 256
NON_TORCH_GIB = 0.5  # CUDA context, cuBLAS workspaces
NON_TORCH_TP_EXTRA_GIB = 1.0  # NCCL and custom all-reduce buffers when tp > 1


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise CapacityError(f"unknown dtype {dtype!r}; known: {known}") from None


def kv_dtype_bytes(model: ModelSpec, kv_dtype: str) -> int:
    """vLLM's --kv-cache-dtype: "auto" stores KV in the model's activation dtype."""
    size = dtype_bytes(model.dtype if kv_dtype == "auto" else kv_dtype)
    if size < 1:
        raise CapacityError(f"KV cache dtype {kv_dtype!r} is not one vLLM stores")
    return int(size)


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads one rank holds; with more ranks than heads vLLM replicates a head per rank."""
    if model.mla is not None:
        return 1
    return max(1, model.kv_heads // tp)


def kv_head_size(model: ModelSpec) -> int:
    if model.mla is not None:
        return model.mla.kv_lora_rank + model.mla.qk_rope_head_dim
    return model.head_dim


def kv_tensors(model: ModelSpec) -> int:
    """2 (a K and a V) for ordinary attention; MLA caches one latent per layer."""
    return 1 if model.mla is not None else 2


def block_bytes_per_layer(model: ModelSpec, *, tp: int, kv_dtype: str, block_size: int) -> int:
    """vLLM's page size: one block of one layer on one rank."""
    per_token = kv_tensors(model) * kv_heads_per_rank(model, tp) * kv_head_size(model)
    return block_size * per_token * kv_dtype_bytes(model, kv_dtype)


def kv_bytes_per_token(model: ModelSpec, *, tp: int, kv_dtype: str) -> int:
    """2 x layers x KV heads per rank x head dim x KV dtype bytes (MLA: 1 x latent)."""
    return block_bytes_per_layer(model, tp=tp, kv_dtype=kv_dtype, block_size=1) * model.layers


def num_gpu_blocks(*, kv_cache_bytes: float, block_bytes: int, layers: int) -> int:
    return max(0, math.floor(kv_cache_bytes / (block_bytes * layers)))


def blocks_per_request(tokens: int, block_size: int) -> int:
    return max(1, math.ceil(tokens / block_size))


def shared_prompt_blocks(*, shared_prompt_tokens: int, shared_share: float, block_size: int) -> int:
    """The blocks of a shared prompt that one engine holds once: its whole blocks (a partial
    block is hashed with what follows it in each request, so the prefix cache never shares
    it), and none when no request carries it."""
    return shared_prompt_tokens // block_size if shared_share > 0 else 0


def sessions_at_kv_bound(
    *,
    num_blocks: int,
    block_size: int,
    tokens: int,
    shared_prompt_tokens: int = 0,
    shared_share: float = 1.0,
) -> int:
    """Sessions of `tokens` each (prompt + output) that fit at once, every block reserved.

    With prefix caching, the shared prompt's whole blocks are reference-counted: held once
    while any session carrying it runs. A session that carries it holds the rest of its
    blocks; one that does not holds all of them. For a share F of carriers:

        floor((num_blocks - shared) / (F x (whole - shared) + (1 - F) x whole))

    and never fewer than without sharing: n sessions of which k >= 1 carry the prompt hold
    n x whole - (k - 1) x shared blocks, while the mean form charges all the shared blocks
    to less than one carrier when F x n < 1.
    """
    whole = blocks_per_request(tokens, block_size)
    alone = num_blocks // whole
    shared = shared_prompt_blocks(
        shared_prompt_tokens=shared_prompt_tokens, shared_share=shared_share, block_size=block_size
    )
    if shared == 0:
        return alone
    mean_own = whole - shared_share * shared
    # Within float rounding of a whole number of sessions, the whole number is meant.
    return max(alone, math.floor((num_blocks - shared) / mean_own + 1e-9))


def max_concurrency(*, num_blocks: int, block_size: int, max_model_len: int) -> float:
    """vLLM's "Maximum concurrency for N tokens per request"."""
    return num_blocks / blocks_per_request(max_model_len, block_size)


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """One GPU's memory, in GiB, split the way vLLM's memory profiling logs it."""

    total_gib: float
    gpu_memory_utilization: float
    weights_gib: float
    activation_gib: float
    non_torch_gib: float
    lora_gib: float = 0.0  # vLLM's LoRA buffers, allocated with the weights
    kv_cache_override_gib: float | None = None

    @property
    def usable_gib(self) -> float:
        return self.total_gib * self.gpu_memory_utilization

    @property
    def kv_cache_gib(self) -> float:
        if self.kv_cache_override_gib is not None:
            return self.kv_cache_override_gib
        return self.kv_cache_without_lora_gib - self.lora_gib

    @property
    def kv_cache_without_lora_gib(self) -> float:
        if self.kv_cache_override_gib is not None:
            return self.kv_cache_override_gib
        return self.usable_gib - self.weights_gib - self.activation_gib - self.non_torch_gib

    @property
    def lora_taken_gib(self) -> float:
        """What the LoRA buffers take from the KV pool: none from a pool given outright."""
        return self.kv_cache_without_lora_gib - self.kv_cache_gib


def weights_gib(model: ModelSpec, *, tp: int) -> float:
    return model.params * dtype_bytes(model.weight_dtype) / tp / GIB


def activation_gib(
    model: ModelSpec, *, tp: int, batched_tokens: int = PROFILE_BATCHED_TOKENS
) -> float:
    """Peak of vLLM's profile run: the widest FFN and attention intermediates, plus logits.

    Per token: gate+up and activated FFN outputs (3 x FFN width per rank) and about four
    hidden-sized buffers, in the activation dtype; the sampler holds fp32 logits.
    """
    ffn = 3 * model.intermediate_size * model.experts_per_token / tp
    per_token = (ffn + 4 * model.hidden_size) * dtype_bytes(model.dtype)
    logits = PROFILE_SAMPLED_SEQS * model.vocab_size * 4 / tp
    return (batched_tokens * per_token + logits) / GIB


def non_torch_gib(*, tp: int) -> float:
    return NON_TORCH_GIB + (NON_TORCH_TP_EXTRA_GIB if tp > 1 else 0.0)


def estimate_memory(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    tp: int,
    gpu_memory_utilization: float,
    weights_override_gib: float | None = None,
    activation_override_gib: float | None = None,
    non_torch_override_gib: float | None = None,
    kv_cache_override_gib: float | None = None,
    lora_gib: float = 0.0,
) -> MemoryBudget:
    """Each term estimated unless given; the KV pool given outright wins over all of them."""

    def pick(override: float | None, estimate: float) -> float:
        return estimate if override is None else override

    return MemoryBudget(
        total_gib=gpu.memory_gib,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_gib=pick(weights_override_gib, weights_gib(model, tp=tp)),
        activation_gib=pick(activation_override_gib, activation_gib(model, tp=tp)),
        non_torch_gib=pick(non_torch_override_gib, non_torch_gib(tp=tp)),
        lora_gib=lora_gib,
        kv_cache_override_gib=kv_cache_override_gib,
    )
