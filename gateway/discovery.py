"""Read a backend's KV-cache capacity from its own Prometheus metrics (vLLM or SGLang)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def capacity_from_metrics(text: str) -> int | None:
    """Tokens of KV cache the server reports, or None if it reports none.

    vLLM: `vllm:cache_config_info` labels num_gpu_blocks × block_size (summed over engines).
    SGLang: `sglang:max_total_num_tokens`.
    """
    total = 0
    found = False
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                blocks = sample.labels.get("num_gpu_blocks", "")
                size = sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    total += int(blocks) * int(size)
                    found = True
        elif family.name == "sglang:max_total_num_tokens":
            for sample in family.samples:
                total += int(sample.value)
                found = True
    return total if found else None
