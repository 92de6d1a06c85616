"""A replica under uvicorn reuses a shared system prompt's blocks and counts it as vLLM does."""

import httpx
import pytest

from gateway.admission.fleet.metrics_text import samples
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread
from tests.support.metrics import metrics_text

MODEL = "sim"
SYSTEM = {"role": "system", "content": "Answer as briefly as you can. " * 13 + "Be kind."}


def chat(question: str) -> dict[str, object]:
    messages = [SYSTEM, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


def metrics(url: str) -> tuple[dict[str, float], dict[str, str]]:
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for sample in samples(metrics_text(url)):
        if sample.name == "vllm:cache_config_info":
            info = sample.labels
        elif "le" not in sample.labels:
            labels, name = dict(sample.labels), sample.name
            if "source" in labels:  # vllm:prompt_tokens_by_source: one series per source
                name = f"{name}:{labels.pop('source')}"
            assert labels == {"engine": "0", "model_name": MODEL}, sample
            values[name] = sample.value
    return values, info


@pytest.mark.parametrize(("enabled", "hits"), [(True, 96), (False, 0)])
def test_a_second_chat_with_the_same_system_prompt_hits_its_full_blocks(
    enabled: bool, hits: int
) -> None:
    config = SimConfig(model=MODEL, kv_tokens=2048, speed=100.0, enable_prefix_caching=enabled)
    with ServerThread(create_sim_app(config)) as sim, httpx.Client(timeout=10) as client:
        answers = [
            client.post(f"{sim.url}/v1/chat/completions", json=chat(q)).json()
            for q in ("What is a KV cache?", "Why batch requests?")
        ]
        values, info = metrics(sim.url)
    # 3 + 100 + 1 system tokens, then the user turn's 3 template tokens: 107 shared ids,
    # 6 full blocks of 16; each prompt is 104 + (5 + 4) + 3 = 116 tokens
    assert [a["usage"]["prompt_tokens"] for a in answers] == [116, 116]
    assert values["vllm:prefix_cache_queries_total"] == (232 if enabled else 0)
    assert values["vllm:prefix_cache_hits_total"] == hits
    assert values["vllm:prompt_tokens_total"] == 232
    assert values["vllm:prompt_tokens_by_source_total:local_cache_hit"] == hits
    assert values["vllm:prompt_tokens_by_source_total:local_compute"] == 232 - hits
    assert values["vllm:prompt_tokens_by_source_total:external_kv_transfer"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0.0  # cached blocks nobody holds are free
    assert info["enable_prefix_caching"] == str(enabled)
