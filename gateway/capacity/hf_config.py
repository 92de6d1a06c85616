"""A ModelSpec from a Hugging Face config.json, for models the catalog does not name."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.capacity.catalog import CapacityError, MlaSpec, ModelSpec

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}
_HYBRID_TYPES = {"gemma2", "gemma3", "gemma3_text", "cohere2", "jamba", "qwen3_next"}
_HYBRID_KEYS = ("sliding_window_pattern", "interleaved_sliding_window", "hybrid_override_pattern")


def _text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's numbers under text_config."""
    merged = dict(raw)
    merged.update(raw.get("text_config") or {})
    return merged


def _weight_dtype(cfg: Mapping[str, Any], dtype: str) -> str:
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" or quant.get("fmt", "").startswith("e4m3"):
        return "fp8"
    bits = quant.get("bits") or quant.get("w_bit")
    if bits in (4, 8):
        return f"int{bits}"
    return dtype


def _mla(cfg: Mapping[str, Any]) -> MlaSpec | None:
    if not cfg.get("kv_lora_rank"):
        return None
    return MlaSpec(kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"])


def _attention_params(cfg: Mapping[str, Any], hidden: int, heads: int, head_dim: int) -> int:
    if cfg.get("kv_lora_rank"):
        rope, nope = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
        q_rank, kv_rank, v_dim = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["v_head_dim"]
        q = (
            hidden * q_rank + q_rank * heads * (nope + rope)
            if q_rank
            else hidden * heads * (nope + rope)
        )
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
        return int(q + kv + heads * v_dim * hidden)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _ffn_params(cfg: Mapping[str, Any], hidden: int, layers: int) -> tuple[int, int, int]:
    """(total, active) FFN parameters over all layers, and experts one token uses."""
    dense = 3 * hidden * cfg["intermediate_size"]
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts")
    if not experts:
        return dense * layers, dense * layers, 1
    expert = 3 * hidden * (cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = cfg.get("n_shared_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 2
    dense_layers = cfg.get("first_k_dense_replace") or 0
    moe_layers = layers - dense_layers
    router = hidden * experts
    total = dense * dense_layers + moe_layers * ((experts + shared) * expert + router)
    active = dense * dense_layers + moe_layers * ((top_k + shared) * expert + router)
    return total, active, top_k + shared


def _is_hybrid(cfg: Mapping[str, Any]) -> bool:
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if types and len(set(types)) > 1:
        return True
    return cfg.get("model_type") in _HYBRID_TYPES or any(k in cfg for k in _HYBRID_KEYS)


def model_from_hf_config(path: Path, *, name: str | None = None) -> ModelSpec:
    try:
        cfg = _text_config(json.loads(path.read_text("utf-8")))
        return _spec(cfg, name or path.parent.name or path.stem)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, CapacityError):
            raise
        raise CapacityError(f"cannot read a model from {path}: {exc!r}") from exc


def _spec(cfg: Mapping[str, Any], name: str) -> ModelSpec:
    hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    attn = _attention_params(cfg, hidden, heads, head_dim) * layers
    ffn_total, ffn_active, experts_per_token = _ffn_params(cfg, hidden, layers)
    norms = (2 * layers + 1) * hidden
    dtype = _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelSpec(
        name=name,
        params=embed + attn + ffn_total + norms,
        active_params=embed + attn + ffn_active + norms,
        layers=layers,
        hidden_size=hidden,
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        experts_per_token=experts_per_token,
        vocab_size=vocab,
        max_position=cfg.get("max_position_embeddings") or 4096,
        dtype=dtype,
        weight_dtype=_weight_dtype(cfg, dtype),
        sliding_window=window,
        hybrid=_is_hybrid(cfg),
        mla=_mla(cfg),
    )
