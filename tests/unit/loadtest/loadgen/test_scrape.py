"""What the load generator reads off a vLLM backend's /metrics."""

from loadtest.loadgen.scrape import backend_state


def test_a_backends_kv_in_use_leaves_the_null_block_out_of_usage() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="32"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 480.0\n'
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5\n'
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 6.0\n'
    )
    assert backend_state(text) == {
        "capacity": 512,  # 32 blocks of 16, as vLLM reports its cache
        "in_flight": 248,  # half of the 31 blocks sequences may hold
        "kv_usage": 0.5,
        "running": 3,
        "waiting": 0,
        "preemptions": 2,
        "prefix_queries": 640,
        "prefix_hits": 480,
        "ttft_sum": 1.5,
        "ttft_count": 6,
    }
