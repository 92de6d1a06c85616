from gateway.discovery import capacity_from_metrics
from tests.conftest import VLLM_FIXTURES as FIXTURES


def test_reads_vllm_cache_config_from_a_real_server() -> None:
    text = (FIXTURES / "vllm-0.32-metrics.txt").read_text()
    # num_gpu_blocks="8192" × block_size="128" in the captured vLLM 0.32 output
    assert capacity_from_metrics(text) == 8192 * 128


def test_reads_sglang_max_total_tokens() -> None:
    text = (
        "# HELP sglang:max_total_num_tokens Maximum total tokens\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
        'sglang:max_total_num_tokens{model_name="m"} 123456.0\n'
    )
    assert capacity_from_metrics(text) == 123456


def test_no_capacity_metric_means_unknown() -> None:
    assert capacity_from_metrics("# TYPE up gauge\nup 1.0\n") is None
