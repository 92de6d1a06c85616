"""Tests against a REAL vLLM (`make test-vllm`): what the gateway assumes, checked on vLLM's
own code. The server is the one loadtest/real_vllm/serve.sh starts: the tiny Llama with
a KV cache of 16,384 tokens (128 blocks of 128) and `max_model_len` 4096; its URL comes
in SPILLGATE_VLLM_URL. Without that variable `pytest` leaves this folder out
(tests/conftest.py), so `make test` never needs vLLM.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import parse_settings
from loadtest.bench.admission_fleet import process, wait_ready
from loadtest.bench.overhead import serve_command
from loadtest.loadgen.scrape import backend_state
from loadtest.procs import free_port
from loadtest.real_vllm import MODEL, RealVllm
from tests.support.fleet import ADMIN_TOKEN, admin_status, tenant
from tests.support.metrics import metric_sum, metrics_text, text_sum

SERVER = RealVllm()  # what `make test-vllm` starts
URL_ENV = "SPILLGATE_VLLM_URL"


@pytest.fixture(scope="session")
def vllm_url() -> str:
    return os.environ[URL_ENV].rstrip("/")


@dataclass(frozen=True, kw_only=True)
class Gateway:
    url: str
    key: str

    def client(self, **kwargs: Any) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120.0, **kwargs)

    def status(self) -> dict[str, Any]:
        return admin_status(self.url)

    def backend(self) -> dict[str, Any]:
        backend: dict[str, Any] = self.status()["pools"][0]["backends"][0]
        return backend

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.url, name, **labels)


@contextlib.contextmanager
def gateway(vllm_url: str, **pool_options: Any) -> Iterator[Gateway]:
    """`spillgate serve` in its own process (as deployed; an in-process gateway shares the
    GIL with the test's client and answers /admin/status late): one pool named as vLLM
    serves the model, capacity "auto"."""
    key = "sk-" + secrets.token_hex(8)
    config = {
        "tenants": [tenant("acme", key, requests_per_minute=100_000)],
        "pools": [
            {
                "name": MODEL,
                "backends": [{"url": vllm_url, "capacity": "auto"}],
                "overflow": ["queue", "reject"],
                **pool_options,
            }
        ],
    }
    parse_settings(config)  # a bad config fails here, with its problems, not as a dead process
    with tempfile.TemporaryDirectory(prefix="spillgate-vllm-test-") as tmp:
        path = Path(tmp, "gateway.yaml")
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [*serve_command(sys.executable, path), "--port", str(port)]
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}
        with process(cmd, port, log=Path(tmp, "gateway.log"), env=env) as url:
            wait_ready(url)
            yield Gateway(url=url, key=key)


def vllm_metrics(vllm_url: str) -> dict[str, float]:
    """The counters and gauges of vLLM's /metrics the tests compare, summed over engines."""
    text = metrics_text(vllm_url)
    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    return {**backend_state(text), **{name: text_sum(text, name) for name in names}}
