"""Read a backend's KV-cache capacity from its own Prometheus metrics (vLLM or SGLang)."""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families


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
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                blocks = sample.labels.get("num_gpu_blocks", "")
                size = sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit() and int(blocks) > 1 and int(size) > 0:
                    total += (int(blocks) - 1) * int(size)
                    block_size = max(block_size, int(size))
                    found = True
        elif family.name == "sglang:max_total_num_tokens":
            for sample in family.samples:
                total += int(sample.value)
                block_size = max(block_size, 1)
                found = True
    return KvCache(tokens=total, block_size=block_size) if found else None
