"""What `--enable-lora` takes from a replica's memory, as vLLM 0.32 takes it.

When it loads the model, vLLM wraps each LoRA-capable layer and allocates its adapter
buffers for `max_loras` slots of `max_lora_rank` (vllm/lora/layers: `create_lora_weights`),
whether or not an adapter is ever loaded. On a GPU this happens inside the memory profiler
that measures the weights ("Model loading took N GiB"), so the KV cache gets that much
less; a KV pool given outright (`--kv-cache-memory-bytes`) is not reduced, and neither is
the CPU build's, which is either given outright or what is left of the requested memory
after the process's resident size.

For a dense decoder, the wrapped layers are every linear layer, the token embedding and the
LM head. Per slot and unit of rank, on one tensor-parallel rank (H hidden, Q query heads x
head dim, K KV heads per rank x head dim, I intermediate, V vocabulary):

- qkv_proj (column-parallel, 3 slices): A 3 x H, B (Q ÷ tp + 2 x K)
- o_proj (row-parallel): A Q ÷ tp, B H
- gate_up_proj (column-parallel, 2 slices): A 2 x H, B 2 x I ÷ tp
- down_proj (row-parallel): A I ÷ tp, B H
- embed_tokens: A V, B H; lm_head: A H, B V (neither sharded)

in the LoRA dtype, which is the model's. The punica wrapper's index tensors are a few
hundred kilobytes and are not counted; nor are an MoE model's expert buffers (vLLM keeps
one per expert) or MLA's low-rank projections, and a plan for such a model says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.capacity import kv
from gateway.capacity.catalog import CapacityError, ModelSpec

# vLLM's LoRAConfig: the ranks it accepts, and its defaults
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16

# the layers vLLM wraps in a Llama-style decoder, each with the names `--lora-target-modules`
# accepts for it: the packed module, or any module packed into it
LAYERS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("qkv_proj", "q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_up_proj", "gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
    "embed_tokens": ("embed_tokens",),
    "lm_head": ("lm_head",),
}


@dataclass(frozen=True, kw_only=True)
class LoraOptions:
    """vLLM's `--max-loras`, `--max-lora-rank` and `--lora-target-modules` (None: all)."""

    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise CapacityError(f"--max-loras must be at least 1, not {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            ranks = ", ".join(map(str, MAX_LORA_RANKS))
            raise CapacityError(
                f"--max-lora-rank {self.max_lora_rank} is not one vLLM accepts ({ranks})"
            )
        if self.target_modules is not None:
            known = {name for names in LAYERS.values() for name in names}
            unknown = sorted(set(self.target_modules) - known)
            if unknown:
                raise CapacityError(
                    f"unknown --lora-target-modules {', '.join(unknown)}; known: "
                    + ", ".join(sorted(known))
                )

    @property
    def layers(self) -> tuple[str, ...]:
        """The wrapped layers: a packed layer is wrapped whole when any part is targeted."""
        if self.target_modules is None:
            return tuple(LAYERS)
        wanted = set(self.target_modules)
        return tuple(layer for layer, names in LAYERS.items() if wanted.intersection(names))


def _elements_per_rank_unit(model: ModelSpec, tp: int) -> dict[str, int]:
    """A + B elements of one slot at rank 1, per wrapped layer, summed over the model."""
    hidden, vocab = model.hidden_size, model.vocab_size
    q = model.heads * model.head_dim // tp
    k = kv.kv_heads_per_rank(model, tp) * model.head_dim
    inter = model.intermediate_size // tp
    per_layer = {
        "qkv_proj": 3 * hidden + q + 2 * k,
        "o_proj": q + hidden,
        "gate_up_proj": 2 * hidden + 2 * inter,
        "down_proj": inter + hidden,
    }
    counted = {name: model.layers * n for name, n in per_layer.items()}
    counted["embed_tokens"] = vocab + hidden
    counted["lm_head"] = hidden + vocab
    return counted


def lora_buffer_bytes(model: ModelSpec, options: LoraOptions, *, tp: int) -> int:
    """Bytes of adapter buffers on each GPU of a replica of `model` on `tp` GPUs."""
    counted = _elements_per_rank_unit(model, tp)
    elements = sum(counted[layer] for layer in options.layers)
    per_element = int(kv.dtype_bytes(model.dtype))
    return options.max_loras * options.max_lora_rank * elements * per_element


def lora_warnings(model: ModelSpec) -> tuple[str, ...]:
    """What the buffer estimate leaves out for this model."""
    left_out = []
    if model.experts_per_token > 1 or model.active_params != model.params:
        left_out.append("its experts' LoRA buffers (one per expert)")
    if model.mla is not None:
        left_out.append("its MLA projections' LoRA buffers")
    if not left_out:
        return ()
    return (
        f"the LoRA estimate for {model.name} counts a dense decoder's layers, not "
        + " or ".join(left_out)
        + "; the KV cache may be smaller than shown",
    )
