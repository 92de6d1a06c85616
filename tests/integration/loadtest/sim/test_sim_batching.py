"""The simulated replica batches within its KV budget, queues, preempts and frees on disconnect.

Its /metrics are read as Prometheus would, with prometheus_client's own parser.
"""

import asyncio
import time

import httpx
import pytest

from gateway.admission.fleet.metrics_text import samples
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.tokens import FillerText, chat_prompt_tokens
from tests.support.harness import ServerThread
from tests.support.metrics import metrics_text, types

MODEL = "sim"
LABELS = {"engine": "0", "model_name": MODEL}


def scrape(url: str) -> dict[str, float]:
    """Every sample without a bucket label, by name; vLLM's labels are checked on each."""
    return parse(metrics_text(url))


def parse(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for sample in samples(text):
        if "le" in sample.labels:
            continue
        name, labels = sample.name, dict(sample.labels)
        if "source" in labels:  # vllm:prompt_tokens_by_source: one series per source
            name = f"{name}:{labels.pop('source')}"
        if name != "vllm:cache_config_info":
            assert labels == LABELS, sample
        values[name] = sample.value
    return values


def wait_for(url: str, check: dict[str, float], *, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(url)
        if all(values[k] == v for k, v in check.items()) or time.monotonic() > deadline:
            return values
        time.sleep(0.02)


def body(content_chars: int, max_tokens: int, *, stream: bool = True) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x" * content_chars}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


async def stream_text(client: httpx.AsyncClient, payload: dict[str, object]) -> str:
    import json

    text = []
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["delta"].get("content", ""))
                else:
                    usage = chunk["usage"]
                    assert usage["completion_tokens"] == payload["max_tokens"]
    return "".join(text)


def run_concurrently(url: str, payloads: list[dict[str, object]]) -> list[str]:
    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=20, verify=False) as client:
            return await asyncio.gather(*(stream_text(client, p) for p in payloads))

    return asyncio.run(main())


def test_metrics_have_vllm_names_labels_and_honest_counters() -> None:
    config = SimConfig(model=MODEL, kv_tokens=2048, block_size=16, speed=100.0)
    with ServerThread(create_sim_app(config)) as sim:
        run_concurrently(sim.url, [body(40, 5), body(80, 7)])
        text = metrics_text(sim.url)
    kinds = types(text)
    values = parse(text)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ):
        assert kinds[name] == "gauge"
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions"):
        assert kinds[name] == "counter"
    assert kinds["vllm:time_to_first_token_seconds"] == "histogram"
    info = next(s for s in samples(text) if s.name == "vllm:cache_config_info")
    assert info.value == 1.0
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("16", "128")
    prompts = [chat_prompt_tokens([{"role": "user", "content": "x" * n}]) for n in (40, 80)]
    assert values["vllm:prompt_tokens_total"] == sum(prompts)
    assert values["vllm:generation_tokens_total"] == 12
    assert values["vllm:time_to_first_token_seconds_count"] == 2
    assert values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0
    assert values["sim_requests_finished_total"] == 2


def test_over_subscribed_requests_wait_and_the_kv_budget_holds() -> None:
    # each request: 57 prompt tokens + 7 output = 4 blocks; 17 blocks, one kept back, hold 4.
    # The prompts are all the same: without the prefix cache each holds blocks of its own.
    config = SimConfig(
        model=MODEL, kv_tokens=272, max_model_len=256, speed=1.0, enable_prefix_caching=False
    )
    with ServerThread(create_sim_app(config)) as sim:
        texts = run_concurrently(sim.url, [body(200, 7) for _ in range(8)])
        values = scrape(sim.url)
    assert texts == [FillerText().text(0, 7)] * 8
    assert values["sim_peak_running"] == 4
    assert values["sim_peak_waiting"] >= 1
    assert values["sim_peak_kv_tokens"] == 256 and values["sim_kv_capacity_tokens"] == 272
    assert values["vllm:num_preemptions_total"] == 0
    assert values["sim_peak_reserved_tokens"] > 272  # what was asked of it, not what it held


def test_sequences_that_outgrow_the_cache_are_preempted_and_still_answer_in_full() -> None:
    # 4 prompts of 12 tokens fit in 4 blocks; growing to 71 tokens each they cannot share 8
    config = SimConfig(model=MODEL, kv_tokens=128, max_model_len=128, speed=50.0)
    with ServerThread(create_sim_app(config)) as sim:
        texts = run_concurrently(sim.url, [body(20, 60) for _ in range(4)])
        values = scrape(sim.url)
    assert texts == [FillerText().text(0, 60)] * 4  # recompute neither repeats nor skips
    assert values["vllm:num_preemptions_total"] >= 1
    assert values["sim_peak_kv_tokens"] <= 128
    assert values["vllm:generation_tokens_total"] == 240


@pytest.fixture
def slow_sim() -> ServerThread:
    # real time: 1,000 tokens take about 8 s, so a request is surely mid-flight when dropped
    config = SimConfig(model=MODEL, kv_tokens=4096, max_model_len=2048, speed=1.0)
    return ServerThread(create_sim_app(config))


def test_client_disconnect_mid_stream_frees_the_kv_cache_at_once(slow_sim: ServerThread) -> None:
    with slow_sim as sim, httpx.Client(base_url=sim.url, timeout=10, verify=False) as client:
        with client.stream("POST", "/v1/chat/completions", json=body(40, 1000)) as response:
            chunks = response.iter_raw()  # held: a dropped iterator closes the connection
            assert next(chunks).startswith(b"data: ")
            during = scrape(sim.url)
        after = wait_for(sim.url, {"sim_requests_aborted_total": 1, "vllm:kv_cache_usage_perc": 0})
    assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0
    assert after["sim_requests_aborted_total"] == 1
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:num_requests_running"] == 0
    assert after["sim_reserved_tokens"] == 0


def test_a_client_giving_up_on_a_non_streamed_request_frees_it(slow_sim: ServerThread) -> None:
    with slow_sim as sim:
        with httpx.Client(timeout=0.3, verify=False) as client, pytest.raises(httpx.ReadTimeout):
            client.post(f"{sim.url}/v1/chat/completions", json=body(40, 1000, stream=False))
        after = wait_for(sim.url, {"sim_requests_aborted_total": 1, "vllm:num_requests_running": 0})
    assert after["sim_requests_aborted_total"] == 1 and after["vllm:kv_cache_usage_perc"] == 0
