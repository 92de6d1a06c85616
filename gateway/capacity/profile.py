"""One vLLM replica of a model on a GPU: its KV blocks and its step costs."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.capacity import kv
from gateway.capacity.catalog import CapacityError, Catalog, GpuSpec, ModelSpec, load_catalog
from gateway.capacity.lora import LoraOptions, lora_buffer_bytes, lora_warnings
from gateway.capacity.perf import ReplicaProfile, StepCost

# Calibrated so Llama-3.1-8B on one H100 decodes at batch 1 in about 7.5 ms per token
# (133 tokens/s, the figure vLLM reaches there): 16.1 GB of weights ÷ (3.35 TB/s x 0.65).
BANDWIDTH_EFFICIENCY = 0.65
# Prefill of a few thousand tokens reaches about half the dense bf16 peak.
FLOPS_EFFICIENCY = 0.5


@dataclass(frozen=True, kw_only=True)
class ReplicaOptions:
    """vLLM's engine arguments that size the KV cache, and the planner's own overrides."""

    tp: int = 1
    kv_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None  # default: vLLM's for the GPU
    weights_gib: float | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    kv_cache_gib: float | None = None
    lora: LoraOptions | None = None  # vLLM's --enable-lora and its sizes; None: off
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    flops_efficiency: float = FLOPS_EFFICIENCY


def default_max_num_seqs(gpu: GpuSpec) -> int:
    """vLLM V1's OpenAI-server default: 1024 on GPUs of 70 GiB or more except A100s, else 256."""
    return 1024 if gpu.memory_gib >= 70 and not gpu.name.startswith("a100") else 256


def model_warnings(model: ModelSpec) -> tuple[str, ...]:
    if model.hybrid:
        return (
            f"{model.name} interleaves sliding-window ({model.sliding_window} tokens) and full "
            "attention layers; the estimate treats every layer as full attention, so vLLM's "
            "hybrid allocator may hold more tokens than shown",
        )
    if model.sliding_window is not None:
        return (
            f"{model.name} uses sliding-window attention ({model.sliding_window} tokens); the "
            "estimate treats it as full attention, so long sessions may hold fewer blocks",
        )
    return ()


def step_cost(model: ModelSpec, gpu: GpuSpec, options: ReplicaOptions) -> StepCost:
    tp = options.tp
    return StepCost(
        weights_bytes_per_rank=model.params * kv.dtype_bytes(model.weight_dtype) / tp,
        kv_bytes_per_token_per_rank=kv.kv_bytes_per_token(model, tp=tp, kv_dtype=options.kv_dtype),
        bandwidth_bytes_per_s=gpu.bandwidth_gb_s * 1e9 * options.bandwidth_efficiency,
        prefill_flops_per_token=2 * model.active_params / tp,
        flops_per_s=gpu.bf16_tflops * 1e12 * options.flops_efficiency,
    )


def memory_budget(model: ModelSpec, gpu: GpuSpec, options: ReplicaOptions) -> kv.MemoryBudget:
    return kv.estimate_memory(
        model,
        gpu,
        tp=options.tp,
        gpu_memory_utilization=options.gpu_memory_utilization,
        weights_override_gib=options.weights_gib,
        activation_override_gib=options.activation_gib,
        non_torch_override_gib=options.non_torch_gib,
        kv_cache_override_gib=options.kv_cache_gib,
        lora_gib=lora_gib(model, options),
    )


def lora_gib(model: ModelSpec, options: ReplicaOptions) -> float:
    if options.lora is None:
        return 0.0
    return lora_buffer_bytes(model, options.lora, tp=options.tp) / kv.GIB


def _check_options(model: ModelSpec, options: ReplicaOptions) -> None:
    if options.tp < 1:
        raise CapacityError(f"--tp must be at least 1, not {options.tp}")
    if options.block_size < 1:
        raise CapacityError(f"--block-size must be at least 1, not {options.block_size}")
    if not 0 < options.gpu_memory_utilization <= 1:
        raise CapacityError("--gpu-memory-utilization must be in (0, 1]")
    if model.mla is None and model.heads % options.tp:
        raise CapacityError(
            f"{model.name} has {model.heads} attention heads; tp={options.tp} does not divide them"
        )


def _check_fits(model: ModelSpec, gpu: GpuSpec, budget: kv.MemoryBudget, tp: int) -> None:
    if budget.kv_cache_gib > 0:
        return
    lora = f", LoRA {budget.lora_gib:.2f}" if budget.lora_gib else ""
    raise CapacityError(
        f"{model.name} does not fit on {tp} x {gpu.name}: of {budget.usable_gib:.2f} GiB usable "
        f"per GPU, weights take {budget.weights_gib:.2f}, activations {budget.activation_gib:.2f}"
        f", non-torch {budget.non_torch_gib:.2f}{lora}, leaving {budget.kv_cache_gib:.2f} GiB for "
        "KV cache; raise --tp or --gpu-memory-utilization, or choose a larger GPU"
    )


def build_profile(model: ModelSpec, gpu: GpuSpec, options: ReplicaOptions) -> ReplicaProfile:
    """Raises CapacityError when the model, or one request of max_model_len, does not fit."""
    _check_options(model, options)
    budget = memory_budget(model, gpu, options)
    _check_fits(model, gpu, budget, options.tp)
    page = kv.block_bytes_per_layer(
        model, tp=options.tp, kv_dtype=options.kv_dtype, block_size=options.block_size
    )
    blocks = kv.num_gpu_blocks(
        kv_cache_bytes=budget.kv_cache_gib * kv.GIB, block_bytes=page, layers=model.layers
    )
    max_model_len = options.max_model_len or model.max_position
    tokens = blocks * options.block_size
    if tokens < max_model_len:
        raise CapacityError(
            f"{model.name} on {options.tp} x {gpu.name}: max_model_len {max_model_len} is larger "
            f"than the {tokens} tokens the KV cache holds ({budget.kv_cache_gib:.2f} GiB); pass "
            f"--max-model-len {tokens} or less, or add memory"
        )
    return ReplicaProfile(
        model=model.name,
        gpu=gpu.name,
        tp=options.tp,
        block_size=options.block_size,
        num_gpu_blocks=blocks,
        step_cost=step_cost(model, gpu, options),
        max_model_len=max_model_len,
        max_num_seqs=options.max_num_seqs or default_max_num_seqs(gpu),
        warnings=(*model_warnings(model), *(lora_warnings(model) if options.lora else ())),
    )


def replica_profile(
    *,
    model: str,
    gpu: str,
    tp: int = 1,
    kv_dtype: str = "auto",
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    block_size: int = 16,
    max_num_seqs: int | None = None,
    catalog: Catalog | None = None,
) -> ReplicaProfile:
    """The replica a vLLM server of catalog `model` on `tp` x `gpu` would be."""
    found = catalog or load_catalog()
    options = ReplicaOptions(
        tp=tp,
        kv_dtype=kv_dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
    )
    return build_profile(found.model(model), found.gpu(gpu), options)
