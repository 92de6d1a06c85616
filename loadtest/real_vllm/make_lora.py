"""Writes dummy LoRA adapters (PEFT's format) for the tiny Llama that serve.sh serves.

    $VLLM_VENV/bin/python loadtest/real_vllm/make_lora.py MODEL_DIR DIR [DIR ...]

Each DIR gets `adapter_config.json` and `adapter_model.safetensors`: rank 8 on q_proj and
v_proj of every layer, random weights, a different seed per DIR in the order given. Shapes
follow MODEL_DIR's config.json. With the random base model the text may not differ between
adapters; the answer's `model` names the one that served. Runs under the vLLM virtualenv,
which brings torch and safetensors; serve with `--enable-lora --max-lora-rank 8`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8


def make(model_dir: Path, out: Path, *, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    widths = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, width in widths.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(RANK, hidden, generator=generator) * 0.5
            b = torch.randn(width, RANK, generator=generator) * 0.5
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(widths),
        "base_model_name_or_path": str(model_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(peft, indent=1))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    model_dir, *outs = map(Path, argv)
    for n, out in enumerate(outs):
        make(model_dir, out, seed=1000 + n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
