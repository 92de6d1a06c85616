import itertools
import math
from pathlib import Path

import orjson
import pytest

from gateway.admission.fleet.discovery import (
    KvCache,
    ServedModel,
    answer_lengths_from_metrics,
    capacity_from_metrics,
    merged,
    models_from_listing,
)
from tests.conftest import VLLM_FIXTURES as FIXTURES


def test_reads_vllm_cache_config_from_a_real_server() -> None:
    text = (FIXTURES / "vllm-0.32-metrics.txt").read_text()
    # num_gpu_blocks="8192" × block_size="128" in the captured vLLM 0.32 output, less the
    # one block vLLM keeps back
    assert capacity_from_metrics(text) == KvCache(
        tokens=8191 * 128, block_size=128, prefix_caching=True
    )


def test_an_engine_with_lora_reports_blocks_the_adapter_buffers_already_left() -> None:
    # vLLM 0.32's CPU build, tiny Llama, --gpu-memory-utilization 0.1 --enable-lora
    # --max-loras 8 --max-lora-rank 512: num_gpu_blocks="13137" (14,193 without LoRA; the
    # 1,056 between are its 132 MiB of adapter buffers, CAPACITY.md), so what discovery
    # reads needs no LoRA correction
    text = (FIXTURES / "vllm-0.32-lora-metrics.txt").read_text()
    assert 'num_gpu_blocks="13137"' in text and 'kv_cache_size_tokens="1681536"' in text
    assert capacity_from_metrics(text) == KvCache(
        tokens=(13137 - 1) * 128, block_size=128, prefix_caching=True
    )


def test_keeps_one_block_back_per_engine() -> None:
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="32"} 1.0\n'
        'vllm:cache_config_info{block_size="128",engine="1",num_gpu_blocks="32"} 1.0\n'
    )
    assert capacity_from_metrics(text) == KvCache(tokens=2 * 31 * 128, block_size=128)


def test_reads_sglang_max_total_tokens() -> None:
    text = (
        "# HELP sglang:max_total_num_tokens Maximum total tokens\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
        'sglang:max_total_num_tokens{model_name="m"} 123456.0\n'
    )
    assert capacity_from_metrics(text) == KvCache(tokens=123456, block_size=1)


def test_no_capacity_metric_means_unknown() -> None:
    assert capacity_from_metrics("# TYPE up gauge\nup 1.0\n") is None


MODELS_FIXTURE = Path(__file__).resolve().parents[4] / "fixtures" / "vllm-0.32-models.json"


def test_reads_the_served_models_context_and_root_from_a_real_vllm_listing() -> None:
    listing = orjson.loads(MODELS_FIXTURE.read_bytes())  # captured from vLLM 0.32's /v1/models
    assert models_from_listing(listing) == [
        ServedModel(id="tiny", root="/models/tiny", max_model_len=2048)
    ]


def test_a_listing_without_context_or_root_tells_only_the_names() -> None:
    listing = {"object": "list", "data": [{"id": "a"}, {"id": "b", "max_model_len": "big"}, 7]}
    assert models_from_listing(listing) == [ServedModel(id="a"), ServedModel(id="b")]


def test_a_body_that_is_not_a_listing_is_not_read_as_serving_nothing() -> None:
    assert models_from_listing({"error": "nope"}) is None
    assert models_from_listing(None) is None


def histogram(bounds: tuple[float, ...], counts: tuple[float, ...], total: float) -> str:
    """A vLLM page's generation-token histogram, as vLLM writes one."""
    lines = ["# TYPE vllm:request_generation_tokens histogram"]
    for bound, count in zip(bounds, counts, strict=True):
        le = "+Inf" if math.isinf(bound) else f"{bound}"
        lines.append(
            f'vllm:request_generation_tokens_bucket{{engine="0",le="{le}",model_name="m"}} {count}'
        )
    lines.append(f'vllm:request_generation_tokens_count{{engine="0",model_name="m"}} {counts[-1]}')
    lines.append(f'vllm:request_generation_tokens_sum{{engine="0",model_name="m"}} {total}')
    return "\n".join(lines) + "\n"


def test_reads_the_answer_lengths_a_real_server_generated() -> None:
    text = (FIXTURES / "vllm-0.32-metrics.txt").read_text()
    found = answer_lengths_from_metrics(text, model="tiny")
    assert found is not None
    # the captured page: 23 answers of 8,692 tokens, the cumulative counts at vLLM's bounds
    assert found.bounds[-3:] == (1000.0, 2000.0, math.inf)
    assert found.counts[-3:] == (23.0, 23.0, 23.0) and found.total == 8692.0
    lengths = found.lengths(1024)
    assert len(lengths) == 23  # no more than it saw
    assert sum(lengths) == pytest.approx(8692, abs=23)  # the mean it reports, within rounding
    # as many in each bucket as the histogram counts there
    in_bucket = [
        sum(1 for x in lengths if lo < x <= hi)
        for lo, hi in itertools.pairwise((0.0, *found.bounds))
    ]
    assert in_bucket == [0, 0, 1, 2, 2, 0, 10, 0, 0, 8, 0, 0]
    assert answer_lengths_from_metrics(text, model="other") is None


def test_lengths_from_a_histogram_keep_its_buckets_and_its_mean() -> None:
    bounds = (10.0, 100.0, 1000.0, math.inf)
    found = answer_lengths_from_metrics(
        histogram(bounds, (100, 700, 990, 1000), 250_000), model="m"
    )
    assert found is not None
    lengths = found.lengths(500)  # half of what it saw, in the same shares
    assert len(lengths) == 500
    assert sum(1 for x in lengths if x <= 10) == 50
    assert sum(1 for x in lengths if 10 < x <= 100) == 300
    assert sum(1 for x in lengths if 100 < x <= 1000) == 145
    assert sum(1 for x in lengths if x > 1000) == 5
    assert sum(lengths) / 500 == pytest.approx(250, rel=0.01)


def test_two_backends_answers_add_up_and_engines_of_one_server_too() -> None:
    bounds = (10.0, 100.0, math.inf)
    one = answer_lengths_from_metrics(histogram(bounds, (1, 3, 4), 100), model="m")
    two_engines = histogram(bounds, (1, 3, 4), 100) + histogram(bounds, (0, 2, 2), 60).replace(
        'engine="0"', 'engine="1"'
    ).replace("# TYPE vllm:request_generation_tokens histogram\n", "")
    other = answer_lengths_from_metrics(two_engines, model="m")
    assert other is not None and other.counts == (1, 5, 6) and other.total == 160
    both = merged([one, None, other])
    assert both is not None and both.counts == (2, 8, 10) and both.total == 260
    assert merged([None]) is None


def test_reads_sglangs_generation_histogram() -> None:
    text = (
        'sglang:generation_tokens_histogram_bucket{le="100.0",model_name="m"} 3.0\n'
        'sglang:generation_tokens_histogram_bucket{le="+Inf",model_name="m"} 4.0\n'
        'sglang:generation_tokens_histogram_sum{model_name="m"} 400.0\n'
    )
    found = answer_lengths_from_metrics(text, model="m")
    assert found is not None and found.count == 4 and found.total == 400
    # three within 100, so the fourth holds the rest of the sum
    assert sorted(found.lengths(4))[-1] >= 250
