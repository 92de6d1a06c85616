"""The gateway's assumptions about vLLM, checked against a real vLLM 0.32 (`make test-vllm`)."""

from __future__ import annotations

import asyncio
import math

import httpx
import orjson

from loadtest.bench.admission_fleet import BenchShape
from loadtest.loadgen.client import Result
from loadtest.loadgen.run import RunTarget, run_schedule
from loadtest.loadgen.workload import LengthDist, TenantKey, Workload, plan_requests
from loadtest.real_vllm import MODEL, STOP_TOKEN_IDS
from tests.support.overflow import eventually
from tests.vllm.conftest import SERVER, gateway, vllm_metrics

BLOCK_SIZE = 128  # vLLM's CPU backend allocates KV in blocks of 128 tokens
STOPS = {"stop_token_ids": list(STOP_TOKEN_IDS)}


def test_discovery_reads_capacity_in_blocks_less_the_one_vllm_keeps(vllm_url: str) -> None:
    state = vllm_metrics(vllm_url)
    assert state["capacity"] == SERVER.kv_tokens == 128 * BLOCK_SIZE
    with gateway(vllm_url) as gw:
        backend = gw.backend()
        assert backend["capacity_source"] == "metrics"
        assert backend["capacity_tokens"] == 127 * BLOCK_SIZE == 16_256
        assert gw.metric("spillgate_capacity_tokens") == 16_256


def test_discovery_reads_the_block_size(vllm_url: str) -> None:
    """A request held under static reservation holds prompt + max_tokens in whole blocks
    of vLLM's size (128 here), not of the configured default (16). The answer is long
    (over ten seconds) so that it still runs when a busy machine gets to look."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3900,
        "ignore_eos": True,  # random weights emit EOS now and then
        "stream": True,
    }
    with gateway(vllm_url, reservation={"mode": "max_tokens"}, feedback=False) as gw:
        with gw.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = r.iter_bytes()  # kept: a dropped iterator closes the stream
            next(chunks)
            assert gw.backend()["tokens_in_flight"] == 31 * BLOCK_SIZE  # "hi" and 3,900
        # released once the gateway sees the client gone, moments after it closed
        eventually(lambda: gw.backend()["tokens_in_flight"] == 0)


def test_max_model_len_is_discovered_and_enforced(vllm_url: str) -> None:
    with gateway(vllm_url) as gw, gw.client() as client:
        listed = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in listed] == [(MODEL, SERVER.max_model_len)]
        assert gw.backend()["max_model_len"] == 4096
        before = vllm_metrics(vllm_url)["vllm:prompt_tokens_total"]
        too_long = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4096,
        }
        response = client.post("/v1/chat/completions", json=too_long)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert vllm_metrics(vllm_url)["vllm:prompt_tokens_total"] == before


def _burst(gateway_url: str, key: str, size: int, *, seed: int) -> list[Result]:
    workload = Workload(
        model=MODEL,
        prompt_tokens=LengthDist.parse("uniform:32:256"),
        output_tokens=LengthDist.parse("2048"),
        tenants=[TenantKey(name="acme", key=key)],
    )
    plans = plan_requests([0.0] * size, workload, seed=seed)
    target = RunTarget(
        label="gateway",
        urls=[gateway_url],
        keys={"acme": key},
        shape=BenchShape(model=MODEL, extra=STOPS),
    )
    data = asyncio.run(run_schedule(plans, target=target, duration_s=0.0))
    return list(data.results)


def test_a_burst_through_the_gateway_causes_no_preemption(vllm_url: str) -> None:
    """48 streams of max_tokens 2048 whose answers end early, all at once: the gateway's
    admission never lets vLLM preempt, and nothing fails."""
    before = vllm_metrics(vllm_url)
    with gateway(vllm_url) as gw:
        results = _burst(gw.url, gw.key, 48, seed=4)
        assert gw.backend()["tokens_in_flight"] == 0
    after = vllm_metrics(vllm_url)
    assert after["preemptions"] - before["preemptions"] == 0
    assert [r for r in results if not r.ok and r.status != 503] == []
    assert sum(r.ok for r in results) >= 24


def test_usage_the_gateway_counts_matches_vllms_counters(vllm_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 300, "stream": True, **STOPS}
    body["stream_options"] = {"include_usage": True}
    before = vllm_metrics(vllm_url)
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    with gateway(vllm_url) as gw, gw.client() as client:
        for i in range(6):
            body["messages"] = [{"role": "user", "content": f"count {i} " * (10 + 7 * i)}]
            body["seed"] = i
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line.startswith("data: {")]
            final = orjson.loads(events[-1].removeprefix("data: "))["usage"]
            for kind in usage:
                usage[kind] += final[kind]
        counted = {
            kind: gw.metric("spillgate_tokens_total", kind=kind.removesuffix("_tokens"))
            for kind in usage
        }
    after = vllm_metrics(vllm_url)
    assert usage["completion_tokens"] < 6 * 300  # the stop ids ended answers early
    assert counted == usage
    assert (
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
        == (usage["prompt_tokens"])
    )
    assert (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        == (usage["completion_tokens"])
    )


def test_use_that_bypasses_the_gateway_lowers_its_limit(vllm_url: str) -> None:
    """A stream sent straight to vLLM shows in the KV use vLLM reports; the gateway reads it
    and leaves that much less room for its own admissions, and gets the room back after."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "bypass " * 600}],
        "max_tokens": 2400,
        "ignore_eos": True,
        "stream": True,
    }
    target = math.floor(16_256 * 0.9)
    with gateway(vllm_url) as gw:
        assert gw.backend()["limit_tokens"] == target
        with (
            httpx.Client(timeout=120.0) as direct,
            direct.stream("POST", f"{vllm_url}/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            chunks = r.iter_bytes()  # kept: a dropped iterator closes the stream
            next(chunks)
            enough = 5 * BLOCK_SIZE  # the prompt alone holds more
            eventually(lambda: (gw.backend()["reported_kv_tokens"] or 0) >= enough, within_s=10)
            backend = gw.backend()
            assert backend["tokens_in_flight"] == 0
            assert backend["limit_tokens"] <= target - enough
        eventually(lambda: gw.backend()["limit_tokens"] == target, within_s=10)
        assert gw.backend()["reported_kv_tokens"] == 0


def test_a_preempted_stream_is_aborted_by_vllm_and_goes_on_whole(vllm_url: str) -> None:
    """Two sheddable streams fill the pool (a small target fill); a standard one stops the
    newer: vLLM aborts it when its connection closes (two requests run there, not three,
    though its cache holds all of them), and the stopped stream goes on after it."""
    flood = {"model": MODEL, "max_tokens": 600, "stream": True, "ignore_eos": True}
    flood["stream_options"] = {"include_usage": True}
    shed = {"x-spillgate-priority": "sheddable"}

    async def scenario(gw_url: str, key: str) -> None:
        headers = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=gw_url, headers=headers, timeout=300) as client:

            async def read(
                body: dict[str, object], extra: dict[str, str], started: asyncio.Event
            ) -> list[str]:
                lines = []
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=extra
                ) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        lines.append(line)
                        started.set()
                return lines

            streams = []
            for i in range(2):
                started = asyncio.Event()
                body = {**flood, "messages": [{"role": "user", "content": f"story {i}"}]}
                streams.append(asyncio.create_task(read(body, shed, started)))
                await started.wait()
            assert running(vllm_url) == 2
            started = asyncio.Event()
            urgent = {**flood, "max_tokens": 50, "messages": [{"role": "user", "content": "now"}]}
            standard = asyncio.create_task(read(urgent, {}, started))
            await started.wait()
            assert running(vllm_url) == 2  # the standard stream and the older sheddable one
            assert not streams[1].done()
            await standard
            older, newer = await asyncio.gather(*streams)
        assert ": spillgate preempted" not in " ".join(older)
        assert any(line.startswith(": spillgate preempted; resumed after") for line in newer)
        events = [orjson.loads(line[6:]) for line in newer if line.startswith("data: {")]
        assert {e["id"] for e in events} == {events[0]["id"]}
        assert events[-1]["usage"]["completion_tokens"] == 600
        assert [line for line in newer if line][-1] == "data: [DONE]"

    with gateway(
        vllm_url, target_fill=0.08, reservation={"mode": "max_tokens"}, queue={"max_wait_s": 120}
    ) as gw:
        asyncio.run(scenario(gw.url, gw.key))
        assert gw.metric("spillgate_preemptions_total", result="continued") == 1


def running(vllm_url: str) -> float:
    return vllm_metrics(vllm_url)["running"]
