"""The simulated replica ends answers as a model does: at a sampled EOS, capped by max_tokens.

Lengths are checked exactly against the sampler a request's seed selects, so the wire, the
engine and usage all agree with the pure logic in loadtest/sim/lengths.py.
"""

import asyncio
import statistics
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.lengths import Answer, AnswerLengths, Finish, LengthSampler, StopRule
from loadtest.sim.tokens import FillerText, chat_prompt_tokens
from tests.support.harness import ServerThread
from tests.support.metrics import types

MODEL = "sim"
FIXTURE = Path(__file__).parents[3] / "fixtures" / "vllm-0.32-metrics.txt"
GEOMETRIC = SimConfig(
    model=MODEL,
    kv_tokens=1_000_000,
    max_model_len=4096,
    speed=1000.0,
    answer_lengths=AnswerLengths.GEOMETRIC,
)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **extra}


def expected(
    *, cap: int, seed: int, mode: AnswerLengths = AnswerLengths.GEOMETRIC, **rule: Any
) -> Answer:
    sampler = LengthSampler(mode=mode, **({"vocab_size": 4096} if "stop_token_ids" in rule else {}))
    return sampler.answer(cap=cap, rule=StopRule(seed=seed, **rule))


async def post_all(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=b) for b in bodies)
        )
    assert {r.status_code for r in replies} == {200}
    return [r.json() for r in replies]


def test_answers_end_at_the_seeded_eos_with_vllm_finish_reasons_and_usage() -> None:
    seeds = range(200)
    with ServerThread(create_sim_app(GEOMETRIC)) as sim:
        replies = asyncio.run(post_all(sim.url, [chat(max_tokens=600, seed=s) for s in seeds]))
    got = [(r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) for r in replies]
    want = [(a.tokens, a.finish.value) for a in (expected(cap=600, seed=s) for s in seeds)]
    assert got == want
    assert all(
        r["choices"][0]["message"]["content"] == FillerText().text(0, n)
        for r, (n, _) in zip(replies, got, strict=True)
    )
    lengths = [n for n, _ in got]
    # geometric, mean 256 capped at 600: mean 256 (1 - e^-600/256) = 232
    assert statistics.fmean(lengths) == pytest.approx(232, rel=0.15)
    reasons = [reason for _, reason in got]
    assert reasons.count("length") == sum(1 for n in lengths if n == 600) > 0
    assert reasons.count("stop") > 100


def stream_once(url: str, body: dict[str, Any]) -> tuple[str, str, int]:
    """The text, the last finish_reason and the usage's completion tokens of one stream."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, completion = "", "", -1
    with (
        httpx.Client(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                completion = event["usage"]["completion_tokens"]
    return text, finish, completion


def test_a_seed_repeats_a_streamed_answer_exactly() -> None:
    answer = expected(cap=2048, seed=11)
    assert answer.finish is Finish.STOP
    with ServerThread(create_sim_app(GEOMETRIC)) as sim:
        first = stream_once(sim.url, chat(max_tokens=2048, seed=11))
        second = stream_once(sim.url, chat(max_tokens=2048, seed=11))
    assert first == second == (FillerText().text(0, answer.tokens), "stop", answer.tokens)


def test_ignore_eos_runs_to_max_tokens() -> None:
    with ServerThread(create_sim_app(GEOMETRIC)) as sim:
        replies = asyncio.run(
            post_all(sim.url, [chat(max_tokens=900, seed=s, ignore_eos=True) for s in range(10)])
        )
    assert {
        (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) for r in replies
    } == {(900, "length")}


def test_without_max_tokens_an_answer_may_run_to_the_end_of_the_context() -> None:
    config = SimConfig(
        model=MODEL, kv_tokens=4096, max_model_len=300, speed=1000.0, answer_lengths="geometric"
    )
    prompt = chat_prompt_tokens(chat()["messages"])
    with ServerThread(create_sim_app(config)) as sim:
        [reply] = asyncio.run(post_all(sim.url, [chat(ignore_eos=True)]))
    assert reply["usage"]["completion_tokens"] == 300 - prompt
    assert reply["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_stop_k_in_v_tokens_even_with_fixed_lengths() -> None:
    # max_tokens mode: no EOS of its own, as random weights; 16 ids of 4096 end answers
    config = SimConfig(model=MODEL, kv_tokens=1_000_000, max_model_len=4096, speed=1000.0,
                       vocab_size=4096)  # fmt: skip
    ids = list(range(8, 24))
    bodies = [chat(max_tokens=2048, seed=s, stop_token_ids=ids) for s in range(40)]
    with ServerThread(create_sim_app(config)) as sim:
        stopped = asyncio.run(post_all(sim.url, bodies))
        [plain] = asyncio.run(post_all(sim.url, [chat(max_tokens=2048, seed=1)]))
    want = [
        expected(cap=2048, seed=s, mode=AnswerLengths.MAX_TOKENS, stop_token_ids=tuple(ids))
        for s in range(40)
    ]
    assert [r["usage"]["completion_tokens"] for r in stopped] == [a.tokens for a in want]
    # vLLM names the stop id that ended an answer; an answer that ran to its cap has none
    assert [r["choices"][0]["stop_reason"] for r in stopped] == [a.stop_reason for a in want]
    assert {a.finish for a in want} == {Finish.STOP} and set(ids) >= {a.stop_reason for a in want}
    assert statistics.fmean(a.tokens for a in want) < 600
    assert plain["usage"]["completion_tokens"] == 2048
    assert plain["choices"][0]["finish_reason"] == "length"


def test_bad_stop_fields_are_refused_like_vllm() -> None:
    with ServerThread(create_sim_app(GEOMETRIC)) as sim, httpx.Client(base_url=sim.url) as http:
        codes = [
            http.post("/v1/chat/completions", json=chat(max_tokens=5, **bad)).status_code
            for bad in (
                {"stop_token_ids": ["x"]},
                {"stop": 3},
                {"ignore_eos": "yes"},
                {"min_tokens": 6},
                {"seed": 1.5},
            )
        ]
        accepted = http.post("/v1/chat/completions", json=chat(max_tokens=5, stop=["\n"]))
    assert codes == [400] * 5
    assert accepted.status_code == 200


def test_engine_metrics_have_the_names_and_types_of_vllm_0_32() -> None:
    with ServerThread(create_sim_app(GEOMETRIC)) as sim:
        text = httpx.get(f"{sim.url}/metrics", timeout=5).text
    ours, theirs = types(text), types(FIXTURE.read_text())
    names = ["vllm:kv_cache_usage_perc", "vllm:num_requests_running",
             "vllm:num_requests_waiting", "vllm:num_preemptions"]  # fmt: skip
    assert {n: ours[n] for n in names} == {n: theirs[n] for n in names}
    assert {n: ours[n] for n in names} == {
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_preemptions": "counter",
    }
    assert "vllm:num_preemptions_total{" in text and "vllm:num_preemptions_total{" in (
        FIXTURE.read_text()
    )


def test_an_answer_the_whole_cache_cannot_hold_is_refused_not_a_server_error() -> None:
    # 16 blocks of 16, one kept back: 240 tokens; prompt + 246 - 1 needs 16 blocks
    config = SimConfig(model=MODEL, kv_tokens=256, max_model_len=256, speed=1000.0)
    prompt = chat_prompt_tokens(chat()["messages"])
    with ServerThread(create_sim_app(config)) as sim, httpx.Client(base_url=sim.url) as http:
        refused = http.post("/v1/chat/completions", json=chat(max_tokens=256 - prompt))
        fits = http.post("/v1/chat/completions", json=chat(max_tokens=241 - prompt))
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "sequence can never fit in the KV cache"
    assert fits.status_code == 200
    assert fits.json()["usage"]["completion_tokens"] == 241 - prompt
