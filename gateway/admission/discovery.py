"""What a backend tells about itself: its KV-cache capacity, from its own Prometheus metrics
(vLLM or SGLang), and the models it serves, from its `GET /v1/models`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from gateway.metrics_text import samples

VLLM_CACHE = "vllm:cache_config_info"
SGLANG_TOKENS = "sglang:max_total_num_tokens"


class KvCache(NamedTuple):
    """What a backend's KV cache can hold for admission: usable tokens, in whole blocks."""

    tokens: int
    block_size: int


def capacity_from_metrics(text: str) -> KvCache | None:
    """The KV cache the server reports, or None if it reports none.

    vLLM: `vllm:cache_config_info` labels num_gpu_blocks × block_size per engine, less one
    block per engine: vLLM's block pool keeps one (the null block) back, so 32 blocks hold
    31 blocks of sequences. SGLang: `sglang:max_total_num_tokens`, allocated token by token.
    """
    total = 0
    block_size = 0
    found = False
    for sample in samples(text, (VLLM_CACHE, SGLANG_TOKENS)):
        if sample.name == VLLM_CACHE:
            blocks = sample.labels.get("num_gpu_blocks", "")
            size = sample.labels.get("block_size", "")
            if blocks.isdigit() and size.isdigit() and int(blocks) > 1 and int(size) > 0:
                total += (int(blocks) - 1) * int(size)
                block_size = max(block_size, int(size))
                found = True
        else:
            total += int(sample.value)
            block_size = max(block_size, 1)
            found = True
    return KvCache(tokens=total, block_size=block_size) if found else None


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedModel:
    """One entry of a backend's `GET /v1/models`, as vLLM writes it."""

    id: str
    root: str | None = None
    max_model_len: int | None = None


def models_from_listing(data: Any) -> list[ServedModel] | None:
    """The models an OpenAI-style `/v1/models` body lists, or None when it is not a listing.

    vLLM reports each model's `max_model_len` (the context it accepts, prompt plus output)
    and `root` (the weights it loaded); servers that do not are read as not telling.
    """
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    models = []
    for entry in data["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        length = entry.get("max_model_len")
        root = entry.get("root")
        models.append(
            ServedModel(
                id=entry["id"],
                root=root if isinstance(root, str) else None,
                max_model_len=length
                if isinstance(length, int) and not isinstance(length, bool) and length > 0
                else None,
            )
        )
    return models
