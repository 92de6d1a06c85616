from pathlib import Path

import orjson

from gateway.admission.discovery import (
    KvCache,
    ServedModel,
    capacity_from_metrics,
    models_from_listing,
)
from tests.conftest import VLLM_FIXTURES as FIXTURES


def test_reads_vllm_cache_config_from_a_real_server() -> None:
    text = (FIXTURES / "vllm-0.32-metrics.txt").read_text()
    # num_gpu_blocks="8192" × block_size="128" in the captured vLLM 0.32 output, less the
    # one block vLLM keeps back
    assert capacity_from_metrics(text) == KvCache(tokens=8191 * 128, block_size=128)


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


MODELS_FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "vllm-0.32-models.json"


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
