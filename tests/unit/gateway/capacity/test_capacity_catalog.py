"""The catalog as data, and models read from Hugging Face config.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.capacity import CapacityError, load_catalog
from gateway.capacity.hf_config import model_from_hf_config

CATALOG = load_catalog()

ISSUE_MODELS = [
    "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b",
    "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "qwen3-8b",
    "qwen3-14b", "qwen3-32b", "gemma-2-9b", "gemma-2-27b", "deepseek-v3",
]  # fmt: skip
ISSUE_GPUS = ["a10g", "l4", "l40s", "a100-40gb", "a100-80gb", "h100", "h200", "b200", "mi300x"]

LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
}


def write_config(tmp_path: Path, config: dict[str, object], name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_every_model_and_gpu_the_issue_lists_is_there() -> None:
    for name in ISSUE_MODELS:
        model = CATALOG.model(name)
        assert model.layers > 0 and model.params > model.hidden_size**2
    for name in ISSUE_GPUS:
        gpu = CATALOG.gpu(name)
        assert gpu.memory_gib > 20 and gpu.bandwidth_gb_s > 200 and gpu.bf16_tflops > 50


def test_names_are_case_insensitive_and_aliases_resolve() -> None:
    assert CATALOG.model("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"
    assert CATALOG.model("Qwen/Qwen3-32B").head_dim == 128  # not hidden / heads = 80
    assert CATALOG.gpu("H100-SXM").name == "h100"


def test_unknown_names_list_what_is_known() -> None:
    with pytest.raises(CapacityError, match=r"unknown model 'gpt-5'.*llama-3.1-8b.*qwen3-32b"):
        CATALOG.model("gpt-5")
    with pytest.raises(CapacityError, match=r"unknown GPU 'tpu-v5'.*a10g.*mi300x"):
        CATALOG.gpu("tpu-v5")


def test_flags_for_sliding_window_hybrid_and_mla() -> None:
    assert CATALOG.model("gemma-2-9b").hybrid and CATALOG.model("gemma-2-9b").sliding_window
    assert not CATALOG.model("qwen2.5-7b").hybrid
    deepseek = CATALOG.model("deepseek-v3")
    assert deepseek.mla is not None and deepseek.weight_dtype == "fp8"
    assert deepseek.active_params < deepseek.params / 10


def test_llama_config_json_reproduces_the_catalog_entry(tmp_path: Path) -> None:
    spec = model_from_hf_config(write_config(tmp_path, LLAMA_8B_CONFIG, "Llama-3.1-8B"))
    known = CATALOG.model("llama-3.1-8b")
    assert spec.name == "Llama-3.1-8B"
    assert spec.params == pytest.approx(known.params, rel=0.001)
    for name in ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "vocab_size"):
        assert getattr(spec, name) == getattr(known, name)
    assert spec.mla is None and not spec.hybrid and spec.sliding_window is None


def test_deepseek_config_json_gives_mla_fp8_and_the_moe_counts(tmp_path: Path) -> None:
    spec = model_from_hf_config(write_config(tmp_path, DEEPSEEK_V3_CONFIG))
    assert spec.mla is not None and spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim == 576
    assert spec.weight_dtype == "fp8" and spec.dtype == "bf16"
    assert spec.params == pytest.approx(671e9, rel=0.01)
    assert spec.active_params == pytest.approx(37.5e9, rel=0.05)
    assert spec.experts_per_token == 9


def test_sliding_window_and_hybrid_detection(tmp_path: Path) -> None:
    qwen = dict(LLAMA_8B_CONFIG, model_type="qwen2", sliding_window=131072)
    qwen["use_sliding_window"] = False
    assert model_from_hf_config(write_config(tmp_path, qwen, "q")).sliding_window is None
    mistral = dict(LLAMA_8B_CONFIG, model_type="mistral", sliding_window=4096)
    spec = model_from_hf_config(write_config(tmp_path, mistral, "m"))
    assert spec.sliding_window == 4096 and not spec.hybrid
    gemma = dict(LLAMA_8B_CONFIG, model_type="gemma2", sliding_window=4096, head_dim=256)
    spec = model_from_hf_config(write_config(tmp_path, gemma, "g"))
    assert spec.hybrid and spec.head_dim == 256
    layered = dict(LLAMA_8B_CONFIG, layer_types=["sliding_attention", "full_attention"] * 16)
    assert model_from_hf_config(write_config(tmp_path, layered, "l")).hybrid


def test_multimodal_config_reads_the_text_config(tmp_path: Path) -> None:
    wrapped = {"model_type": "llava", "text_config": LLAMA_8B_CONFIG}
    spec = model_from_hf_config(write_config(tmp_path, wrapped))
    assert spec.layers == 32 and spec.kv_heads == 8


def test_unreadable_config_is_a_capacity_error(tmp_path: Path) -> None:
    with pytest.raises(CapacityError, match="cannot read a model"):
        model_from_hf_config(write_config(tmp_path, {"hidden_size": 4096}))
    with pytest.raises(CapacityError, match="cannot read a model"):
        model_from_hf_config(tmp_path / "missing.json")
