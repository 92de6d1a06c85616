"""What `--enable-lora` takes from a simulated replica's KV cache, as vLLM 0.32 takes it.

vLLM allocates each LoRA-wrapped layer's adapter buffers for `max_loras` slots of
`max_lora_rank` when it loads the model (vllm/lora/layers: `create_lora_weights`), so the
profiler counts them with the weights and the KV cache gets that much less. For a dense
decoder the wrapped layers are every linear layer, the token embedding and the LM head:

- qkv_proj (column-parallel, 3 slices): A 3 x R x H, B R x (Q + 2K) / tp
- o_proj (row-parallel): A R x Q / tp, B H x R
- gate_up_proj (column-parallel, 2 slices): A 2 x R x H, B 2 x R x I / tp
- down_proj (row-parallel): A R x I / tp, B H x R
- embed_tokens: A V x R, B H x R; lm_head: A R x H, B V x R

(H hidden, Q query heads x head dim, K KV heads x head dim, I intermediate, V vocabulary,
R rank), in the model's dtype. An MoE model's expert buffers are not counted.
"""

from __future__ import annotations

from gateway.capacity.catalog import ModelSpec

DTYPE_BYTES = {"fp32": 4, "float32": 4}  # LoRA takes the model's dtype; else 2 bytes


def lora_buffer_bytes(model: ModelSpec, *, max_loras: int, max_lora_rank: int, tp: int) -> int:
    """Bytes of adapter buffers on each GPU of a replica of `model` on `tp` GPUs."""
    hidden, inter, vocab = model.hidden_size, model.intermediate_size, model.vocab_size
    q = model.heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    per_layer = 7 * hidden + (2 * q + 2 * kv + 3 * inter) // tp
    embeddings = 2 * vocab + 2 * hidden
    elements = max_loras * max_lora_rank * (model.layers * per_layer + embeddings)
    return elements * DTYPE_BYTES.get(model.dtype, 2)
