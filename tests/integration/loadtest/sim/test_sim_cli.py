"""`spillgate sim` serves a replica, or with --provider the external provider, from the CLI."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from loadtest.procs import free_port, wait_for_port


@contextmanager
def spillgate_sim(
    *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, dict[str, object]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--json", *args]
    environ = None if env is None else {**os.environ, **env}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=environ)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}", info
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_sim_command_serves_a_replica_sized_from_the_catalog() -> None:
    args = ["--model", "served", "--catalog-model", "llama-3.1-8b", "--gpu", "h100"]
    sim = spillgate_sim(
        *args, "--max-model-len", "8192", "--speed", "100", "--answer-lengths", "max_tokens"
    )
    with sim as (url, info), httpx.Client(base_url=url, timeout=5, verify=False) as http:
        models = http.get("/v1/models").json()
        reply = http.post(
            "/v1/completions", json={"model": "served", "prompt": "hi", "max_tokens": 3}
        )
        metrics = http.get("/metrics").text
    assert info["kind"] == "vllm" and info["max_model_len"] == 8192
    assert models["data"][0]["id"] == "served"
    assert reply.json()["usage"]["completion_tokens"] == 3
    assert f'num_gpu_blocks="{info["num_gpu_blocks"]}"' in metrics


def test_sim_command_serves_adapters_and_loads_them_where_vllms_variable_allows() -> None:
    args = ["--model", "base", "--kv-tokens", "4096", "--speed", "100", "--enable-lora"]
    args += ["--lora-modules", "a1=/loras/a1", "a2", "--max-loras", "2"]
    load = {"lora_name": "a3", "lora_path": "/loras/a3"}
    allowed = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with spillgate_sim(*args, env=allowed) as (url, info), httpx.Client(base_url=url) as http:
        loaded = http.post("/v1/load_lora_adapter", json=load)
        models = http.get("/v1/models").json()["data"]
        reply = http.post("/v1/completions", json={"model": "a3", "prompt": "hi"})
    assert info["lora_modules"] == "a1,a2" and info["runtime_lora_updating"] is True
    assert loaded.text == "Success: LoRA adapter 'a3' added successfully."
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [
        ("base", "base", None),
        ("a1", "/loras/a1", "base"),
        ("a2", "a2", "base"),
        ("a3", "/loras/a3", "base"),
    ]
    assert reply.json()["model"] == "a3"
    with spillgate_sim(*args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}) as (url, info):
        refused = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert info["runtime_lora_updating"] is False and refused.status_code == 404


def test_sim_command_with_provider_flag_serves_the_provider() -> None:
    sim = spillgate_sim("--provider", "--api-key", "sk-cli", "--rpm", "1")
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": "Bearer sk-cli"}
    with sim as (url, info), httpx.Client(base_url=url, timeout=5, verify=False) as http:
        denied = http.post("/v1/chat/completions", json=payload)
        ok = http.post("/v1/chat/completions", json=payload, headers=auth)
        limited = http.post("/v1/chat/completions", json=payload, headers=auth)
    assert info["kind"] == "provider" and info["rpm"] == 1
    assert (denied.status_code, ok.status_code, limited.status_code) == (401, 200, 429)
    assert int(limited.headers["retry-after"]) == 60


def test_an_impossible_replica_is_refused_with_a_message() -> None:
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--kv-tokens", "512"]
    done = subprocess.run(
        [*cmd, "--max-model-len", "4096"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and "max_model_len=4096" in done.stderr
