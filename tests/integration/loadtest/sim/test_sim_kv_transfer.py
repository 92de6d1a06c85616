"""Two replicas under uvicorn play vLLM's disaggregated prefill and decode
(loadtest/sim/kv_transfer.py): the `kv_transfer_params` handshake, the shared folder, and
what a failed load does under each `kv_load_failure_policy`."""

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admission.fleet.metrics_text import samples
from loadtest.procs import free_port, wait_for_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from loadtest.sim.kv_transfer import ENTRY_FILE
from loadtest.sim.shutdown import ENGINE_DEAD
from tests.support.harness import ServerThread
from tests.support.metrics import metrics_text

MODEL = "sim"
PREFILL_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
DEAD = {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None,
                  "code": 500}}  # fmt: skip


def replica(**kwargs: Any) -> SimConfig:
    return SimConfig(model=MODEL, kv_tokens=32768, max_model_len=8192, **kwargs)


def prompt(tokens: int, *, first: int = 1000) -> list[int]:
    return list(range(first, first + tokens))


def completion(ids: list[int], max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, **fields}


def counters(url: str) -> dict[str, float]:
    """The prompt-source counters, `source` after a colon for vllm:prompt_tokens_by_source."""
    values: dict[str, float] = {}
    for sample in samples(metrics_text(url)):
        if "source" in sample.labels:
            values[f"{sample.name}:{sample.labels['source']}"] = sample.value
        elif sample.name.startswith(("vllm:prompt_tokens", "vllm:external_prefix_cache")):
            values[sample.name] = sample.value
    return values


def sources(local: int, cached: int, external: int, queried: int) -> dict[str, float]:
    return {
        "vllm:prompt_tokens_total": local + cached + external,
        "vllm:prompt_tokens_by_source_total:local_compute": local,
        "vllm:prompt_tokens_by_source_total:local_cache_hit": cached,
        "vllm:prompt_tokens_by_source_total:external_kv_transfer": external,
        "vllm:external_prefix_cache_queries_total": queried,
        "vllm:external_prefix_cache_hits_total": external,
    }


def prefill(client: httpx.Client, url: str, ids: list[int]) -> dict[str, Any]:
    """The prefill leg as vLLM's proxy sends it: unstreamed, one token."""
    body = completion(ids, 1, kv_transfer_params=PREFILL_LEG, stream=False)
    answer = client.post(f"{url}/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def stream(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, list[Any]]:
    """Seconds to the first event, and every event."""
    began = time.monotonic()
    first: float | None = None
    events: list[Any] = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: "):
                first = first or time.monotonic() - began
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    assert first is not None
    return first, events


def test_a_prefill_leg_answers_with_the_params_of_its_prompts_full_blocks() -> None:
    config = replica(kv_transfer="params", engine_id="prefill-0", speed=100.0)
    with ServerThread(create_sim_app(config)) as p, httpx.Client(timeout=10) as client:
        answer = prefill(client, p.url, prompt(602))
        unified = client.post(
            f"{p.url}/v1/completions", json=completion(prompt(40, first=50000), 1)
        ).json()
        values = counters(p.url)
    params = answer.pop("kv_transfer_params")
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 1
    assert isinstance(params.pop("remote_request_id"), str)
    # 602 tokens fill 37 blocks of 16; the prefiller is alone, so they are its first blocks
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(37)),
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": 1,
    }
    assert unified["kv_transfer_params"] is None  # not a prefill leg: nothing to hand on
    assert values == sources(local=642, cached=0, external=0, queried=642)


def test_a_decode_leg_loads_the_prompt_and_skips_its_prefill() -> None:
    long_prompt, other = prompt(6000), prompt(6000, first=20000)
    p_config = replica(kv_transfer="params", engine_id="prefill-0", speed=100.0)
    d_config = replica(kv_transfer="params", engine_id="decode-0")
    with (
        ServerThread(create_sim_app(p_config)) as p,
        ServerThread(create_sim_app(d_config)) as d,
        httpx.Client(timeout=30) as client,
    ):
        params = prefill(client, p.url, long_prompt)["kv_transfer_params"]
        # a first request pays for what a process does once, off the timings below
        warm_up = prefill(client, p.url, prompt(40, first=50000))["kv_transfer_params"]
        warm_up_body = completion(prompt(40, first=50000), 1, kv_transfer_params=warm_up)
        client.post(f"{d.url}/v1/completions", json=warm_up_body).raise_for_status()
        options = {"stream": True, "stream_options": {"include_usage": True}}
        loaded_ttft, events = stream(
            client, d.url, completion(long_prompt, 4, kv_transfer_params=params, **options)
        )
        local_ttft, _ = stream(client, d.url, completion(other, 4, **options))
        values = counters(d.url)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": 6000, "completion_tokens": 4,
                                   "total_tokens": 6004}  # fmt: skip
    # 6000 - 1 tokens hold 374 full blocks of 16: 5984 loaded, 16 computed; the other
    # prompt computed whole. At real speed 6000 tokens of prefill take about 0.19 s.
    # and the warm-up's 40: 32 loaded, 8 computed
    assert values == sources(local=8 + 16 + 6000, cached=0, external=32 + 5984, queried=12040)
    assert loaded_ttft < local_ttft / 2, (loaded_ttft, local_ttft)


def test_a_decode_leg_without_params_or_with_incomplete_ones_prefills_locally() -> None:
    config = replica(kv_transfer="params", engine_id="decode-0", speed=100.0)
    incomplete = {"do_remote_prefill": True, "remote_block_ids": [0, 1, 2]}  # no engine named
    with ServerThread(create_sim_app(config)) as d, httpx.Client(timeout=10) as client:
        plain = client.post(f"{d.url}/v1/completions", json=completion(prompt(100), 2))
        ignored = client.post(
            f"{d.url}/v1/completions",
            json=completion(prompt(100, first=5000), 2, kv_transfer_params=incomplete),
        )
        refused = client.post(
            f"{d.url}/v1/completions", json=completion(prompt(10), 2, kv_transfer_params="yes")
        )
        values = counters(d.url)
    assert (plain.status_code, ignored.status_code) == (200, 200)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "kv_transfer_params"
    assert values == sources(local=200, cached=0, external=0, queried=200)


def failing_params(port: int) -> dict[str, Any]:
    """Params naming an engine that the prefiller at `port` is not."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(10)),
        "remote_engine_id": "nobody",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
    }


def test_a_failed_transfer_kills_the_decoder_under_policy_fail() -> None:
    p_config = replica(kv_transfer="params", engine_id="prefill-0", speed=100.0)
    d_config = replica(kv_transfer="params", engine_id="decode-0", speed=100.0)
    with (
        ServerThread(create_sim_app(p_config)) as p,
        ServerThread(create_sim_app(d_config)) as d,
        httpx.Client(timeout=10) as client,
    ):
        body = completion(prompt(200), 2, kv_transfer_params=failing_params(p.port))
        failed = client.post(f"{d.url}/v1/completions", json=body)
        after = client.post(f"{d.url}/v1/completions", json=completion(prompt(20), 2))
        health = client.get(f"{d.url}/health")
    assert (failed.status_code, failed.json()) == (500, DEAD)
    assert (after.status_code, after.json()) == (500, DEAD)
    assert health.status_code == 503


def test_a_failed_transfer_is_computed_locally_under_policy_recompute() -> None:
    config = replica(kv_transfer="params", engine_id="decode-0", kv_load_failure_policy="recompute")
    with ServerThread(create_sim_app(config)) as d, httpx.Client(timeout=10) as client:
        # a port nothing listens on: the handshake is refused
        body = completion(prompt(200), 2, kv_transfer_params=failing_params(free_port()))
        answer = client.post(f"{d.url}/v1/completions", json=body)
        values = counters(d.url)
    assert answer.status_code == 200
    assert values == sources(local=200, cached=0, external=0, queried=200)


def test_spillgate_sim_exits_when_a_transfer_fails() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", MODEL,
           "--kv-transfer", "params", "--engine-id", "decode-0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as client:
            body = completion(prompt(50), 2, kv_transfer_params=failing_params(port))
            failed = client.post(f"{url}/v1/completions", json=body)
        assert (failed.status_code, failed.json()) == (500, DEAD)
        proc.wait(timeout=10)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def shared(path: Path, **kwargs: Any) -> SimConfig:
    return replica(
        kv_transfer="shared", kv_shared_path=str(path), block_size=128, speed=100.0, **kwargs
    )


def test_a_prompt_prefilled_on_one_engine_is_loaded_by_another(tmp_path: Path) -> None:
    ids = prompt(602)
    with (
        ServerThread(create_sim_app(shared(tmp_path))) as p,
        ServerThread(create_sim_app(shared(tmp_path))) as d,
        httpx.Client(timeout=10) as client,
    ):
        first = client.post(f"{p.url}/v1/completions", json=completion(ids, 1)).json()
        second = client.post(f"{d.url}/v1/completions", json=completion(ids, 5)).json()
        fresh = client.post(f"{d.url}/v1/completions", json=completion(prompt(300, first=9), 2))
        p_values, d_values = counters(p.url), counters(d.url)
    assert first["kv_transfer_params"] is None and second["kv_transfer_params"] is None
    assert second["usage"]["prompt_tokens"] == 602
    assert fresh.status_code == 200
    # one entry for each prompt: its 4 (602) and 2 (300) whole blocks of 128
    assert len([e for e in tmp_path.iterdir() if (e / ENTRY_FILE).is_file()]) == 2
    assert p_values == sources(local=602, cached=0, external=0, queried=602)
    assert d_values == sources(local=90 + 300, cached=0, external=512, queried=902)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_broken_shared_entry_fails_the_load(tmp_path: Path, policy: str) -> None:
    ids = prompt(602)
    with (
        ServerThread(create_sim_app(shared(tmp_path))) as p,
        ServerThread(create_sim_app(shared(tmp_path, kv_load_failure_policy=policy))) as d,
        httpx.Client(timeout=10) as client,
    ):
        client.post(f"{p.url}/v1/completions", json=completion(ids, 1)).raise_for_status()
        for part in tmp_path.glob(f"*/{ENTRY_FILE}"):
            part.unlink()  # the entry's folder stays: a partial transfer
        answer = client.post(f"{d.url}/v1/completions", json=completion(ids, 5))
        values = counters(d.url)
    if policy == "fail":
        assert (answer.status_code, answer.json()) == (500, DEAD)
    else:
        assert answer.status_code == 200
        assert values == sources(local=602, cached=0, external=0, queried=602)
